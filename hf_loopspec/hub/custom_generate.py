"""The logic behind an exported repo's `custom_generate/generate.py`.

transformers 5.x runs a repo's `custom_generate/generate.py` in two ways, and both end here:

* `model.generate(..., custom_generate="<repo or folder>", trust_remote_code=True)` calls
  `generate(model=model, **every_generate_argument)`: `inputs`, `generation_config`, `logits_processor`,
  `stopping_criteria`, `streamer`, ... and the caller's keyword arguments (`input_ids`, `attention_mask`,
  `speculative_mode`, ...). Nothing has been preprocessed yet, and the streamer is passed on (unlike
  `custom_generate=<callable>`, which replaces only the decoding loop and drops the streamer).
* `from_pretrained(<repo with custom_generate/>, trust_remote_code=True)` replaces `model.generate` by
  `functools.partial(generate, model=model)`, so `model.generate(input_ids, ...)` arrives here too, with the
  caller's positional arguments.

`generate(model, *args, **kwargs)` runs `LoopSpecGenerationMixin.generate` on an hf_loopspec model: `model`
itself when it is one (calling the class's method, since the instance's `generate` may be this function), or
else a borrowed `hf_loopspec.OuroForCausalLM` that shares the model's parameters (see `borrow`).
"""

from __future__ import annotations

import copy
import weakref

import torch
from torch import nn

from ..generation.mixin import LoopSpecGenerationMixin
from ..models.ouro import OuroConfig, OuroForCausalLM

_BORROWED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # source model -> borrowed OuroForCausalLM


def generate(model: nn.Module, *args, **kwargs):
    """`generate` with hf_loopspec's speculative modes on `model` (an hf_loopspec model or any Ouro-weighted model)."""
    looped = model if isinstance(model, LoopSpecGenerationMixin) else borrow(model)
    return type(looped).generate(looped, *args, **kwargs)


def borrow(model: nn.Module) -> OuroForCausalLM:
    """An `hf_loopspec.OuroForCausalLM` whose parameters ARE `model`'s (the same `nn.Parameter` objects).

    `model` is any module with an Ouro config (`model.config`, e.g. upstream remote code or another port) and the
    Ouro parameter names (`model.embed_tokens.weight`, `model.layers.{i}...`, `lm_head.weight`; see
    `hf_loopspec.OuroConfig`). The wrapper is built on the meta device and its parameters are then set to the
    source's objects, so no weight is copied; dtype and device are the source's, and in-place changes to the
    source's parameters (`.to()`, `.half()`, fine-tuning) show in the wrapper. It is cached per source and
    rebuilt when the source's parameters or config change. The source's `generation_config` is copied on every
    call, so edits to it apply. Raises `ValueError` when `model` is not an Ouro model.
    """
    config = _ouro_config(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    cached = _BORROWED.get(model)
    if cached is not None and cached.config.to_dict() == config.to_dict() and _shares(cached, params):
        looped = cached
    else:
        looped = _build(config, params, type(model).__name__)
        _BORROWED[model] = looped
    looped.train(model.training)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        looped.generation_config = copy.deepcopy(generation_config)
    return looped


def _ouro_config(model: nn.Module) -> OuroConfig:
    source = getattr(model, "config", None)
    if source is None or not hasattr(source, "to_dict"):
        raise ValueError(f"{type(model).__name__} has no `config`; hf-loopspec's custom_generate needs an Ouro model.")
    values = source.to_dict()
    if values.get("model_type") != OuroConfig.model_type:
        raise ValueError(
            f"hf-loopspec's custom_generate runs Ouro (looped) models; {type(model).__name__} has model_type="
            f"{values.get('model_type')!r}. Load an Ouro checkpoint (e.g. ByteDance/Ouro-1.4B)."
        )
    for key in ("auto_map", "architectures", "transformers_version", "_name_or_path", "model_type"):
        values.pop(key, None)
    return OuroConfig.from_dict(values)


def _shares(looped: OuroForCausalLM, params: dict[str, nn.Parameter]) -> bool:
    return all(params.get(name) is p for name, p in looped.named_parameters(remove_duplicate=False))


def _build(config: OuroConfig, params: dict[str, nn.Parameter], source_name: str) -> OuroForCausalLM:
    with torch.device("meta"):
        looped = OuroForCausalLM(config)
    wanted = dict(looped.named_parameters(remove_duplicate=False))
    missing = sorted(set(wanted) - set(params))
    mismatched = sorted(name for name in set(wanted) & set(params) if params[name].shape != wanted[name].shape)
    if missing or mismatched:
        details = []
        if missing:
            details.append(f"missing {missing[:6]}{' ...' if len(missing) > 6 else ''}")
        if mismatched:
            details.append("mis-shaped " + ", ".join(
                f"{n} {tuple(params[n].shape)} (config wants {tuple(wanted[n].shape)})" for n in mismatched[:4]))
        raise ValueError(
            f"{source_name}'s parameters do not match an Ouro model of its config ({'; '.join(details)}). "
            "hf-loopspec's custom_generate shares the weights of a model with Ouro's parameter names."
        )
    for name in wanted:
        owner, _, attr = name.rpartition(".")
        setattr(looped.get_submodule(owner), attr, params[name])  # the same Parameter object: shared, not copied
    leftover = [name for name, b in looped.named_buffers() if b.is_meta]
    if leftover:  # the package's Ouro has no buffers; a future one must not run on meta tensors
        raise ValueError(f"cannot share weights: the hf_loopspec model has buffers {leftover} with no source.")
    return looped


__all__ = ["borrow", "generate"]
