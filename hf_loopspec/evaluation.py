"""`hf-loopspec lm-eval ARGS...`: EleutherAI's lm-evaluation-harness command line with the hf_loopspec model
classes registered, so its `hf` backend loads Ouro and Huginn checkpoints (plain folders or Hub ids) natively and
`--gen_kwargs speculative_mode=pipeline,draft_loops=1` decodes speculatively.

lm-eval is an optional dependency, the `eval` extra (tested with lm-eval 0.4.13); the error of a missing lm-eval gives
the install command (`hf_loopspec.hub.install`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .input_checks import check_source
from .models.layers import is_real

MODEL_ARGS = "--model_args"
GEN_KWARGS = "--gen_kwargs"


def run_lm_eval(args: list[str]) -> int:
    """Run lm-eval's own CLI on `args` (as the `lm-eval` command would get them); its exit status.

    `FileNotFoundError` first when `--model_args pretrained=PATH` names a path that does not exist and is no Hub id
    either (lm-eval would report it as a malformed repo id), and `ValueError` for a `dtype` that torch does not have
    or a key that the model's `from_pretrained` does not take (lm-eval's own errors for them are tracebacks), for a
    `--batch_size` it cannot read, and for a setting of the checkpoint's generation_config.json the model refuses
    (their errors came after the model loaded); lm-eval's check of `max_gen_toks` against the model's length, an
    AssertionError once requests run, as a `ValueError` naming the flags."""
    args = check_model_args(args)
    check_batch_size(args)
    check_device(args)
    check_processes(args)
    settings = parsed_settings(args)
    if settings is not None:
        check_gen_kwargs(settings[1])
        check_saved_generation(settings)
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
        if "unexpected keyword argument" not in str(err):  # (a decoding setting is refused by from_pretrained itself)
            raise
        raise ValueError(f"{MODEL_ARGS}: {err}; lm-eval passes the keys it does not know to the model, which takes "
                         "no such argument: drop it or correct its spelling.") from err
    except AssertionError as err:  # lm-eval's check of max_gen_toks against the model's length, once requests run
        if "max tokens to generate" not in str(err):
            raise
        raise ValueError(f"{str(err).rstrip('.')}: pass a smaller {GEN_KWARGS} max_gen_toks (or a larger "
                         f"{MODEL_ARGS} max_length, up to the model's positions).") from err
    finally:
        sys.argv = saved
    return 0


COUNT_KEYS = ("max_length", "max_batch_size")  # model args lm-eval's `hf` model takes as counts (or None)
PATH_KEYS = ("pretrained", "tokenizer")  # model args that name a folder (or a Hub id)


def check_model_args(args: list[str]) -> list[str]:
    """`args` with every `--model_args` / `-a` (lm-eval's forms: `a=1,b=2`, `a=1 b=2`, JSON, repeated) merged by
    lm-eval's own parsing into one JSON `--model_args`, with `~` expanded in folder paths (lm-eval would hand `~/m`
    to the Hub as a repo id) and `default` (no folder of that name here) read as the embedded model's folder, as
    the other commands read it, after these checks: `FileNotFoundError` naming `pretrained=SPEC` when SPEC is neither
    an existing path nor a valid Hub repo id (`./nope`, `/abs/nope`), `ValueError` naming `dtype=NAME` when torch has
    no such dtype or a count (`COUNT_KEYS`) that is no whole number >= 1 (lm-eval's errors for them are
    tracebacks); anything else is left to lm-eval. Without lm-eval, `args` unchanged (`run_lm_eval` says so)."""
    try:
        from lm_eval._cli.utils import MergeDictAction
    except ImportError:
        return list(args)
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument(MODEL_ARGS, "-a", nargs="+", action=MergeDictAction, default=None)
    try:
        known, rest = parser.parse_known_args(args)
    except (argparse.ArgumentError, ValueError, SystemExit):  # lm-eval's own parser says what is wrong
        return list(args)
    model_args = known.model_args
    if not model_args:
        return list(args)
    for key, value in model_args.items():
        if key in ("dtype", "torch_dtype") and isinstance(value, str) and value != "auto":
            import torch

            if not isinstance(getattr(torch, value, None), torch.dtype):
                raise ValueError(f"{MODEL_ARGS} {key}={value}: torch has no such dtype; pass float32, bfloat16, "
                                 "float16 or auto.")
        if key in COUNT_KEYS and value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                                        or value < 1):
            raise ValueError(f"{MODEL_ARGS} {key}={value}: pass a whole number >= 1 (or None).")
        if key in PATH_KEYS and isinstance(value, str) and value.startswith("~"):
            model_args[key] = str(Path(value).expanduser())
        if key in PATH_KEYS and value == "default" and not Path(value).exists():  # (the other commands' name)
            from .assets import default_model_path

            model_args[key] = value = str(default_model_path())
        if key == "pretrained" and isinstance(value, str) and value and not Path(value).expanduser().exists():
            try:  # (named as given; its cache at the revision and subfolder lm-eval will load)
                check_source(value, model_args.get("revision"), str(model_args.get("subfolder") or ""))
            except FileNotFoundError as err:
                raise FileNotFoundError(f"{MODEL_ARGS} pretrained={value}: {err}") from None
    return [*rest, MODEL_ARGS, json.dumps(model_args)]


def parsed_settings(args: list[str]) -> tuple[dict, dict] | None:
    """`--model_args` and `--gen_kwargs` of `args` as lm-eval's parser reads them (`{}` for one not given), or None
    without lm-eval or for flags its parser refuses (it says what is wrong, once)."""
    try:
        from lm_eval._cli.utils import MergeDictAction
    except ImportError:  # (`run_lm_eval` says so)
        return None
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    parser.add_argument(MODEL_ARGS, nargs="+", action=MergeDictAction, default=None)
    parser.add_argument(GEN_KWARGS, nargs="+", action=MergeDictAction, default=None)
    try:
        known = parser.parse_known_args(args)[0]
    except (argparse.ArgumentError, ValueError, SystemExit):
        return None
    return known.model_args or {}, known.gen_kwargs or {}


TOKEN_COUNTS = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")  # lm-eval's, by priority
INTEGER_KEYS = ("draft_loops", "num_speculative_tokens", "second_draft_loops", "num_steps", "init_seed")


def check_gen_kwargs(gen_kwargs: dict) -> None:
    """`ValueError` naming `--gen_kwargs KEY=VALUE` for a value lm-eval reads itself and fails on once the model has
    loaded and requests run, naming no flag: a token count (`max_gen_toks` or the alias lm-eval reads first) that is
    no whole number >= 1 (0 was blamed on a `max_length` nobody gave), an `until` that is no string or list of
    strings, a `temperature` that is no number (lm-eval reads a string with `float()` for its own choice but passes
    it on to `generate`, which refuses it once requests run; None failed in lm-eval), a negative whole number for an
    integer setting, which lm-eval's parser hands over as a float (-2 as -2.0, then refused as "no integer"), and
    two settings lm-eval's `hf` backend cannot decode with: `stop_strings` (it passes `generate` no tokenizer to
    match them with; its own `until` does that) and `return_dict_in_generate` (it reads a tensor of ids)."""
    key, count = next(((key, gen_kwargs[key]) for key in TOKEN_COUNTS if gen_kwargs.get(key) is not None), (0, 1))
    if isinstance(count, str) and count.strip().isdecimal():  # (JSON's "8": lm-eval's int() reads it)
        count = int(count)
    if not (is_real(count) and float(count).is_integer() and count >= 1):
        raise ValueError(f"{GEN_KWARGS} {key}={typed(count)}: pass a whole number >= 1 (the most tokens to generate "
                         "per request).")
    until = gen_kwargs.get("until")
    if until is not None and not (isinstance(until, str) or isinstance(until, list)
                                  and all(isinstance(stop, str) for stop in until)):
        raise ValueError(f"{GEN_KWARGS} until={until!r}: pass a stop string, or a JSON list of them "
                         f"({GEN_KWARGS} '{{\"until\": [\"\\n\\n\", \"###\"]}}').")
    if gen_kwargs.get("stop_strings") is not None:
        raise ValueError(f"{GEN_KWARGS} stop_strings={gen_kwargs['stop_strings']!r}: lm-eval calls generate without "
                         "the tokenizer that stop strings are matched with; pass them as lm-eval's own stop "
                         f"sequences ({GEN_KWARGS} '{{\"until\": [...]}}').")
    if gen_kwargs.get("return_dict_in_generate") not in (None, False, 0):
        raise ValueError(f"{GEN_KWARGS} return_dict_in_generate={gen_kwargs['return_dict_in_generate']!r}: lm-eval "
                         "reads generate's output as a tensor of token ids; drop it.")
    if "temperature" in gen_kwargs and not is_real(gen_kwargs["temperature"]):  # (lm-eval passes a string on)
        raise ValueError(f"{GEN_KWARGS} temperature={gen_kwargs['temperature']!r}: pass a number >= 0.")
    for key in INTEGER_KEYS:
        value = gen_kwargs.get(key)
        if isinstance(value, float) and value.is_integer() and value < 0:
            raise ValueError(f"{GEN_KWARGS} {key}={typed(value)}: pass a whole number >= "
                             f"{0 if key == 'init_seed' else 1}.")


def typed(value):
    """`value` as the user typed it: lm-eval's parser reads a negative whole number as a float (-2 as -2.0)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def check_saved_generation(settings: tuple[dict, dict]) -> None:
    """`ValueError` naming the checkpoint's generation_config.json (`prompting.check_checkpoint`) for a setting of it
    that the model refuses under `--gen_kwargs`' own speculative settings, before lm-eval loads the model (the first
    `generate` raised it, naming no file). `settings`: `parsed_settings` of `args` as `check_model_args` returns
    them; checked for a local folder `pretrained=` names (a Hub id is lm-eval's to fetch)."""
    from .generation.config import EXIT_OPTIONS, RECURRENCE_OPTIONS, SPECULATIVE_KEYS
    from .generation.saved_config import checkpoint_generation_config
    from .prompting import check_checkpoint

    model_args, gen_kwargs = settings
    spec = model_args.get("pretrained")
    if not isinstance(spec, str) or not Path(spec).is_dir():
        return
    spec = str(Path(spec) / str(model_args.get("subfolder") or ""))  # (lm-eval's `subfolder=` holds the checkpoint)
    saved = getattr(checkpoint_generation_config(spec), "stop_strings", None)
    if saved is not None and "stop_strings" not in gen_kwargs:  # (lm-eval passes generate no tokenizer for them;
        # `stop_strings=None` there clears them, any other value is refused by `check_gen_kwargs`)
        raise ValueError(f"the checkpoint's generation_config.json sets stop_strings={saved!r}, which lm-eval's "
                         f"generate calls cannot match (they pass no tokenizer): pass {GEN_KWARGS} stop_strings=None "
                         "(or drop them from the checkpoint's generation_config.json), with lm-eval's own stop "
                         f"sequences instead if you want them ({GEN_KWARGS} '{{\"until\": [...]}}').")
    given = {key: gen_kwargs[key] for key in (*SPECULATIVE_KEYS, *EXIT_OPTIONS, *RECURRENCE_OPTIONS)
             if key in gen_kwargs}  # (a call's num_steps sets its loop count)
    trusted = bool(model_args.get("trust_remote_code"))
    check_checkpoint(spec, given, lambda named: [
        *(f"{GEN_KWARGS} {key}=N" for key in named if key in ("draft_loops", "num_speculative_tokens")),
        f"{GEN_KWARGS} speculative_mode=None"], trust_remote_code=trusted, loaded=model_args, loaded_as=MODEL_ARGS)
    recurrence = [key for key in RECURRENCE_OPTIONS if key in gen_kwargs]
    if recurrence:  # they reach generate alone: lm-eval's scoring (loglikelihood) runs the model's forward, which
        try:  # reads the saved ones (a plain call's check: what every forward refuses)
            check_checkpoint(spec, {"speculative_mode": None}, trust_remote_code=trusted, loaded=model_args,
                             loaded_as=MODEL_ARGS)
        except ValueError as error:
            raise ValueError(f"{str(error).rstrip('.')}. A {GEN_KWARGS} value reaches lm-eval's generate calls "
                             "only, not its loglikelihood scoring, which runs the saved one: pass "
                             f"{' and '.join(recurrence)} in {MODEL_ARGS} instead ({MODEL_ARGS} "
                             f"pretrained=...,{recurrence[0]}=N).") from None


def check_batch_size(args: list[str]) -> None:
    """`ValueError` naming `--batch_size` (`-b`) unless its value is one lm-eval's `hf` backend reads: a whole
    number >= 1, `auto`, or `auto:N` (N > 0 re-detections). lm-eval's own error came once the model had loaded,
    naming neither the flag nor a fix (`invalid literal for int()`)."""
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    parser.add_argument("--batch_size", "-b", default=None)
    try:
        value = parser.parse_known_args(args)[0].batch_size
    except argparse.ArgumentError:  # (a flag without its value: lm-eval's parser says so, once)
        return
    if value is None or value == "auto":
        return
    head, _, times = value.partition(":")
    try:  # (as lm-eval reads them: `int` of the value, or `float` of auto's N)
        if int(value) >= 1 if head != "auto" else float(times) > 0:
            return
    except ValueError:
        pass
    raise ValueError(f"--batch_size {value}: pass a whole number >= 1, auto (the largest batch that fits) or auto:N "
                     "(detected again N times).")


def check_device(args: list[str]) -> None:
    """`ValueError` for a `--device` of a kind this machine does not have (cuda, mps: lm-eval's error is a torch
    traceback); other values (cpu, auto, ...) are lm-eval's to read."""
    devices = [value for flag, value in zip(args, args[1:]) if flag == "--device"]
    devices += [arg.split("=", 1)[1] for arg in args if arg.startswith("--device=")]
    if devices and devices[-1].split(":")[0] in ("cuda", "mps"):
        from .loading import resolve_device

        resolve_device(devices[-1])


def check_processes(args: list[str]) -> None:
    """`ValueError` for a run in several processes (`accelerate launch`, `torchrun`: `WORLD_SIZE` > 1) on fewer than
    two GPUs, where lm-eval's `hf` backend does not split the documents (it does over two or more devices, and under
    a `tp_plan` it runs one model on purpose): every process would evaluate every document, for the same results."""
    import torch

    processes = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if processes < 2 or any("tp_plan" in arg for arg in args):
        return
    devices = torch.accelerator.device_count() if torch.accelerator.is_available() else 0
    if devices < 2:
        raise ValueError(f"hf-loopspec lm-eval runs in {processes} processes (WORLD_SIZE={processes}) with {devices} "
                         "GPU(s), and lm-eval splits the documents between processes only over two or more GPUs: "
                         "every process would evaluate every document, for the same results; run it as one process "
                         "(without accelerate launch), or with one process per GPU.")
