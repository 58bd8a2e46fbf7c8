"""The span of each cycle: how many positions the step's attention reads (`Plan.span`), bounded on the host
without reading the device.

Two facts of the cycle (`step`) bound every live lane's position p before cycle c (counted from 0):

* the run starts with one lane per sequence, at its last prompt position (< W, the padded prompt width), and a
  cycle spawns at most one lane per sequence, at most one position past its newest lane: p <= W - 1 + c;
* after a cycle, an unfinished sequence's live lanes hold consecutive positions from that of its last committed
  token, prompt_len + n_out - 1 (the lane that computes the next token), so they lie below prompt_len + n_out - 1 + L;
  a read-back taken after cycle c0 shows n_out, and each later cycle moves the newest lane one position at most:
  p <= W + n_out + L - 2 + (c - c0).

A cycle's rows read positions up to their own, so the span p_max + 1 covers them. The span is rounded up to a
bucket and capped at C: compiled, a power of two from 64 (each bucket is one compile of the step: at most
log2(C / 64) + 2 of them); eager, a multiple of 16 (nothing to compile; a tight span saves reads).
"""

from __future__ import annotations

EAGER_BUCKET = 16  # eager spans are multiples of this
MIN_COMPILED_SPAN = 64  # compiled spans are powers of two from this


class SpanBound:
    """The span of each cycle of one run: `width` W, `lanes` L, `positions` C, whether the step is `compiled`."""

    def __init__(self, width: int, lanes: int, positions: int, compiled: bool):
        self.width, self.lanes, self.positions, self.compiled = width, lanes, positions, compiled
        self.seen = None  # (cycle, largest n_out of an unfinished sequence) of the latest read-back looked at

    def observe(self, cycle: int, counts: list[int], finished: list[bool]) -> None:
        """A read-back taken after `cycle` cycles: committed counts and finished flags per sequence."""
        self.seen = (cycle, max((n for n, f in zip(counts, finished) if not f), default=0))

    def span(self, cycle: int) -> int:
        """The span of cycle `cycle` (counted from 0)."""
        needed = self.width + cycle
        if self.seen is not None:
            seen_cycle, committed = self.seen
            needed = min(needed, self.width + committed + self.lanes - 1 + cycle - seen_cycle)
        return min(self.positions, bucket(needed, self.compiled))


def bucket(needed: int, compiled: bool) -> int:
    """`needed` rounded up: compiled, to a power of two (at least `MIN_COMPILED_SPAN`); eager, to a multiple of
    `EAGER_BUCKET`."""
    if compiled:
        return max(MIN_COMPILED_SPAN, 1 << (needed - 1).bit_length())
    return -(-needed // EAGER_BUCKET) * EAGER_BUCKET
