"""`python -m hf_loopspec.bench ...`: the same as `hf-loopspec bench ...`."""

import sys

from .main import main

sys.exit(main())
