"""What about a model itself keeps speculative decoding from returning plain decoding's tokens, in which case
`generate` decodes plainly instead, logs the reason once and reports it in `out.speculation.fallback` (as for a
logits processor it cannot run, `processors.plain_fallback`); and, in every mode, a model whose weights are not
there at all (`check_weights_present`: on the meta device with no accelerate hook to load them).

Speculative decoding is exact because a row's output does not depend on the other rows of its call, and because
the stages the engine calls (`embed`, `core`, `head`) do all that a forward call does. These changes a user can make
to a model break that:

* torch.ao's dynamic quantization (`quantize_dynamic`) takes one activation scale per call over all its rows, so a
  token's output depends on which rows share the call, and the engine's calls hold other rows than plain decoding's;
* torchao's activation quantization (weights with `ACTIVATION_QUANTIZATION`, e.g. int8 dynamic activation) rounds each
  activation to a coarse grid, so the last-bit differences between the engine's calls (other shapes) and plain
  decoding's become whole steps, and tokens differ (its weight-only quantization keeps speculative decoding);
* forward hooks (or pre-hooks) on the causal LM or its base model run only when that module is called, and the
  engine calls its stages instead. Hooks on the layers, the norms and the head run in both. Global module hooks
  (`torch.nn.modules.module.register_module_forward_hook`) run on every module, those two included;
* PEFT's per-row arguments of `generate` (`adapter_names`: one LoRA adapter per row, `alora_offsets`) reach its
  layers through pre-hooks that split each layer's input by batch row, and the engine's calls hold their rows
  otherwise; so do the `task_ids` of PEFT's Poly layers, which every call of such a layer takes;
* an input embedding of another dtype than all the other weights (e.g. `embed_tokens.half()` on an fp32 model):
  the engine keeps its lanes in the embedding's dtype;
* a `prepare_inputs_for_generation` set on the model instance changes what plain decoding feeds the model, and the
  engine never calls it: PEFT's prompt learning (prompt tuning, p-tuning) prepends its virtual tokens that way.
  PEFT sets one for every adapter; those of adapters that are neither prompt learning nor POLY (LoRA, ...) pass
  the inputs through unchanged, so those keep speculative decoding.

PEFT's prefix tuning (and its cartridges) cannot decode a looped model in any mode (`check_no_prefix_cache`).
"""

from __future__ import annotations

import torch
from torch.nn.modules import module as torch_module

from .offloaded import offloaded

DYNAMIC_QUANTIZED = "torch.ao.nn.quantized.dynamic"  # the modules `quantize_dynamic` puts in place
ACTIVATION_QUANTIZATION = ("act_quant_kwargs", "activation_quantization")  # torchao weights that quantize inputs
PEFT_PER_ROW = ("adapter_names", "alora_offsets")  # keywords of PEFT's pre-hooks on its layers during `generate`
PEFT_ROW_ROUTED = {"peft.tuners.poly": "task_ids"}  # PEFT's layers that take a per-row argument in every call
PEFT_PREFIX_KV = ("PREFIX_TUNING", "CARTRIDGE")  # PEFT's adapters that pass their prefix as a KV cache
PLAINLY = "; decoded with plain decoding instead"


def execution_device(model) -> torch.device:
    """Where `model`'s calls compute: its device, or for a model accelerate offloads (weights on the meta device, moved
    in by hooks at each call) the hooks' execution device (the CPU when none says)."""
    if model.device.type != "meta":
        return model.device
    devices = (getattr(getattr(m, "_hf_hook", None), "execution_device", None) for m in model.modules())
    return torch.device(next((d for d in devices if d is not None), "cpu"))


def model_fallback(model) -> str | None:
    """Why `model` cannot decode speculatively with plain decoding's tokens (module docstring), or None."""
    problem = model_problem(model)
    if problem is not None:
        return problem + PLAINLY
    return _own_inputs_preparation(model)


def dense_cache_reason(model) -> str | None:
    """Why `model` must decode on a `DynamicCache`, as plain decoding does, not on a `PagedLoopCache`, or None. Its
    calls must take `[batch, length, ...]` inputs, padding included (a `PagedLoopCache` lays the rows out flat,
    without padding), when PEFT's per-row arguments split each layer's input by batch row, a dynamically quantized
    layer takes one activation scale over all the rows and positions of its call, or activation-quantized weights
    (torchao) round the last-bit differences of other call shapes into other tokens; and its KV must keep the
    layers' dtype when its input embedding has another (a `PagedLoopCache` keeps the embedding's, `lane_dtype`)."""
    flat = ", and a PagedLoopCache lays the rows out flat, without padding"
    per_row = per_row_arguments(model)
    if per_row:
        return f"PEFT's {' and '.join(per_row)} split each layer's input by batch row{flat}"
    if _dynamic_quantized(model):
        return f"the model's dynamically quantized layers take one activation scale over all the rows of a call{flat}"
    if _activation_quantized(model):
        return f"the model's weights quantize their inputs, which turns other call shapes into other tokens{flat}"
    if mixed := _mixed_dtypes(model):
        return (f"the model's input embedding is {mixed[0]}, not the dtype of its other weights, and a PagedLoopCache "
                "keeps the KV in the embedding's dtype")
    return None


def _dynamic_quantized(model) -> list[str]:
    return sorted({type(m).__name__ for m in model.modules() if type(m).__module__.startswith(DYNAMIC_QUANTIZED)})


def _activation_quantized(model) -> list[str]:
    return sorted({type(w).__name__ for w in model.parameters() if "ActivationQuantized" in type(w).__name__
                   or any(getattr(w, key, None) is not None for key in ACTIVATION_QUANTIZATION)})


def model_problem(model) -> str | None:
    """Why the engine's stage calls would not give `model`'s plain tokens (quantized layers, hooks), or None: the
    engine cannot decode such a model at all (continuous batching refuses it)."""
    dynamic = _dynamic_quantized(model)
    if dynamic:
        return (f"the model holds dynamically quantized layers ({', '.join(dynamic)}), whose output for a token "
                "depends on the other rows of its call (one activation scale per call), so speculative decoding "
                "could change the tokens")
    quantized = _activation_quantized(model)
    if quantized:
        return (f"the model's weights ({', '.join(quantized)}) quantize the activations they meet (torchao), which "
                "turns the rounding differences between the engine's calls and plain decoding's into other tokens")
    if mixed := _mixed_dtypes(model):
        return (f"the input embedding is {mixed[0]} and the other weights {', '.join(mixed[1])}: the engine keeps its "
                "lanes in the embedding's dtype (cast the whole model, e.g. model.to(torch.bfloat16), to decode it "
                "speculatively)")
    per_row = per_row_arguments(model)
    if per_row:
        return (f"PEFT's {' and '.join(per_row)} (per batch row) reach the layers through hooks that split their "
                "input by row, and speculative decoding calls the layers on rows laid out otherwise")
    hooked = [name for name, module in (("the model", model), ("its base model", model.base_model))
              if module._forward_hooks or module._forward_pre_hooks]
    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        hooked.append("every module (global module hooks)")
    if hooked:
        return (f"forward hooks on {' and '.join(hooked)} run when the model itself is called, and speculative "
                "decoding calls its stages (embed, core, head) instead (hooks on the layers and the head run in "
                "both)")
    return None


def _mixed_dtypes(model) -> tuple[str, list[str]] | None:
    """(the input embedding's dtype, the other weights' dtypes) as names, when the embedding's floating dtype is none
    of the others' (the engine keeps its lanes in the embedding's, `lane_dtype`), else None."""
    embedding = model.get_input_embeddings().weight
    others = {p.dtype for p in model.parameters() if p.is_floating_point() and p is not embedding}
    if not embedding.is_floating_point() or not others or embedding.dtype in others:
        return None
    name = lambda dtype: str(dtype).removeprefix("torch.")  # noqa: E731
    return name(embedding.dtype), sorted(map(name, others))


def per_row_arguments(model) -> list[str]:
    """The per-row arguments of PEFT that its pre-hooks pass to `model`'s layers in this call (`PEFT_PER_ROW`), or
    that its layers in `model` always take (`PEFT_ROW_ROUTED`): they split each layer's input by batch row, so the
    model must be called on `[batch, length, ...]` inputs (plain decoding with a `DynamicCache`); a `PagedLoopCache`
    lays its rows out flat."""
    hooked = {key for m in model.modules() for hook in m._forward_pre_hooks.values()
              for key in getattr(hook, "keywords", {}) if key in PEFT_PER_ROW}
    routed = {key for m in model.modules() for package, key in PEFT_ROW_ROUTED.items()
              if type(m).__module__.startswith(package)}
    return sorted(hooked | routed)


def _peft_config(model):
    """The active PEFT config of the `prepare_inputs_for_generation` PEFT set on `model` for its `generate`, or None."""
    override = vars(model).get("prepare_inputs_for_generation")
    return getattr(getattr(override, "__self__", None), "active_peft_config", None)


def virtual_tokens(model) -> int:
    """The virtual tokens PEFT's prompt learning (prompt tuning, p-tuning) puts before the prompt of this call, which
    its cache holds beside the call's own positions; 0 without."""
    config = _peft_config(model)
    return int(getattr(config, "num_virtual_tokens", 0) or 0) if getattr(config, "is_prompt_learning", False) else 0


def check_no_prefix_cache(model) -> None:
    """`ValueError` for a PEFT adapter that passes its trained prefix as a KV cache (`PEFT_PREFIX_KV`, through the
    `prepare_inputs_for_generation` PEFT sets on the model during its `generate`): that cache holds one KV per layer,
    and a looped model writes one per (loop, layer), so no mode can decode with it."""
    kind = getattr(_peft_config(model), "peft_type", None)
    kind = str(getattr(kind, "value", kind))
    if kind in PEFT_PREFIX_KV:
        raise ValueError(f"the model carries a PEFT adapter of peft_type={kind}, which passes its trained prefix as a "
                         "KV cache of one KV per layer, but a looped model writes one KV per (loop, layer) and cannot "
                         "take it: use prompt tuning (PromptTuningConfig) or a weight adapter such as LoRA.")


def _own_inputs_preparation(model) -> str | None:
    """Why a `prepare_inputs_for_generation` of the model instance keeps it from speculating, or None."""
    override = vars(model).get("prepare_inputs_for_generation")
    own = getattr(override, "__func__", None) is type(model).prepare_inputs_for_generation  # (PEFT puts it back so)
    if override is not None and not own:
        peft_config = getattr(getattr(override, "__self__", None), "active_peft_config", None)
        passes_through = getattr(peft_config, "is_prompt_learning", True) is False \
            and str(getattr(peft_config, "peft_type", "")) not in ("POLY", "PeftType.POLY")  # POLY adds task ids
        if not passes_through:
            return ("the model instance has a prepare_inputs_for_generation of its own (PEFT's prompt learning sets "
                    "one to prepend its virtual tokens), which speculative decoding does not call" + PLAINLY)
    return None


def check_weights_present(model) -> None:
    """`ValueError` for a weight or buffer of `model` on the meta device (shapes only, no values) that no accelerate
    hook loads at the call (`offloaded`: `cpu_offload`, `disk_offload`, a `device_map`; a tensor tied to one it loads
    under another name counts as loaded): torch computes with it without a word (a CPU input times a meta weight is
    uninitialized memory, other tokens at each call) or fails deep inside. A weight added under an offloading hook
    after it was set up (PEFT's adapters on an offloaded base) is on the meta device and in no hook's store."""
    names: dict[int, list[str]] = {}  # meta tensor -> its names (tied weights have several)
    for prefix, module in model.named_modules():
        for key, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if tensor is not None and tensor.is_meta:
                names.setdefault(id(tensor), []).append(".".join(filter(None, (prefix, key))))
    for tensor_names in names.values():
        if not any(offloaded(model, name) is not None for name in tensor_names):
            raise ValueError(f"{tensor_names[0]} is on the meta device (shapes only, no values), and no accelerate "
                             "hook loads it at the call: load the model's weights (from_pretrained, or "
                             "load_state_dict(..., assign=True)) before generate, and add adapters (PEFT) to a model "
                             "whose weights are loaded, not offloaded.")
