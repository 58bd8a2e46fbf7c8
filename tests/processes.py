"""The checkout and the environment of the Python processes some tests start (CLI runs, batch workers, notebook
kernels, fresh interpreters), and the command line of a multi-process `accelerate launch` of the CLI."""

from __future__ import annotations

import os
import socket
import sys
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


def accelerate_launch(num_processes: int) -> list[str]:
    """`accelerate launch` of `python -m hf_loopspec.cli` over `num_processes` processes on this machine (append the
    CLI's arguments). `--multi_gpu` is accelerate's torchrun launcher; without a GPU the processes run on the CPU over
    gloo (`accelerate launch --cpu` would start a single process)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(num_processes),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
            str(port), "-m", "hf_loopspec.cli"]
