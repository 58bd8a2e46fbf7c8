"""The wavefront engine: the lane decoder's AR, block and pipeline cycles as one device-resident tensor step.

`state.WavefrontState` holds the whole batch in fixed-shape tensors, `step.make_step` builds the pure cycle
`step(state) -> state` (`step.make_cycles`: several cycles as one function, one compiled call), and
`engine.WavefrontEngine` sets a run up, drives the step from the host with a read-back every R cycles, and tears the
state down into the lane decoder's `DecodeResult`. `sibling` adds second proposals to the step (one sibling slot per
sequence, with private KV), `processing` the logits processing and token choice.
"""

from .engine import WAVEFRONT_MODES, WavefrontEngine, read_back

__all__ = ["WAVEFRONT_MODES", "WavefrontEngine", "read_back"]
