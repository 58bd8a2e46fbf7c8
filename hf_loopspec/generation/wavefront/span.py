"""The shapes a run's step is built for, bounded on the host without reading the device: the positions reserved
per sequence (`reserved_positions`) and the span of each cycle (`SpanBound`: how many positions the step's attention
reads, `Plan.span`).

Compiled, every distinct shape is a compile of the step, so both are rounded up to coarse buckets. The reserved
positions C (padded prompt width + max_new_tokens) go up to a number of the form 2^k or 3 * 2^(k-1), at least 64
(above 64, at most 1.5x the positions asked for; two buckets per doubling): calls whose prompts and lengths fall in
one bucket share their compiled steps. Eager, C is what the call asks for.

Two facts of the cycle (`step`) bound every live lane's position p before cycle c (counted from 0):

* the run starts with one lane per sequence, at its last prompt position (< W, the padded prompt width), and a
  cycle spawns at most one lane per sequence, at most one position past its newest lane: p <= W - 1 + c;
* after a cycle, an unfinished sequence's live lanes hold consecutive positions from that of its last committed
  token, prompt_len + n_out - 1 (the lane that computes the next token), so they lie below prompt_len + n_out - 1 + L;
  a read-back taken after cycle c0 shows n_out, and each later cycle moves the newest lane one position at most:
  p <= W + n_out + L - 2 + (c - c0).

A cycle's rows read positions up to their own, so the span p_max + 1 covers them. The span is rounded up to a
bucket and capped at C: compiled, a power of two from 64, where a bucket of at least C / 2 is C itself (each bucket
is one compile of the step: at most log2(C / 64) + 1 of them); eager, a multiple of 16 (nothing to compile; a tight
span saves reads).
"""

from __future__ import annotations

EAGER_BUCKET = 16  # eager spans are multiples of this
MIN_COMPILED_SPAN = 64  # compiled spans are powers of two from this
MIN_COMPILED_POSITIONS = 64  # compiled, the fewest positions reserved per sequence


def reserved_positions(needed: int, compiled: bool) -> int:
    """C, the positions to reserve per sequence for a call that needs `needed` (padded prompt width +
    max_new_tokens): compiled, the smallest 2^k or 3 * 2^(k-1) >= `needed` (at least `MIN_COMPILED_POSITIONS`);
    eager, `needed`."""
    if not compiled:
        return needed
    power = max(MIN_COMPILED_POSITIONS, 1 << (needed - 1).bit_length())  # 2^k >= needed
    return power * 3 // 4 if power * 3 // 4 >= max(needed, MIN_COMPILED_POSITIONS) else power


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
        return bucket(needed, self.compiled, self.positions)


def bucket(needed: int, compiled: bool, positions: int) -> int:
    """`needed` rounded up and capped at `positions` (C): compiled, to a power of two (at least `MIN_COMPILED_SPAN`),
    or to C when that power is at least C / 2 (one bucket fewer: its reads at most double); eager, to a multiple of
    `EAGER_BUCKET`."""
    if compiled:
        power = max(MIN_COMPILED_SPAN, 1 << (needed - 1).bit_length())
        return positions if 2 * power >= positions else power
    return min(positions, -(-needed // EAGER_BUCKET) * EAGER_BUCKET)
