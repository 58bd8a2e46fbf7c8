"""hf_loopspec: looped (recurrent-depth) language models for Hugging Face Transformers 5.x.

Importing the package registers its model classes with the `transformers` Auto factories, so
`AutoModelForCausalLM.from_pretrained("ByteDance/Ouro-1.4B")` returns `hf_loopspec.OuroForCausalLM` and
`tomg-group-umd/huginn-0125` a `hf_loopspec.HuginnForCausalLM` (with or without `trust_remote_code`).
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .assets import default_model_path
from .cache.paged import CacheCapacityError, LineageError, PagedLoopCache
from .looped import KVAttention, KVLayout, LoopedModel
from .models.huginn import HuginnConfig, HuginnForCausalLM, HuginnModel, HuginnPreTrainedModel
from .models.ouro import OuroConfig, OuroForCausalLM, OuroModel, OuroPreTrainedModel

__version__ = "0.1.0"

for _config, _model, _causal_lm in ((OuroConfig, OuroModel, OuroForCausalLM),
                                     (HuginnConfig, HuginnModel, HuginnForCausalLM)):
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
    AutoModel.register(_config, _model, exist_ok=True)
    AutoModelForCausalLM.register(_config, _causal_lm, exist_ok=True)

__all__ = [
    "CacheCapacityError",
    "HuginnConfig",
    "HuginnForCausalLM",
    "HuginnModel",
    "HuginnPreTrainedModel",
    "KVAttention",
    "KVLayout",
    "LineageError",
    "LoopedModel",
    "OuroConfig",
    "OuroForCausalLM",
    "OuroModel",
    "OuroPreTrainedModel",
    "PagedLoopCache",
    "default_model_path",
]
