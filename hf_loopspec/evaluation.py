"""`hf-loopspec lm-eval ARGS...`: EleutherAI's lm-evaluation-harness command line with the hf_loopspec model
classes registered, so its `hf` backend loads Ouro and Huginn checkpoints (plain folders or Hub ids) natively and
`--gen_kwargs speculative_mode=pipeline,draft_loops=1` decodes speculatively.

lm-eval is an optional dependency, the `eval` extra (tested with lm-eval 0.4.13); the error of a missing lm-eval gives
the install command (`hf_loopspec.hub.install`).
"""

from __future__ import annotations

import sys


def run_lm_eval(args: list[str]) -> int:
    """Run lm-eval's own CLI on `args` (as the `lm-eval` command would get them); its exit status."""
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
    finally:
        sys.argv = saved
    return 0
