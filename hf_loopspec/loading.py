"""Model loading shared by `hf-loopspec generate` and `hf-loopspec bench`: a device name, and a model spec (the
embedded default model, a checkpoint folder or Hub id, or a random-weight shape of `hf_loopspec.bench.shapes`)."""

from __future__ import annotations

from pathlib import Path

import torch

from .bench.shapes import SHAPES, random_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelNotAvailable(ValueError):
    """The requested model cannot be loaded (missing embedded model, path or tokenizer)."""


def resolve_device(name: str | None) -> torch.device:
    """`torch.device(name)`, CUDA when available for None; `ValueError` for a bad name or a missing CUDA."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a torch device (use cpu, cuda or cuda:N).") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name} was requested but CUDA is not available here; use --device cpu.")
    return device


def default_model_path() -> Path:
    """The embedded default model's folder, or `ModelNotAvailable` with what to do instead."""
    hint = ("pass --model PATH (a checkpoint folder or Hub id such as ByteDance/Ouro-1.4B) or, for benchmarks, a "
            f"random-weight shape ({', '.join(SHAPES)}).")
    try:
        from . import assets
    except ImportError as err:
        raise ModelNotAvailable(f"this install has no embedded default model ({err}); {hint}") from None
    try:
        return Path(assets.default_model_path())
    except OSError as err:
        raise ModelNotAvailable(f"{err} Alternatively, {hint}") from None


def load_model(spec: str, dtype: torch.dtype | str, device: torch.device, *, need_tokenizer: bool = False,
               seed: int = 0):
    """`(model, tokenizer or None, description)` for a shape name, 'default', or a checkpoint path / Hub id.

    `dtype` "auto": float32 on CPU, the checkpoint's dtype elsewhere (random shapes: float32). `seed` seeds the
    random weights of a shape. `ModelNotAvailable` when the model (or, with `need_tokenizer`, its tokenizer)
    cannot be loaded, or does not load as an hf_loopspec looped model.
    """
    if spec in SHAPES:
        if need_tokenizer:
            raise ModelNotAvailable(f"--model {spec} is a random-weight shape for benchmarks and has no tokenizer; "
                                    "pass a checkpoint path or Hub id (or 'default').")
        dtype = torch.float32 if dtype == "auto" else dtype
        return random_model(spec, dtype, device, seed), None, f"{spec} (random weights, seed {seed})"
    path = default_model_path() if spec == "default" else spec
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_loopspec  # noqa: F401  (registers the Auto classes)

    if dtype == "auto":
        dtype = torch.float32 if device.type == "cpu" else "auto"
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    if not hasattr(model, "decode_with_lanes"):
        raise ModelNotAvailable(f"{path} loads as {type(model).__name__}, which is not an hf_loopspec looped model.")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as err:
        if need_tokenizer:
            raise ModelNotAvailable(f"no tokenizer could be loaded from {path} ({err}).") from None
        tokenizer = None
    name = "embedded default model" if spec == "default" else str(path)
    return model, tokenizer, name
