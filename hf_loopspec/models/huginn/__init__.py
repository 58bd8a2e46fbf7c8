from .configuration_huginn import HuginnConfig
from .modeling_huginn import HuginnForCausalLM, HuginnModel, HuginnPreTrainedModel

__all__ = ["HuginnConfig", "HuginnForCausalLM", "HuginnModel", "HuginnPreTrainedModel"]
