"""Model loading shared by `hf-loopspec generate` and `hf-loopspec bench`: a device name, and a model spec (the
embedded default model, a checkpoint folder or Hub id, or a random-weight shape of `hf_loopspec.bench.shapes`)."""

from __future__ import annotations

import difflib
from pathlib import Path

import torch

from .bench.shapes import SHAPES, random_model
from .defaults import DTYPE_NAMES
from .hub.source import hub_options
from .input_checks import check_source, hub_errors_explained

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


class ModelNotAvailable(ValueError):
    """The requested model cannot be loaded (missing embedded model, path or tokenizer)."""


def resolve_device(name: str | None) -> torch.device:
    """The torch device for `--device NAME` (None: cuda when available, else cpu); `ValueError` for a name that is
    not a device, a type the models do not run on (meta, ...) or a device this machine does not have."""
    available = {"cpu": True, "cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
    if name is None:
        return torch.device("cuda" if available["cuda"] else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device {name!r} is not a torch device (use cpu, cuda or cuda:N).") from None
    if device.type not in available:
        raise ValueError(f"--device {name}: the models do not run on {device.type} tensors; use cpu or cuda (cuda:N).")
    if not available[device.type]:
        raise ValueError(f"--device {name} was requested but {device.type.upper()} is not available here; use "
                         "--device cpu.")
    count = torch.cuda.device_count() if device.type == "cuda" else 1
    if device.index is not None and device.index >= count:
        raise ValueError(f"--device {name}: this machine has {count} {device.type} device(s), index 0 to "
                         f"{count - 1}.")
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


def _hub_local_only(spec: str) -> bool:
    """For a Hub id: whether to load from the local Hub cache only (the Hub is off or out of reach and the repo is
    cached); `OSError` at once (no retries) when it is neither reachable nor cached, or no such repo exists, with a
    close benchmark shape's name for a mistyped one. False for a local folder."""
    if Path(spec).expanduser().exists():
        return False
    close = difflib.get_close_matches(spec, SHAPES, n=1, cutoff=0.75)
    if close and "/" not in spec:
        raise ModelNotAvailable(f"--model {spec} is neither a folder nor a benchmark shape; did you mean {close[0]}? "
                                f"(shapes: {', '.join(SHAPES)})")
    from .hub.source import hub_state

    return hub_state(spec)[0]


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
    if Path(str(path)).expanduser().exists():  # (`~/model` quoted, or `--model=~/model`: the shell left the `~`)
        path = str(Path(str(path)).expanduser())
    from transformers import AutoModelForCausalLM

    import hf_loopspec  # noqa: F401  (registers the Auto classes)

    check_source(str(path))  # one line for a missing folder, a model type that is not looped, damaged or pickle weights
    local_only = _hub_local_only(str(path))
    if dtype == "auto":
        dtype = torch.float32 if device.type == "cpu" else "auto"
    tokenizer = load_tokenizer(str(path), local_only, required=need_tokenizer)  # (first: no weights load for nothing)
    with hub_errors_explained(str(path)):
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, use_safetensors=True,
                                                     **hub_options(local_only)).to(device).eval()
    if not hasattr(model, "decode_with_lanes"):
        raise ModelNotAvailable(f"{path} loads as {type(model).__name__}, which is not an hf_loopspec looped model.")
    name = "embedded default model" if spec == "default" else str(path)
    return model, tokenizer, name


def load_tokenizer(path: str, local_only: bool = False, required: bool = True):
    """The tokenizer of the checkpoint at `path` (a folder or a Hub id), or None when it has none and it is not
    `required`; `ModelNotAvailable` otherwise, naming a folder without tokenizer files as such (transformers would
    name a tokenizer library to install). The checkpoint's config is read first, by its family's class: a field
    it refuses is its `ValueError` naming the field (the tokenizer read config.json with transformers' base class,
    whose checks raised other errors, or a traceback)."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(path, local_files_only=local_only)
    try:
        return AutoTokenizer.from_pretrained(path, config=config, local_files_only=local_only)
    except (OSError, ValueError) as err:
        if not required:
            return None
        folder = Path(path)
        if folder.is_dir() and not any(folder.glob("tokenizer*")):
            raise ModelNotAvailable(f"{path} has no tokenizer files (tokenizer.json, tokenizer_config.json); add "
                                    "them to the folder, or pass a checkpoint that has them.") from None
        raise ModelNotAvailable(f"no tokenizer could be loaded from {path} ({err}); pass a checkpoint whose "
                                "tokenizer loads with AutoTokenizer.") from None
