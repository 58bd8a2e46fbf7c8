"""The `hf-loopspec` console script's entry point, outside the package so that it runs before the package's import.

`import hf_loopspec` registers the model classes with transformers, which imports torch: seconds before a line of
help. Imported from here, the package defers that (`DEFER_REGISTRATION`, read by `hf_loopspec/__init__.py`), so
`--help` and argument errors need argparse only; `hf_loopspec.cli.main` registers before it runs a command.
`python -m hf_loopspec.cli` (what `accelerate launch` runs) imports the package as any user code does.
"""

DEFER_REGISTRATION = True


def main() -> int:
    from hf_loopspec.cli import main as cli_main

    return cli_main()
