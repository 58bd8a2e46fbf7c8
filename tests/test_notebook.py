"""The examples: `examples/loopspec_colab.ipynb` is stored without outputs and executes end to end with nbclient on CPU
against the embedded model (`LOOPSPEC_NOTEBOOK_FAST=1`, offline); `examples/quickstart.py` runs; the schedule drawing
of `hf_loopspec.trace_plot` reads a pipeline trace correctly."""

from __future__ import annotations

import subprocess
import sys

import matplotlib
import nbformat
import pytest
import torch
from inputs import left_pad, random_prompts
from processes import ROOT, subprocess_env
from speculative_utils import tiny_spec_model

from hf_loopspec.hub import install
from hf_loopspec.trace_plot import plot_schedule, schedule_grid

matplotlib.use("Agg")

NOTEBOOK = ROOT / "examples" / "loopspec_colab.ipynb"


def default_model_or_skip() -> str:
    try:
        from hf_loopspec.assets import default_model_path

        return default_model_path()
    except (ImportError, FileNotFoundError) as err:
        pytest.skip(f"the embedded default model is not available: {err}")


def offline_env() -> dict:
    return subprocess_env(LOOPSPEC_NOTEBOOK_FAST="1", drop=("MPLBACKEND",))  # MPLBACKEND: the kernel's inline backend


# --- the notebook ---------------------------------------------------------------------------------------------------


def test_notebook_is_stored_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code, "the notebook has no code cells"
    for cell in code:
        assert cell.outputs == [] and cell.execution_count is None, "strip the outputs before committing"
    source = "\n".join(cell.source for cell in code)
    for needle in ("google.colab", "pip", "get_device_capability", "model_info", "TextStreamer", "run_bench",
                   "plot_schedule", "speculative_trace=True", "LOOPSPEC_NOTEBOOK_FAST", "torch.set_num_threads(1)",
                   "repetition_penalty=1.4", "bar_label"):
        assert needle in source, needle
    # Colab installs the package from the repository URL of the package metadata (it is not on PyPI)
    assert f'"{install.requirement()}"' in source


@pytest.mark.slow
def test_notebook_executes_on_cpu_with_the_embedded_model(tmp_path, monkeypatch):
    from nbclient import NotebookClient

    default_model_or_skip()
    for key, value in offline_env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("MPLBACKEND", raising=False)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()

    texts, images = [], 0
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            assert output.output_type != "error", output
            if output.output_type == "stream":
                texts.append(output.text)
            images += "image/png" in output.get("data", {})
    text = "".join(texts)
    assert "device: cpu" in text and "dtype: torch.float32" in text and "torch threads: 1" in text
    assert "x plain" in text  # the bench's speeds, beside plain decoding
    for mode in ("plain", "block", "pipeline"):
        assert f"--- {mode} ---" in text
    assert "same tokens as plain decoding: {'plain': True, 'block': True, 'pipeline': True}" in text
    assert images == 2  # the bench chart and the schedule


def test_quickstart_runs_on_the_embedded_model():
    default_model_or_skip()
    command = [sys.executable, str(ROOT / "examples" / "quickstart.py"), "--max-new-tokens", "8", "--repeats", "1"]
    proc = subprocess.run(command, check=False, capture_output=True, text=True, env=offline_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "all modes gave the same tokens" in proc.stdout
    assert "1 torch thread(s)" in proc.stdout  # the thread count is set and stated
    speed = proc.stdout.split("speed (median of 1 interleaved rounds", 1)[1].splitlines()
    assert speed[1].split() == ["mode", "tok/s", "x", "plain", "calls/token", "acceptance"]
    rows = {line.split()[0]: line.split() for line in speed[2:5]}
    assert rows["plain"][2] == "1.00" and rows["plain"][3] == "4.00"  # plain is the reference: U calls per token
    for mode in ("plain", "block", "pipeline"):
        assert f"[{mode}] " in proc.stdout and mode in rows


@pytest.mark.parametrize("options, message", [
    (["--repeats", "0"], "argument --repeats: 0 must be at least 1"),  # it decoded every mode, then crashed
    (["--chat"], "--chat: the tokenizer of default has no chat template"),  # transformers' traceback
])
def test_quickstart_refuses_what_it_cannot_run_in_one_line(options, message):
    default_model_or_skip()
    command = [sys.executable, str(ROOT / "examples" / "quickstart.py"), "--max-new-tokens", "2", *options]
    proc = subprocess.run(command, check=False, capture_output=True, text=True, env=offline_env(), timeout=300)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert message in proc.stderr.strip().splitlines()[-1]


# --- the schedule drawing -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pipeline_trace():
    """A pipelined run (d = 1, U = 4) of a tiny model that accepts some drafts and rejects others."""
    model = tiny_spec_model(seed=1, damp=0.06)
    ids, mask = left_pad(random_prompts(1, [6], 96))
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0,
                             speculative_mode="pipeline", draft_loops=1, return_dict_in_generate=True,
                             speculative_trace=True)
    return out


def test_schedule_grid_reads_the_pipeline(pipeline_trace):
    out = pipeline_trace
    grid = schedule_grid(out.trace, num_loops=4)
    stats = out.speculation
    assert grid.num_cycles == stats.core_calls == len(out.trace)
    assert grid.prompt_len == 6 and sum(grid.commits) == stats.committed_tokens == 16
    # the prefill: all prompt tokens go through depths 0..3 (loops 1..4) in the first four calls
    for depth in range(4):
        (cell,) = [c for c in grid.cells if c.cycle == depth and c.depth == depth]
        assert cell.kind == "prompt" and len(cell.tokens) == 6
    # pipeline with d = 1: at most one token per (call, loop), drafts start at depth 0 (loop 1)
    assert all(len(c.tokens) == 1 for c in grid.cells if c.kind != "prompt")
    verdicts = {}
    for cycle in out.trace:
        for kind, _, position, token in cycle.events:
            if kind in ("accept", "reject"):
                verdicts[(position, token)] = kind
    kinds = {(c.positions[0], c.tokens[0]): c.kind for c in grid.cells if c.kind != "prompt"}
    for key, verdict in verdicts.items():
        assert kinds[key] == {"accept": "accepted", "reject": "rejected"}[verdict]
    counts = {k: sum(1 for key in kinds if kinds[key] == k) for k in ("accepted", "rejected")}
    assert counts["accepted"] == stats.accepted and counts["rejected"] == stats.rejected
    assert stats.accepted > 0 and stats.rejected > 0, "the fixture should show both verdicts"


def test_plot_schedule_draws_every_cell(pipeline_trace, tmp_path):
    fig = plot_schedule(pipeline_trace.trace, num_loops=4, max_cycles=20)
    ax = fig.axes[0]
    grid = schedule_grid(pipeline_trace.trace, num_loops=4)
    assert len(ax.patches) == sum(1 for c in grid.cells if c.cycle < 20)
    # loops counted from 1, as the prose counts them: the top row (depth 0) is loop 1, the last loop U
    assert [t.get_text() for t in ax.get_yticklabels()] == ["loop 1", "loop 2", "loop 3", "loop 4"]
    labels = {t.get_text() for t in ax.get_legend().get_texts()}
    assert {"prompt", "draft, accepted", "draft, rejected"} <= labels
    fig.savefig(tmp_path / "schedule.png")
    assert (tmp_path / "schedule.png").stat().st_size > 0


def test_plot_schedule_refuses_what_it_cannot_draw_with(pipeline_trace):
    """An `ax` that is no matplotlib Axes and a `tokenizer` without `decode` are named (AttributeErrors before)."""
    with pytest.raises(ValueError, match="ax is a str; pass a matplotlib Axes"):
        plot_schedule(pipeline_trace.trace, num_loops=4, ax="x")
    with pytest.raises(ValueError, match="tokenizer is a str, which has no decode method"):
        plot_schedule(pipeline_trace.trace, num_loops=4, tokenizer="x")


def test_schedule_grid_needs_a_trace():
    with pytest.raises(ValueError, match="speculative_trace=True"):
        schedule_grid([])
