"""hf_loopspec: looped (recurrent-depth) language models for Hugging Face Transformers 5.x.

Importing the package registers its model classes with the `transformers` Auto factories, so
`AutoModelForCausalLM.from_pretrained("ByteDance/Ouro-1.4B")` returns `hf_loopspec.OuroForCausalLM`
(with or without `trust_remote_code`).
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .assets import default_model_path
from .cache.paged import CacheCapacityError, LineageError, PagedLoopCache
from .looped import KVAttention, KVLayout, LoopedModel
from .models.ouro import OuroConfig, OuroForCausalLM, OuroModel, OuroPreTrainedModel

__version__ = "0.1.0"

AutoConfig.register(OuroConfig.model_type, OuroConfig, exist_ok=True)
AutoModel.register(OuroConfig, OuroModel, exist_ok=True)
AutoModelForCausalLM.register(OuroConfig, OuroForCausalLM, exist_ok=True)

__all__ = [
    "CacheCapacityError",
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
