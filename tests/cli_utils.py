"""What the command-line test files share: a runnable command line per subcommand, and the one error line a failed
command must print."""

from __future__ import annotations

from pathlib import Path


def command(name: str, model: str, tmp_path: Path) -> list[str]:
    """A run of `name` on `model` that would succeed with a good checkpoint (batch: writes its PROMPTS file)."""
    if name == "generate":
        return ["generate", "w5 w6", "--model", model, "--device", "cpu", "--max-new-tokens", "2"]
    if name == "batch":
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text('{"id": 0, "prompt": "w5 w6"}\n')
        return ["batch", str(prompts), "--output", str(tmp_path / "out.jsonl"), "--model", model, "--device", "cpu",
                "--max-new-tokens", "2"]
    if name == "bench":
        return ["bench", "--model", model, "--device", "cpu", "--prompt-len", "4", "--new-tokens", "2", "--repeats",
                "1", "--calibration-seconds", "0.05", "--quiet", "--modes", "plain"]
    return ["export", model, str(tmp_path / "OUT"), "--benchmarks", "none"]


def one_error_line(capsys, name: str) -> str:
    """The single line on stderr (nothing else there, nothing on stdout)."""
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and len(lines) == 1, f"stdout {out!r}, stderr {err!r}"
    assert lines[0].startswith(f"hf-loopspec {name}: error: "), lines[0]
    return lines[0]
