"""`python -m hf_loopspec COMMAND ...`: the `hf-loopspec` command line (`hf_loopspec.cli`)."""

import sys

from .cli import main

sys.exit(main())
