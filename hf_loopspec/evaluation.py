"""`hf-loopspec lm-eval ARGS...`: EleutherAI's lm-evaluation-harness command line with the hf_loopspec model
classes registered, so its `hf` backend loads Ouro and Huginn checkpoints (plain folders or Hub ids) natively and
`--gen_kwargs speculative_mode=pipeline,draft_loops=1` decodes speculatively.

lm-eval is an optional dependency, the `eval` extra (tested with lm-eval 0.4.13); the error of a missing lm-eval gives
the install command (`hf_loopspec.hub.install`).
"""

from __future__ import annotations

import sys
from pathlib import Path

from .input_checks import check_source

MODEL_ARGS = "--model_args"


def run_lm_eval(args: list[str]) -> int:
    """Run lm-eval's own CLI on `args` (as the `lm-eval` command would get them); its exit status.

    `FileNotFoundError` first when `--model_args pretrained=PATH` names a path that does not exist and is no Hub id
    either (lm-eval would report it as a malformed repo id), and `ValueError` for a `dtype` that torch does not have
    or a key that the model's `from_pretrained` does not take (lm-eval's own errors for them are tracebacks)."""
    args = check_model_args(args)
    check_device(args)
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError as err:
        from .hub.install import install_command

        raise ValueError(f"lm-eval is not installed ({err}); install it with: {install_command('eval')}") from None

    import hf_loopspec  # noqa: F401  (registers the Ouro and Huginn classes with the Auto factories)

    saved = sys.argv
    sys.argv = ["lm-eval", *args]  # lm-eval's parser reads sys.argv
    try:
        cli_evaluate()  # argparse errors and --help end in SystemExit, which passes through
    except TypeError as err:  # lm-eval hands the keys it does not know to from_pretrained, and the model's __init__
        if "unexpected keyword argument" not in str(err):
            raise
        raise ValueError(f"{MODEL_ARGS}: {err}; lm-eval passes the keys it does not know to the model, which takes "
                         "no such argument: drop it or correct its spelling.") from err
    finally:
        sys.argv = saved
    return 0


COUNT_KEYS = ("max_length", "max_batch_size")  # model args lm-eval's `hf` model takes as counts


def check_model_args(args: list[str]) -> list[str]:
    """`args` with `--model_args pretrained=~/...` expanded (lm-eval would hand `~/m` to the Hub as a repo id), after
    these checks: `FileNotFoundError` naming `pretrained=SPEC` when SPEC is neither an existing path nor a valid Hub
    repo id (`./nope`, `/abs/nope`), `ValueError` naming `dtype=NAME` when torch has no such dtype or a count
    (`COUNT_KEYS`) that is no whole number >= 1 (lm-eval's errors for them are tracebacks); anything else is left to
    lm-eval."""
    checked = list(args)
    for i, arg in enumerate(args):  # lm-eval's forms: `--model_args a=1,b=2` and `--model_args=a=1,b=2`
        if arg == MODEL_ARGS and i + 1 < len(args):
            checked[i + 1] = _checked_model_args(args[i + 1])
        elif arg.startswith(f"{MODEL_ARGS}="):
            checked[i] = f"{MODEL_ARGS}={_checked_model_args(arg.split('=', 1)[1])}"
    return checked


def _checked_model_args(value: str) -> str:
    """One `--model_args` value (key=value pairs separated by commas), checked (`check_model_args`), `~` expanded."""
    items = []
    for item in value.split(","):
        key, _, spec = item.partition("=")
        key, spec = key.strip(), spec.strip()
        if key in ("dtype", "torch_dtype") and spec != "auto":
            import torch

            if not isinstance(getattr(torch, spec, None), torch.dtype):
                raise ValueError(f"{MODEL_ARGS} {key}={spec}: torch has no such dtype; pass float32, bfloat16, "
                                 "float16 or auto.")
        if key in COUNT_KEYS and not (spec.isdigit() and int(spec) >= 1):
            raise ValueError(f"{MODEL_ARGS} {key}={spec}: pass a whole number >= 1.")
        if key == "pretrained" and spec.startswith("~"):
            spec = str(Path(spec).expanduser())
            item = f"{key}={spec}"
        items.append(item)
        if key != "pretrained" or not spec or Path(spec).exists():
            continue
        try:
            check_source(spec)
        except FileNotFoundError as err:
            raise FileNotFoundError(f"{MODEL_ARGS} pretrained={spec}: {err}") from None
    return ",".join(items)


def check_device(args: list[str]) -> None:
    """`ValueError` for a `--device` this machine does not have (lm-eval's error is a torch traceback)."""
    devices = [value for flag, value in zip(args, args[1:]) if flag == "--device"]
    devices += [arg.split("=", 1)[1] for arg in args if arg.startswith("--device=")]
    if devices:
        from .loading import resolve_device

        resolve_device(devices[-1])
