"""hf_loopspec: looped (recurrent-depth) language models for Hugging Face Transformers 5.x.

Importing the package registers its model classes with the `transformers` Auto factories (`register`), so
`AutoModelForCausalLM.from_pretrained("ByteDance/Ouro-1.4B")` returns `hf_loopspec.OuroForCausalLM` and
`tomg-group-umd/huginn-0125` a `hf_loopspec.HuginnForCausalLM` (with or without `trust_remote_code`).

The public names are imported on first use. The one exception to registering at import is the `hf-loopspec`
console script (`hf_loopspec_cli`): it answers `--help` and argument errors without loading torch, and registers
before it runs a command.
"""

from __future__ import annotations

import importlib
import sys

__version__ = "0.1.0"

_EXPORTS = {
    "CacheCapacityError": ".cache.paged",
    "LineageError": ".cache.paged",
    "PagedLoopCache": ".cache.paged",
    "KVAttention": ".looped",
    "KVLayout": ".looped",
    "LoopedModel": ".looped",
    "HuginnConfig": ".models.huginn",
    "HuginnForCausalLM": ".models.huginn",
    "HuginnModel": ".models.huginn",
    "HuginnPreTrainedModel": ".models.huginn",
    "OuroConfig": ".models.ouro",
    "OuroForCausalLM": ".models.ouro",
    "OuroModel": ".models.ouro",
    "OuroPreTrainedModel": ".models.ouro",
    "default_model_path": ".assets",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:  # the lazy names too, for dir(), help() and tab completion
    return sorted({*globals(), *_EXPORTS})


def register() -> None:
    """Register the Ouro and Huginn config and model classes with `AutoConfig`, `AutoModel` and
    `AutoModelForCausalLM` (idempotent)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    from .models.huginn import HuginnConfig, HuginnForCausalLM, HuginnModel
    from .models.ouro import OuroConfig, OuroForCausalLM, OuroModel

    for config, model, causal_lm in ((OuroConfig, OuroModel, OuroForCausalLM),
                                     (HuginnConfig, HuginnModel, HuginnForCausalLM)):
        AutoConfig.register(config.model_type, config, exist_ok=True)
        AutoModel.register(config, model, exist_ok=True)
        AutoModelForCausalLM.register(config, causal_lm, exist_ok=True)


if not getattr(sys.modules.get("hf_loopspec_cli"), "DEFER_REGISTRATION", False):
    register()

__all__ = sorted([*_EXPORTS, "register"])
