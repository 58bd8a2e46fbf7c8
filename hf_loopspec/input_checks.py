"""Checks of what a user passes before anything loads or runs, so that the mistakes a user can make (a mistyped
folder, a zero-byte, truncated or corrupt `model.safetensors`, a missing shard, a pickle-only folder, a prompt
longer than the model's positions) end in one `ValueError` / `FileNotFoundError` naming the problem and the fix,
instead of a traceback from deep inside transformers or safetensors.

Contract of `check_source(spec)`: when `spec` is an existing folder, it holds a `config.json` of a looped model type
(Ouro's or Huginn's) and safetensors weights (`model.safetensors`, or the index `model.safetensors.index.json` and
every shard it names) whose headers parse and whose data regions lie inside the files. Pickle weights
(`pytorch_model.bin`, ...) are never loaded: unpickling runs code, so a folder that has only those is refused (load
with `use_safetensors=True`, which makes transformers refuse pickle-only Hub repos too). When `spec` is not a folder
it must be a valid Hub repo id; a path-like string that names nothing is reported as a missing folder, a repo not in
the local Hub cache while the Hub is off is refused, and the repo's safetensors files already in the local Hub cache
are checked as a folder's are.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


# why a folder (or cached Hub repo) of a PEFT adapter alone is no checkpoint, and the fix
ADAPTER_ONLY = (" but a PEFT adapter (adapter_config.json), and a whole checkpoint is needed; merge the adapter into "
                "its base model first (peft's merge_and_unload, then save_pretrained) and pass that folder, or pass "
                "the base model's folder")


def check_source(spec: str, revision: str | None = None, subfolder: str = "") -> None:
    """Raise `FileNotFoundError` / `ValueError` (one line, naming the fix) for a checkpoint that cannot load safely;
    see the module docstring for what is checked. Hub ids are checked for their form and their cached weights (of
    `revision`: None, the main one; in `subfolder` of the repo)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        check_folder(path)
        return
    if path.exists():
        raise ValueError(f"{spec} is a file; pass the checkpoint folder (the one that holds config.json and "
                         f"{SAFE_WEIGHTS}).")
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(spec)
    except HFValidationError:
        raise FileNotFoundError(f"no such folder: {spec}; pass an existing checkpoint folder or a Hub id such as "
                                "ByteDance/Ouro-1.4B.") from None
    check_hub_cache(spec, revision, subfolder)


def check_hub_cache(repo_id: str, revision: str | None = None, subfolder: str = "") -> None:
    """For a Hub repo id at `revision` (None: main; anything else read as text, as transformers reads it), its
    checkpoint in `subfolder`: `FileNotFoundError` when the Hub is off (`HF_HUB_OFFLINE`) and that revision is not in
    the local Hub cache; its safetensors files already cached checked as a folder's are (`check_safetensors`): a
    cached file that is empty or cut short is loaded as it is, offline or not, and failed deep inside safetensors.
    Files not cached yet are the download's to fetch."""
    from huggingface_hub import is_offline_mode, try_to_load_from_cache

    revision = None if revision is None else str(revision)

    def cached(name: str):
        return try_to_load_from_cache(repo_id, f"{subfolder}/{name}" if subfolder else name, revision=revision)

    if is_offline_mode() and not isinstance(cached("config.json"), str):
        if isinstance(cached("adapter_config.json"), str):
            raise FileNotFoundError(f"{repo_id} has no config.json in the local Hub cache{ADAPTER_ONLY}.")
        at = f" at revision {revision}" if revision is not None else ""
        raise FileNotFoundError(f"{repo_id} is not a local folder, and it is not in the local Hub cache{at} while the "
                                "Hub is off (HF_HUB_OFFLINE=1); pass a checkpoint folder or 'default', or unset "
                                "HF_HUB_OFFLINE to download it.")
    weights, index = (cached(name) for name in (SAFE_WEIGHTS, SAFE_INDEX))
    if isinstance(index, str):
        shards = [shard for shard in weight_files(Path(index).parent) if shard.exists()]
    else:
        shards = [Path(weights)] if isinstance(weights, str) else []
    for shard in shards:
        check_safetensors(shard)


@contextlib.contextmanager
def hub_errors_explained(spec: str) -> Iterator[None]:
    """Around a load of `spec`: when `spec` is no local path, an `OSError` of the load (the Hub could not provide
    it) is raised again saying that `spec` was tried as a Hub repo id, not a missing folder the user may have
    meant."""
    if Path(spec).expanduser().exists():
        yield
        return
    try:
        yield
    except OSError as err:
        reason = " ".join(str(err).split())
        raise OSError(f"{spec} is not a local folder, and loading it as a Hub repo id failed ({reason}); check the "
                      "folder path, or the repo id and the connection.") from err


def check_folder(folder: Path) -> None:
    """The folder part of `check_source`: config.json, then every safetensors file the checkpoint needs."""
    if not (folder / "config.json").is_file():
        why = ADAPTER_ONLY if (folder / "adapter_config.json").is_file() else \
            ", so it is not a checkpoint folder; pass the folder that holds config.json and " + SAFE_WEIGHTS
        raise FileNotFoundError(f"{folder} has no config.json{why}.")
    check_model_type(folder / "config.json")
    for shard in weight_files(folder):
        check_safetensors(shard)


def check_model_type(config: Path) -> None:
    """`ValueError` unless the checkpoint config `config` (a config.json) names a looped model type hf_loopspec
    runs (Ouro, Huginn): read as JSON before any weights load, so that e.g. a gpt2 folder is refused in one line."""
    from .models.huginn.configuration_huginn import HuginnConfig
    from .models.ouro.configuration_ouro import OuroConfig

    looped = (OuroConfig.model_type, HuginnConfig.model_type)
    try:
        model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
    except (ValueError, AttributeError) as err:  # not JSON, not UTF-8, or JSON that is no object
        raise ValueError(f"{config} is not a valid config.json ({type(err).__name__}: {err}); re-download or "
                         "re-save the checkpoint.") from None
    if model_type not in looped:
        raise ValueError(f"{config} has model_type {model_type!r}, which is not a looped model hf-loopspec runs "
                         f"({', '.join(looped)}); pass an Ouro or Huginn checkpoint folder.")


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files a load of `folder` reads (the index's shards, or model.safetensors)."""
    index = folder / SAFE_INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{index} is not a valid safetensors index ({type(err).__name__}: {err}); re-download "
                             "or re-save the checkpoint.") from None
        return [folder / name for name in names]
    if (folder / SAFE_WEIGHTS).exists():
        return [folder / SAFE_WEIGHTS]
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ValueError(
            f"{folder} has only pickle weights ({', '.join(pickles[:3])}), which hf-loopspec does not load because "
            "unpickling can run arbitrary code; convert them once, in an environment you trust, with "
            "`AutoModelForCausalLM.from_pretrained(folder).save_pretrained(folder)` (which writes "
            f"{SAFE_WEIGHTS}).")
    raise FileNotFoundError(f"{folder} has no {SAFE_WEIGHTS} (nor {SAFE_INDEX}); pass a folder with the "
                            "checkpoint's safetensors weights.")


def check_safetensors(path: Path) -> None:
    """`ValueError` unless `path` is a complete safetensors file (header parses, every tensor inside the file)."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing (the checkpoint's index names it); re-download or re-save "
                                "the checkpoint.")
    if path.stat().st_size == 0:
        raise ValueError(f"{path} is empty (0 bytes); re-download or re-save the checkpoint.")
    try:
        with safe_open(str(path), framework="pt"):  # parses the header and checks it covers exactly the file
            pass
    except SafetensorError as err:
        raise ValueError(f"{path} is truncated or corrupt ({err}); re-download or re-save the checkpoint.") from None


def max_positions(config) -> int | None:
    """The most positions the model's config allows (Ouro: max_position_embeddings, Huginn: block_size), if set."""
    for key in ("max_position_embeddings", "block_size"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_positions(config, prompt_len: int, new_tokens: int, *, prompt_flag: str, new_flag: str,
                    least_new: int = 1) -> None:
    """`ValueError` when a prompt of `prompt_len` tokens plus `new_tokens` would pass the model's maximum positions
    (positions past it were never trained: the output would be garbage without an error); its fix leaves room for
    `least_new` new tokens, the fewest the caller accepts."""
    limit = max_positions(config)
    if limit is None or prompt_len + new_tokens <= limit:
        return
    if prompt_len > limit - least_new:  # (a fix that fits the call as given: it said `limit - least_new` whatever N)
        fix = f"at most {limit - least_new} tokens"
        if least_new < new_tokens < limit - least_new:
            fix = f"at most {limit - new_tokens} tokens for {new_flag} {new_tokens}, or to {limit - least_new}"
        if new_tokens > least_new:
            fix += f" with {new_flag} {least_new}"
        raise ValueError(f"the prompt is {prompt_len} tokens and the model has {limit} positions, which the prompt "
                         f"and the new tokens share; shorten {prompt_flag} to {fix}.")
    raise ValueError(f"the prompt ({prompt_len} tokens) plus {new_flag} {new_tokens} passes the model's {limit} "
                     f"positions; lower {new_flag} to {limit - prompt_len} or shorten {prompt_flag}.")


def file_in_the_way(path: str | Path) -> Path | None:
    """The first of `path`'s parent folders that is a file (nothing can be made below it), or None."""
    return next((parent for parent in Path(path).parents if parent.is_file()), None)


__all__ = ["check_folder", "check_model_type", "check_positions", "check_safetensors", "check_source",
           "file_in_the_way", "hub_errors_explained", "max_positions", "weight_files"]
