"""A fingerprint of the weights a batch run decodes with, recorded with its settings so that a resume against other
weights at the same `--model` is refused.

`weights_fingerprint(spec)` is a dict with one entry per safetensors file a load of the checkpoint reads (a PEFT
adapter's beside it included, `ADAPTER_FILES`, which `from_pretrained` loads onto the model),
`"<size> bytes, sha256 <digest>"`; the digest covers the file's header in full (every tensor's name, dtype, shape
and offsets) and SAMPLES blocks of BLOCK bytes at evenly spaced offsets of the data (all the data when it is not
larger than that). A re-save with another dtype, shape or set of tensors changes the header, and a fine-tune (or any
change spread over a tensor) changes sampled blocks; only an edit confined to the bytes between samples of an
unchanged header goes unseen. Reading the samples costs a few MB per file, whatever its size. Copying a checkpoint
elsewhere and back keeps its fingerprint (no timestamps are part of it).

The embedded default model (`spec == "default"`) adds `hf_loopspec`'s version (a new package may embed other
weights); a Hub id adds the commit its files came from (`hub`), and is only known once the model is loaded (the
load may download a newer commit), so it is None before.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from .. import __version__, loading
from ..input_checks import check_folder, weight_files

BLOCK = 1 << 16
SAMPLES = 64
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # a PEFT adapter in the checkpoint's folder


def file_digest(path: Path) -> str:
    """`"<size> bytes, sha256 <hex>"` over the header and the sampled data blocks of one safetensors file."""
    size = path.stat().st_size
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        head = handle.read(8)
        header_end = 8 + int.from_bytes(head, "little")
        digest.update(head + handle.read(header_end - 8))
        data = size - header_end
        if data <= SAMPLES * BLOCK:
            digest.update(handle.read())
        else:
            for sample in range(SAMPLES):  # the first block at the data's start, the last one ending at the file's end
                handle.seek(header_end + sample * (data - BLOCK) // (SAMPLES - 1))
                digest.update(handle.read(BLOCK))
    return f"{size} bytes, sha256 {digest.hexdigest()}"


def folder_fingerprint(folder: Path) -> dict[str, str]:
    """Every weight file of the checkpoint `folder` (checked first, with the loader's one-line errors) by name, and
    the files of an adapter beside it (its config in full)."""
    check_folder(folder)
    adapter = {name: file_digest(path) if path.suffix == ".safetensors" else
               f"{path.stat().st_size} bytes, sha256 {hashlib.sha256(path.read_bytes()).hexdigest()}"
               for name in ADAPTER_FILES if (path := folder / name).is_file()}
    return {path.name: file_digest(path) for path in weight_files(folder)} | adapter


def weights_fingerprint(spec: str, *, loaded: bool = False) -> dict[str, str] | None:
    """The fingerprint of `--model spec` (see the module docstring); for a Hub id None unless `loaded` (the model
    was loaded in this process, so its files are in the local cache)."""
    if spec == "default":
        return {"hf_loopspec": __version__, **folder_fingerprint(loading.default_model_path())}
    if Path(spec).expanduser().is_dir():
        return folder_fingerprint(Path(spec).expanduser())
    if not loaded:
        return None
    from huggingface_hub import try_to_load_from_cache

    config = try_to_load_from_cache(spec, "config.json")
    if not isinstance(config, str):  # not cached here, although it was just loaded: record the id alone
        return {"hub": f"{spec} (commit unknown)"}
    folder = Path(config).parent  # .../snapshots/<commit>/
    return {"hub": f"{spec}@{folder.name}", **folder_fingerprint(folder)}
