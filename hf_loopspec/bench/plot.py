"""`--plot`: a PNG bar chart of a benchmark result (tokens/s and core calls per token by mode); needs matplotlib."""

from __future__ import annotations

from pathlib import Path

from .report import sampling_title

NEEDS_LATEX = {"pgf"}  # formats matplotlib lists but writes only with a LaTeX installation


def pyplot():
    """matplotlib's pyplot on the Agg backend; `ValueError` with the install command when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from ..hub.install import install_command

        raise ValueError(f"--plot needs matplotlib: {install_command('bench')} (or pip install matplotlib).") from None
    return plt


def check_plot_path(path: str) -> None:
    """`ValueError` naming `--plot` when matplotlib cannot write the format of `path`'s extension (none: PNG) without
    more software (`NEEDS_LATEX`), or is missing: checked before the runs, whose results the failed write lost."""
    plt = pyplot()
    formats = set(plt.figure().canvas.get_supported_filetypes()) - NEEDS_LATEX
    plt.close("all")
    suffix = Path(path).suffix[1:].lower()
    if suffix and suffix not in formats:
        raise ValueError(f"--plot {path}: matplotlib cannot write .{suffix} files; pass a path ending in one of "
                         f"{', '.join('.' + name for name in sorted(formats))} (e.g. chart.png).")


def plot(result: dict, path: str) -> None:
    """PNG bar chart: tokens/s and core calls per token by mode."""
    plt = pyplot()
    rows = result["rows"]
    modes = [r["mode"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    left.bar(modes, [r["tokens_per_s"] for r in rows], color="tab:blue")
    left.set_ylabel("tokens / s")
    right.bar(modes, [r["core_calls_per_token"] or 0 for r in rows], color="tab:orange")
    right.set_ylabel("core calls / token")
    a = result["args"]
    title = f"{result['model']['name']} | {a['dtype']} | batch {a['batch_size']} | {a['new_tokens']} new tokens"
    if result["synthetic_acceptance"] is not None:
        title += f" | SYNTHETIC ACCEPTANCE {result['synthetic_acceptance']}"
    if result.get("sampling") is not None:
        title += f" | {sampling_title(result['sampling'])}"
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
