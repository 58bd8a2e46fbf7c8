"""The speed section of a model card, built from `hf-loopspec bench` results (the JSON documents of
`hf_loopspec.bench.report`, whose schema that module owns): one subsection per result with its machine, the command
that reproduces it and a table per mode. Without results the section says that there are no measured numbers,
instead of showing any. A result measured on a local checkpoint folder (`--model PATH`) is quoted as measured on the
card's repo (`--model REPO_ID`): a path of the measuring machine means nothing to a reader, and the card's repo holds
the same weights. `eval_results` turns the same results into the card's `model-index` metadata."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path, PureWindowsPath

from huggingface_hub import EvalResult

from ..bench.report import check_text, checked_result, command_line, load_result
from ..bench.shape_table import SHAPES
from .card_checks import is_hub_repo_id

NO_NUMBERS = (
    "No measured speed numbers: no `hf-loopspec bench` results were given when this card was written, so it shows "
    "none. Measure on your own hardware with `hf-loopspec bench --model <repo or folder>` (it checks every "
    "speculative output against plain decoding and prints tokens/s, core calls per token and draft acceptance). "
    "What can be said without a measurement is the call count: plain decoding runs the shared stack U times per "
    "token, pipelined drafting from loop d runs it about d + (U - d)(1 - a) times per token at draft acceptance a; "
    "whether fewer calls mean less time depends on the hardware (see Limitations).")
SYNTHETIC_NOTE = ("**Synthetic acceptance {rate}:** drafts replaced by the known greedy token at this rate "
                  "(verification is real). This measures the decoding engine, not this model's drafts.")
SAMPLING_NOTE = ("**Sampling** ({settings}): outputs are random draws, not compared token by token; acceptance is "
                 "the real min(1, p/q).")
NO_NUMBERS_ONE_LOOP = (
    "No measured speed numbers: no `hf-loopspec bench` results were given when this card was written, so it shows "
    "none. This model runs its stack once per token and decodes plainly; measure it on your own hardware with "
    "`hf-loopspec bench --model <repo or folder> --modes plain`.")
COLUMNS = ("mode", "tok/s", "× plain", "× ar", "calls/token", "acceptance", "check")


def bench_results(benchmarks: Sequence[dict | str | Path] | None) -> list[dict]:
    """Result documents from a list of documents or `--json` file paths; `ValueError` for an item that is not one,
    one document or path given alone (a path string would be read letter by letter), or a result whose check failed
    (a speculative output that differed from plain decoding)."""
    if benchmarks is None:
        return []
    if isinstance(benchmarks, (str, bytes, Path, dict)) or not isinstance(benchmarks, Sequence):
        raise ValueError(f"benchmarks={benchmarks!r} must be a list of bench results (documents or `--json` file "
                         "paths), or None: wrap one in a list.")
    for i, item in enumerate(benchmarks):
        if not isinstance(item, (dict, str, os.PathLike)):
            raise ValueError(f"benchmarks[{i}]={item!r}: give a bench result (a dict) or the path of a `--json` file.")
    results = [checked_result(b, f"benchmarks[{i}]") if isinstance(b, dict) else load_result(b)
               for i, b in enumerate(benchmarks)]
    for i, result in enumerate(results):  # a card quotes only runs whose outputs were plain decoding's
        if failed := [str(r["mode"]) for r in result["rows"] if r.get("check_passed") is False]:
            where = benchmarks[i] if not isinstance(benchmarks[i], dict) else f"benchmarks[{i}]"
            raise ValueError(f"{where}: the bench's check failed for {', '.join(failed)} (its output differed from "
                             "plain decoding), so a card cannot quote it; rerun `hf-loopspec bench --json` and pass a "
                             "result whose checks pass.")
    return results


def eval_results(results: Sequence[dict], source_url: str) -> list[EvalResult]:
    """`model-index` entries for bench result documents: per result (the workload, named by its machine and shape,
    is the "dataset") and per mode, tokens/s, and for speculative modes the ratio to plain decoding and the draft
    acceptance when measured. `source_url` is where the bench comes from. A result of a random-weight shape or with
    synthetic acceptance measures the engine, not the card's model: it stays in the card's speed section (which says
    so) and gets no `model-index` entry."""
    entries = []
    for result in results:
        a, m = result["args"], result["machine"]
        if a.get("model") in SHAPES or result.get("synthetic_acceptance") is not None:
            continue
        count = a.get("threads")
        threads = f", {count} thread{'s' * (count != 1)}" if count else ""
        sampled = ", sampling" if result.get("sampling") is not None else ""
        workload = (f"hf-loopspec bench: {m['device_name']}, {a['dtype']}{threads}, batch {a['batch_size']}, prompt "
                    f"{a['prompt_len']}, {a['new_tokens']} new tokens{sampled}")
        for row in result["rows"]:
            metrics = [("tokens_per_second", "tokens/s", row["tokens_per_s"])]
            if row["mode"] != "plain":
                metrics += [("speedup_vs_plain", "x plain", row.get("ratio_vs_plain")),
                            ("draft_acceptance", "draft acceptance", row.get("acceptance_rate"))]
            entries += [EvalResult(task_type="text-generation", dataset_type="hf-loopspec-bench", dataset_name=workload,
                                   dataset_config=_settings(result), metric_type=kind,
                                   metric_name=f"{row['mode']} {label}", metric_config=row["mode"],
                                   metric_value=round(float(value), 4), source_name="hf-loopspec bench",
                                   source_url=source_url)
                        for kind, label, value in metrics if value is not None]
    return entries


def _settings(result: dict) -> str:
    """The model-index "dataset config" that keeps each workload's metrics apart: the bench flags a result was
    measured with but its model (its command's other flags, a prompt file by its name, or "defaults") and the machine
    it ran on. huggingface_hub groups entries by dataset type, config and split, so results sharing a config went
    under the first one's name: two machines, greedy and sampled runs, engines, compiled runs, prompt files."""
    flags = {key: value for key, value in _quoted_args(result["args"]).items() if key != "model"}
    command = command_line({**result, "args": flags}).removeprefix("hf-loopspec bench").strip() or "defaults"
    return f"{command} on {result['machine']['device_name']}"


def speed_section(results: Sequence[dict], repo_id: str, num_loops: int) -> str:
    """The card's speed section for bench result documents, whose local `--model` folders are named as `repo_id`
    (module docstring); without results, what can be said of a model of `num_loops` loops unmeasured."""
    if not results:
        return NO_NUMBERS if num_loops >= 2 else NO_NUMBERS_ONE_LOOP
    parts = ["Measured with `hf-loopspec bench` (tokens/s are for all sequences of the batch, prefill included; "
             "each table names its machine and the command that reproduces it)."]
    for result in results:
        parts.extend(_subsection(_as_measured_on_repo(result, repo_id)))
    return "\n\n".join(parts)


def _as_measured_on_repo(result: dict, repo_id: str) -> dict:
    """`result` as the card quotes it: a `--prompt-file` by its file name alone, and, unless its `--model` is a Hub
    id, 'default' or a random-weight shape (a checkpoint folder: one that exists here, or a name that is no Hub repo
    id, such as /abs/path or ./folder), `repo_id` as its `--model` and model name. (A copy; `result` is unchanged.)"""
    args, model = _quoted_args(result["args"]), result["args"].get("model")
    if not isinstance(model, str) or model == "default" or model in SHAPES or (
            is_hub_repo_id(model) and not Path(model).expanduser().exists()):
        return {**result, "args": args}
    return {**result, "args": {**args, "model": repo_id}, "model": {**result["model"], "name": repo_id}}


def _quoted_args(args: dict) -> dict:
    """A copy of a result's bench arguments with a `--prompt-file` by its file name alone (its path named the measuring
    machine's folders)."""
    args = dict(args)
    if isinstance(args.get("prompt_file"), str):
        args["prompt_file"] = PureWindowsPath(args["prompt_file"]).name  # (splits at "/" and at "\\": any machine's)
    return args


def _subsection(result: dict) -> list[str]:
    a, m = result["args"], result["machine"]
    title = (f"### {result['model']['name']}, {a['dtype']}, batch {a['batch_size']}, prompt {a['prompt_len']}, "
             f"{a['new_tokens']} new tokens")
    parts = [title]
    if result.get("synthetic_acceptance") is not None:
        parts.append(SYNTHETIC_NOTE.format(rate=result["synthetic_acceptance"]))
    if result.get("sampling") is not None:
        s = result["sampling"]
        parts.append(SAMPLING_NOTE.format(settings=f"temperature {s['temperature']}, top_p {s['top_p']}, "
                                                   f"top_k {s['top_k']}"))
    parts.append(f"Machine: {m['device_name']} ({m['torch_threads']} torch threads), torch {m['torch']}, "
                 f"transformers {m['transformers']}, hf-loopspec {m['hf_loopspec']}.")
    parts.append(f"Command:\n\n```bash\n{command_line(result)}\n```")
    parts.append(_table(result["rows"]))
    return parts


def _table(rows: list[dict]) -> str:
    def number(x, fmt: str = "{:.2f}") -> str:
        return "-" if x is None else fmt.format(x)

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for r in rows:
        cells = (r["mode"], f"{r['tokens_per_s']:.1f}", number(r["ratio_vs_plain"]), number(r["speedup_vs_ar"]),
                 number(r["core_calls_per_token"]), number(r["acceptance_rate"], "{:.3f}"), check_text(r))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
