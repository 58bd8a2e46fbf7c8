"""The on-disk copy of auto's cost tables and observed acceptance, so that a process need not time or probe what
an earlier one timed or probed.

Cost tables (`kind="costs"`): one JSON file per key: `cost_key` holds everything that changes what a call costs (the
model's config, parameter count and dtype, the device's type and name, torch's version and thread count, the batch
size, the loop count a call runs (Huginn's `num_steps`) and this package's version), the file is named by its hash
and also stores the key itself, so that a file from another key (a hash collision, a hand-copied file) is ignored
like an unreadable one. The folder is `$HF_LOOPSPEC_CACHE` when set, else the user cache folder of `platformdirs`
when it is installed, else `~/.cache/hf_loopspec`; files are written atomically (a temporary file in the folder, then
`os.replace`), so concurrent processes never read half a file, and `update` reads, changes and writes one under a
file lock, so that processes sharing the folder keep the entries the others stored (an entry of the same key: the
last writer's). A folder that cannot be written costs only the cache: the table stays in the process.

Acceptance (`kind="acceptance"`, `acceptance_key`): what auto calls observed on a model, keyed by its config, dtype,
a fingerprint of its weights (`weights_fingerprint`: another checkpoint of the same architecture drafts differently)
and this package's version; the device does not enter (acceptance is a property of the model and its inputs). The
file holds one entry per decoding settings (`auto_policy.remember`).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import secrets
import weakref
from pathlib import Path

import torch
from filelock import FileLock, Timeout

from ..logs import get_logger
from .offloaded import offloaded

logger = get_logger(__name__)
CACHE_ENV = "HF_LOOPSPEC_CACHE"
FORMAT = 1  # bump when the stored table's meaning changes
LOCK_SECONDS = 10  # how long `update` waits for another process's update before going ahead unlocked


def cache_dir() -> Path:
    """The folder of the stored tables (module docstring)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    try:
        import platformdirs
    except ImportError:
        return Path("~/.cache/hf_loopspec").expanduser()
    return Path(platformdirs.user_cache_dir("hf_loopspec"))


def device_name(device: torch.device) -> str:
    """The device's type and model: the CUDA device's name, else the CPU's model name (`/proc/cpuinfo`, else
    `platform.processor()`)."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    try:
        with open("/proc/cpuinfo") as info:
            name = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "")
    except OSError:
        name = ""
    return f"{device.type}:{name or platform.processor() or platform.machine()}"


def _config(model) -> str:
    config = {name: value for name, value in model.config.to_dict().items() if name != "_name_or_path"}
    return json.dumps(config, sort_keys=True, default=str)


def cost_key(model, batch: int) -> dict:
    """Everything that changes the costs of `model`'s calls at batch size `batch` (module docstring)."""
    from .. import __version__  # here: the package's __init__ imports generation

    return {"format": FORMAT, "config": _config(model),
            "parameters": sum(p.numel() for p in model.parameters()), "dtype": str(model.lane_dtype),
            "device": device_name(model.device), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "batch": batch, "loops": model.num_loops, "hf_loopspec": __version__}


_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> weights_fingerprint


def weights_fingerprint(model, again: bool = False) -> str:
    """A hash of the first values of every parameter of `model`, computed once per model object (`again`: anew, for
    weights changed in place since): it tells two checkpoints of one architecture apart without reading all their
    weights. A parameter accelerate offloaded (on the meta device, its values held by a hook) is read from the hook's
    store: each once, as every forward of such a model reads them all."""
    if again:
        _FINGERPRINTS.pop(model, None)
    if model not in _FINGERPRINTS:
        digest = hashlib.sha256()
        for name, parameter in model.named_parameters():
            digest.update(name.encode())
            if parameter.device.type == "meta":
                found = offloaded(model, name)
                parameter = None if found is None else found[0][found[1]]
            if parameter is not None:
                digest.update(_leading_values(parameter))
        _FINGERPRINTS[model] = digest.hexdigest()[:32]
    return _FINGERPRINTS[model]


def _leading_values(parameter) -> bytes:
    """The first values of `parameter`, or, for a tensor subclass that cannot be read as plain values (a quantized
    weight of torchao), its type and shape."""
    try:
        return parameter.detach().reshape(-1)[:16].float().cpu().numpy().tobytes()
    except (NotImplementedError, RuntimeError, TypeError):
        return f"{type(parameter).__name__}{tuple(parameter.shape)}".encode()


def acceptance_key(model) -> dict:
    """What the acceptance observed on `model` depends on (module docstring)."""
    from .. import __version__

    return {"format": FORMAT, "config": _config(model),
            "weights": weights_fingerprint(model), "dtype": str(model.lane_dtype), "hf_loopspec": __version__}


def _path(key: dict, kind: str = "costs") -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return cache_dir() / kind / f"{digest}.json"


def forget(key: dict, kind: str = "costs") -> bool:
    """Remove what is stored under `key` (nothing when there is none); whether nothing is stored now. A file that
    cannot be removed is named in a warning (other processes will read it)."""
    path = _path(key, kind)
    try:
        path.unlink(missing_ok=True)
    except OSError as error:
        logger.warning("hf_loopspec: auto mode cannot remove %s (%s): this process starts anew, but later ones will "
                       "read what it holds. Remove it by hand, or set %s to a writable folder.", path, error,
                       CACHE_ENV)
        return False
    return True


def load(key: dict, kind: str = "costs") -> dict | None:
    """The table stored under `key` (`store`'s `table`), or None when there is none (or no regular file), it cannot
    be read or parsed, or it was stored under another key."""
    path = _path(key, kind)
    try:  # (a FIFO or a device at the path would block or read without end: only a regular file is read)
        stored = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError, RecursionError):  # (RecursionError: JSON nested thousands deep)
        return None
    if not isinstance(stored, dict) or stored.get("key") != key or not isinstance(stored.get("table"), dict):
        return None
    return stored["table"]


def store(key: dict, table: dict, kind: str = "costs") -> None:
    """Write `table` (JSON-serialisable) under `key`, atomically, with the mode the umask gives a new file (so that
    other users sharing the folder read it); a folder that cannot be written is skipped, with a warning once per
    folder (and `unwritable()` then says so)."""
    path = _path(key, kind)
    temporary = path.with_name(f"{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # the umask's mode, as the lock files beside it (mkstemp's 0600 kept other users sharing the folder out)
        handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as error:
        _skipped(path.parent, error)
        return
    try:
        with os.fdopen(handle, "w") as file:
            json.dump({"key": key, "table": table}, file)
        os.replace(temporary, path)
    except BaseException as error:  # no stray temporary file, whatever failed
        Path(temporary).unlink(missing_ok=True)
        if not isinstance(error, OSError):
            raise
        _skipped(path.parent, error)


def update(key: dict, change, kind: str = "costs") -> dict:
    """Store `change(load(key, kind))` (a table) under `key` and return it: the read and the write hold a lock file
    next to the table, so a concurrent `update` of another process waits (at most `LOCK_SECONDS`) and then changes
    what this one wrote. Where the lock cannot be taken (an unwritable folder, a stale lock) it goes ahead unlocked."""
    path = _path(key, kind)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(f"{path}.lock", timeout=LOCK_SECONDS)
        lock.acquire()
    except (OSError, Timeout):
        lock = None
    try:
        table = change(load(key, kind))
        store(key, table, kind)
    finally:
        if lock is not None:
            lock.release()
    return table


_UNWRITABLE: set[Path] = set()  # cache folders a `store` of this process could not write


def _skipped(folder: Path, error: OSError) -> None:
    if cache_dir() not in _UNWRITABLE:
        _UNWRITABLE.add(cache_dir())
        logger.warning("hf_loopspec: auto mode cannot store its measured costs and acceptance in %s (%s): every "
                       "process measures them again. Set %s to a writable folder.", folder, error, CACHE_ENV)


def unwritable() -> bool:
    """Whether this process failed to store a table in the current cache folder (`cache_dir`)."""
    return cache_dir() in _UNWRITABLE
