"""The checkout and the environment of the Python processes some tests start (CLI runs, batch workers, notebook
kernels, fresh interpreters), the command line of a multi-process `accelerate launch` of the CLI, and several CLI
runs in one fresh process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
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


# The driver of `cli_runs_in_one_process`: reads [[cwd, argv], ...] as JSON on stdin, runs each as `python -m
# hf_loopspec.cli` does (the module as __main__, which exits with main's status) with fds 1 and 2 redirected to files
# of its own, and prints the results as one JSON line on the real stdout.
_CLI_RUNS = r"""
import json, os, runpy, sys, tempfile, traceback

def run(cwd, argv):
    os.chdir(cwd)
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)
        sys.argv = ["-m", *argv]
        try:
            runpy.run_module("hf_loopspec.cli", run_name="__main__")  # python -m hf_loopspec.cli ARGV
            code = 0
        except SystemExit as exit:
            code = exit.code
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            for fd, copy in zip((1, 2), saved):
                os.dup2(copy, fd)
                os.close(copy)
        out.seek(0), err.seek(0)
        return [code, out.read().decode(), err.read().decode()]

results = [run(cwd, argv) for cwd, argv in json.loads(sys.stdin.read())]
print(json.dumps(results))
"""


def cli_runs_in_one_process(runs: list[tuple[Path, list[str]]], *, drop: tuple[str, ...] = (),
                            **settings: str) -> list[subprocess.CompletedProcess]:
    """Each `(folder, argv)` of `runs` as `python -m hf_loopspec.cli ARGV` in `folder`, all in ONE fresh Python
    process (environment: `subprocess_env(drop=("HF_LOOPSPEC_DEBUG", *drop), **settings)`), one result per run with
    its exit status and what it wrote on stdout and stderr (file-descriptor level, the imports included for the first
    run).

    What a user's process prints, not what pytest lets through: no capture, warning filters or log handlers of the
    test process; third-party log handlers and progress bars write to the run's own stderr. Output that a process
    prints only once (a warning shown once per location) is seen by the first run that causes it, so what any run
    would print alone makes some run's check fail; at the cost of one interpreter start instead of one per run."""
    payload = json.dumps([[str(folder), argv] for folder, argv in runs])
    proc = subprocess.run([sys.executable, "-c", _CLI_RUNS], input=payload, capture_output=True, text=True,
                          env=subprocess_env(drop=("HF_LOOPSPEC_DEBUG", *drop), **settings), timeout=600, check=False)
    assert proc.returncode == 0 and proc.stderr == "" and proc.stdout.count("\n") == 1, proc.stderr[-4000:]
    return [subprocess.CompletedProcess(argv, *result) for (_, argv), result in zip(runs, json.loads(proc.stdout))]
