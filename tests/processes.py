"""The checkout and the environment of the Python processes some tests start (CLI runs, batch workers, notebook
kernels, fresh interpreters)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the checkout: its hf_loopspec, scripts, examples, model cards


def subprocess_env(*, drop: tuple[str, ...] = (), **settings: str) -> dict[str, str]:
    """This process's environment for a child process: offline (no Hub downloads), this checkout's hf_loopspec first
    on PYTHONPATH, one torch thread, no GPU, no tokenizers thread pool; then `settings` set and the `drop` keys
    removed."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
               CUDA_VISIBLE_DEVICES="", PYTHONPATH=path) | settings
    for key in drop:
        env.pop(key, None)
    return env
