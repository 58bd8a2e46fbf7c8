"""The benchmark's results: the JSON document (`build_result`; this module owns its schema, `SCHEMA_VERSION`), the
human-readable table (`format_table`), and reading a results file back (`load_result`).

Schema (`"schema": "hf-loopspec-bench/1"`): `rows` (one per mode, `ROW_KEYS` and the counters), `machine`,
`args`, `model`, `synthetic_acceptance`, `sampling`, `call_costs`, `notes`, `all_checks_passed`.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
from pathlib import Path

import torch

from ..input_checks import file_in_the_way
from .args import PLAIN_MODES, parse_args
from .costs import STAGES, predicted_seconds

SCHEMA = "hf-loopspec-bench/1"
SAMPLING_CHECK_NOTE = ("sampling: not comparable: outputs are random draws, so plain is no token-by-token reference; "
                       "speculative sampling is lossless (accept with min(1, p/q), residual on rejection), tested "
                       "distributionally in tests/test_speculative_sampling.py")
NOTES = {
    "timing": "median wall time of --repeats interleaved rounds after one warm-up per mode; prefill "
              "included; EOS ignored so every run commits batch * new_tokens tokens",
    "core_calls_per_token": "core calls of the run (prefill included) per committed token of one "
                            "sequence: core_calls * batch / committed tokens (out.speculation."
                            "core_calls_per_token); plain: U by construction",
    "ideal_speedup_vs_ar": "T_hat(ar) / T_hat(mode), T_hat = sum of the measured costs of the run's core "
                           "and head calls by row count (see hf_loopspec.bench.costs); T_hat(ar): the ar run's "
                           "calls when --modes has ar, else the formula of hf_loopspec.bench (fewer head and embed "
                           "calls than the engine's ar runs); none (with %ideal and overhead) for an auto run with "
                           "plain segments, which run transformers' own loop",
    "overhead_fraction": "1 - T_hat(mode) / the run's measured time: the share of time outside embed, core and head "
                         "calls; with --compile, none for compiled rows (T_hat comes from eager call costs, which "
                         "cannot split a compiled run's time; ideal stays the eager cost model's ratio)",
    "compile_seconds": "with --compile: the mode's warm-up run (which compiles every bucket it meets) minus "
                       "its median timed run; buckets met only in timed runs would compile there",
    "rounds": "counters, core_calls_per_token, ideal_speedup_vs_ar and overhead_fraction are those of the "
              "round whose time is the median (the faster middle one for an even --repeats); "
              "acceptance_rate_all / core_calls_per_token_all list every round's (they differ when sampling, and "
              "for auto when its choices differ between calls)",
}
GREEDY_CHECK_NOTE = ("fp32: every output of every timed run (not the warm-up's) equals plain greedy (check_passed); "
                     "other dtypes: "
                     "agreement_rate = mean common-prefix fraction with plain greedy (worst run)")
CONFIG_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "total_ut_steps", "n_layers_in_prelude",
               "n_layers_in_recurrent_block", "n_layers_in_coda", "mean_recurrence")

def machine_info(device: torch.device) -> dict:
    import transformers

    from .. import __version__

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "cpus_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_avg_1m_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hf_loopspec": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu,
    }
    return info


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f}MiB"


def _num(x, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def sampling_title(sampling: dict) -> str:
    """`SAMPLING (temperature T, top_p P, top_k K)` for the table header and the plot title."""
    return f"SAMPLING (temperature {sampling['temperature']}, top_p {sampling['top_p']}, top_k {sampling['top_k']})"


def check_text(row: dict) -> str:
    """A row's check in words: reference, equal, MISMATCH ..., agree 0.984, or sampling: not comparable."""
    if row["check"] == "reference":
        return "reference"
    if row["check"].get("exact", False) is None:
        return "sampling: not comparable"
    if row["check_passed"] is not None:
        return "equal" if row["check_passed"] else f"MISMATCH {row['check'].get('first_divergence')}"
    return f"agree {row['check']['agreement_rate']:.3f}"


def command_line(result: dict) -> str:
    """The `hf-loopspec bench` command of a result, quoted for a POSIX shell: its arguments that differ from the
    defaults (`--quiet`, `--json` and `--plot`, which do not change what is measured, left out). An engine recorded
    under its old name gets today's: `lanes` (the lane decoder) is `reference`."""
    defaults = vars(parse_args([]))
    parts = ["hf-loopspec bench"]
    for key, value in result["args"].items():
        if key not in defaults or key in ("quiet", "json", "plot") or value == defaults[key]:
            continue
        if key == "engines":
            value = ["reference" if engine == "lanes" else engine for engine in value]
        flag = "--" + key.replace("_", "-")
        if value is True:
            parts.append(flag)
        else:
            text = ",".join(value) if isinstance(value, list) else str(value)
            parts.append(f"{flag}{'=' if text.startswith('-') else ' '}{shlex.quote(text)}")  # (-x: an option)
    return " ".join(parts)


def _call_costs_line(c: dict) -> str:
    """`call ms by rows (context P): core t(1)=... prefill t(BP)=... | head h(1)=... | embed e(1)=...`."""
    parts = []
    for stage, letter in (("core", "t"), ("head", "h"), ("embed", "e")):
        points = sorted((int(r), s) for r, s in c[f"{stage}_seconds_by_rows"].items())  # (JSON keys are strings)
        parts.append(f"{stage} " + " ".join(f"{letter}({r})={_ms(s)}" for r, s in points)
                     + f" prefill {letter}({c['prefill_rows']})={_ms(c[f'{stage}_prefill_seconds'])}")
    return f"call ms by rows (context {c['context']}): " + " | ".join(parts)


def format_table(result: dict) -> str:
    """The human-readable table: header with the run's settings, the call costs, one line per mode."""
    a, m = result["args"], result["machine"]
    lines = [(
        f"hf-loopspec bench | {result['model']['name']} ({result['model']['parameters'] / 1e6:.1f}M params) | "
        f"{m['device_name']} {a['dtype']} | threads {m['torch_threads']} | batch {a['batch_size']} | "
        f"prompt {a['prompt_len']} | new {a['new_tokens']} | d={a['draft_loops']} K={a['num_speculative_tokens']} "
        + (f"d2={a['second_draft_loops']} " if a.get("second_draft_loops") is not None else "") +
        f"| repeats {a['repeats']} | load avg {_num(m.get('load_avg_1m_start'))}->{_num(m.get('load_avg_1m_end'))}"
    )]
    if result.get("sampling") is not None:
        off = [name for name, value, no_op in (("top_p", result["sampling"]["top_p"], 1.0),
                                                ("top_k", result["sampling"]["top_k"], 0)) if value == no_op]
        lines.append(f"*** {sampling_title(result['sampling'])}{' (' + ', '.join(off) + ' off)' if off else ''}: "
                     "every mode samples, seeded with --seed + round; acceptance is the real min(1, p/q); outputs "
                     "are not comparable with plain token by token ***")
    compile_s = ", ".join(f"{r['mode']} {r['compile_seconds']:.1f}s" for r in result["rows"]
                          if r.get("compile_seconds") is not None)
    if compile_s:
        lanes = f"lane modes compiled (compile_core, backend {a['compile']}); " if a.get("compile") else ""
        lines.append(f"{lanes}warm-up minus timed run (compile time where compiled): {compile_s}")
    if result["synthetic_acceptance"] is not None:
        lines.append(f"*** SYNTHETIC ACCEPTANCE {result['synthetic_acceptance']}: each draft is replaced by the known "
                     "greedy token with this probability, else by a wrong one; verification is real ***")
    lines.append(_call_costs_line(result["call_costs"]))
    width = max([9, *(len(r["mode"]) + 1 for r in result["rows"])])
    header = (f"{'mode':<{width}}{'tok/s':>9}{'x plain':>9}{'x ar':>7}{'ideal':>7}{'%ideal':>8}{'overhd':>8}"
              f"{'calls/tok':>10}{'accept':>8}{'peak mem':>10}  check")
    lines += [header, "-" * len(header)]
    for r in result["rows"]:
        check = check_text(r)
        lines.append(
            f"{r['mode']:<{width}}{r['tokens_per_s']:>9.1f}{_num(r['ratio_vs_plain']):>9}{_num(r['speedup_vs_ar']):>7}"
            f"{_num(r['ideal_speedup_vs_ar']):>7}{_num(r['fraction_of_ideal'], '{:.0%}'):>8}"
            f"{_num(r['overhead_fraction'], '{:.0%}'):>8}{_num(r['core_calls_per_token']):>10}"
            f"{_num(r['acceptance_rate'], '{:.3f}'):>8}{_mib(r['peak_mem_bytes']):>10}  {check}"
        )
    lines.append("x ar: measured speed-up over ar; ideal: the speed-up the run's embed/core/head call counts and "
                 "measured call costs imply; overhd: share of the time outside those calls (- for compiled rows: "
                 "the call costs are eager).")
    return "\n".join(lines)


# --- the JSON document -------------------------------------------------------------------------------------------
def mode_row(mode: str, runs: list[dict], seconds: dict[str, float], *, batch: int, new_tokens: int, loops: int,
             check, exact: bool | None, costs: dict, ar_predicted: float,
             warmup_seconds: float | None, compiled: bool, engine: str | None = None) -> dict:
    """One row of `rows`: a mode's median time, speed-ups, counters (lane modes), ideal speed-up and check.

    `runs`: the mode's timed runs (`run.run_mode` results); `check`: "reference" or a `compare` dict;
    `exact`: whether every run equals the reference (None when not checked for identity); `engine`: the engine
    of a lane mode's run ("wavefront" or "reference"; None for plain modes); `compiled`: whether the run was
    compiled (its compile time is reported; its overhead is not, as `costs` are eager call costs).
    The counters, predicted time and overhead all come from one run, the median-time one (`median_run`): auto's
    runs may choose differently from round to round.
    """
    tokens = batch * new_tokens
    row = {
        "mode": mode, "engine": engine, "tokens": tokens, "seconds": seconds[mode],
        "seconds_all": [x["seconds"] for x in runs],
        "tokens_per_s": tokens / seconds[mode],
        "ratio_vs_plain": seconds["plain"] / seconds[mode] if "plain" in seconds else None,
        "speedup_vs_ar": seconds["ar"] / seconds[mode] if "ar" in seconds else None,
        "core_calls": None, "core_calls_per_token": float(loops) if mode in PLAIN_MODES else None,
        "acceptance_rate": None,
        "drafted": None, "verified": None, "accepted": None, "rejected": None, "discarded": None,
        "second_drafts": None, "second_accepted": None,
        "acceptance_rate_all": None, "core_calls_per_token_all": None,
        "ideal_speedup_vs_ar": None, "fraction_of_ideal": None, "predicted_seconds": None, "overhead_fraction": None,
        "warmup_seconds": warmup_seconds,
        "compile_seconds": warmup_seconds - seconds[mode] if compiled else None,
        "peak_mem_bytes": max(x["peak_mem_bytes"] for x in runs),
        "kv_cache_bytes": max(x["kv_bytes"] for x in runs),
        "check": check, "check_passed": exact,
    }
    if mode in PLAIN_MODES:
        return row
    chosen = median_run(runs)
    stats = chosen["stats"]
    row.update(
        core_calls=stats.core_calls, core_calls_per_token=stats.core_calls_per_token,
        acceptance_rate=stats.acceptance_rate if stats.drafted else None,
        drafted=stats.drafted, verified=stats.verified, accepted=stats.accepted, rejected=stats.rejected,
        discarded=stats.discarded, second_drafts=stats.second_drafts, second_accepted=stats.second_accepted,
        acceptance_rate_all=[x["stats"].acceptance_rate if x["stats"].drafted else None for x in runs],
        core_calls_per_token_all=[x["stats"].core_calls_per_token for x in runs],
    )
    if hasattr(stats, "choices"):  # auto: what each segment ran, and why
        row["auto_choices"] = stats.to_dict()["choices"]
    if getattr(stats, "plain_tokens", 0):  # auto with plain segments: transformers' loop, outside the cost model
        return row
    predicted = predicted_seconds(costs, chosen["call_rows"])
    row.update(ideal_speedup_vs_ar=ar_predicted / predicted, predicted_seconds=predicted,
               overhead_fraction=None if compiled else 1.0 - predicted / chosen["seconds"])
    if row["speedup_vs_ar"] is not None:
        row["fraction_of_ideal"] = row["speedup_vs_ar"] / row["ideal_speedup_vs_ar"]
    return row


def median_run(runs: list[dict]) -> dict:
    """The run whose time is the median of `runs`' (the faster of the two middle ones for an even count)."""
    return sorted(runs, key=lambda x: x["seconds"])[(len(runs) - 1) // 2]


def build_result(rows: list[dict], *, args, machine: dict, model, model_name: str, sampling: dict | None,
                 warpers: list[str] | None, costs: dict, ar_predicted: float) -> dict:
    """The whole JSON document (see the module docstring)."""
    machine = {**machine, "load_avg_1m_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
    cuda = machine["device"].startswith("cuda")
    return {
        "schema": SCHEMA,
        "rows": rows,
        "machine": machine,
        "args": {key: value for key, value in vars(args).items() if key != "speculative_given"},
        "model": model_record(model, model_name),
        "synthetic_acceptance": args.synthetic_acceptance,
        "sampling": None if sampling is None else {
            **sampling, "warpers": warpers, "seed": args.seed,
            "seeding": "torch.manual_seed(seed + round) before each timed run of a round, torch.manual_seed(seed) "
                       "before each warm-up run"},
        "call_costs": {
            "context": costs["context"], "prefill_rows": costs["prefill_rows"],
            **{f"{stage}_seconds_by_rows": costs["by_rows"][stage] for stage in STAGES},
            **{f"{stage}_prefill_seconds": costs["prefill"][stage] for stage in STAGES},
            "ar_predicted_seconds": ar_predicted},
        "notes": {**NOTES,
                  "peak_mem_kind": "cuda_max_memory_allocated" if cuda
                  else "params_plus_kv_cache_allocated_bytes (CPU: torch allocations are not traced)",
                  "check": GREEDY_CHECK_NOTE if sampling is None else SAMPLING_CHECK_NOTE},
        "all_checks_passed": all(r["check_passed"] is not False for r in rows),
    }


def check_writable(path: str | Path, flag: str) -> None:
    """`ValueError` naming `flag` when a file cannot be written at `path` (its folders are made): checked before a
    run, so that a long run is not lost at its end."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        existed = path.exists()
        with path.open("a"):
            pass
        if not existed:
            path.unlink()
    except OSError as err:
        blocking = file_in_the_way(path)  # mkdir would say "File exists"
        reason = f"{blocking} is a file, not a folder" if blocking is not None else err.strerror
        raise ValueError(f"{flag} {path}: cannot write there ({reason}); pass a writable path.") from None


def write_result(result: dict, path: str | Path) -> None:
    """Write `result` as JSON (row-count keys of the call costs become strings, as JSON needs)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2, default=str))


def model_record(model, name: str) -> dict:
    """What a results document says of the model it measured: its name, size, loops and architecture."""
    return {"name": name, "parameters": sum(p.numel() for p in model.parameters()), "num_loops": model.num_loops,
            "config": {key: getattr(model.config, key, None) for key in CONFIG_KEYS},
            "initial_states": "zeros (init_scale 0)" if hasattr(model, "recurrence") else None}


def same_architecture(record: dict, other: dict) -> bool:
    """Whether two `model_record`s describe one architecture (size and config; the names may differ)."""
    return (record.get("parameters"), record.get("config")) == (other.get("parameters"), other.get("config"))


def load_result(path: str | Path) -> dict:
    """A results file written by `write_result` (or `--json`); `ValueError` when it is not one."""
    try:
        result = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as err:
        raise ValueError(f"{path}: cannot be read ({err.strerror}); pass a file written by `hf-loopspec bench "
                         "--json`.") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text (byte {err.object[err.start]:#04x} at byte {err.start}), so not "
                         "JSON; pass a file written by `hf-loopspec bench --json`.") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not JSON ({err}); pass a file written by `hf-loopspec bench --json`.") from None
    return checked_result(result, str(path))


def checked_result(result, name: str) -> dict:
    """`result` (a results document, read from `name`: a file or an argument) when it is what `write_result` writes;
    `ValueError` naming `name` otherwise."""
    if not isinstance(result, dict) or not {"rows", "machine", "args", "model"} <= set(result) \
            or not all(isinstance(result[key], dict) for key in ("machine", "args", "model")) \
            or "name" not in result["model"]:
        raise ValueError(f"{name} is not an `hf-loopspec bench --json` result (it lacks rows, machine, args or model, "
                         "or they are not what the bench writes).")
    rows = result["rows"]
    if not isinstance(rows, list) or not all(isinstance(r, dict) and {"mode", "tokens_per_s"} <= set(r) for r in rows):
        raise ValueError(f"{name} is not an `hf-loopspec bench --json` result (its rows are not one per mode: a "
                         "workload or auto-table result?); pass a file written by `hf-loopspec bench --json`.")
    return result
