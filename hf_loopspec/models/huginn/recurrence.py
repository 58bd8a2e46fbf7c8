"""Per-call recurrence settings of the Huginn family (`HuginnModel.recurrence`): the settings, where the open blocks
keep them, the rule for a seed and the seed of one token's initial state."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

from ..layers import is_integer

MAX_INIT_SEED = 2**64  # a generator's seed is 64 bits: a larger one would act as another


def valid_init_seed(value) -> bool:
    """Whether `value` can key initial states (`init_seed`): an integer in [0, MAX_INIT_SEED)."""
    return is_integer(value) and 0 <= value < MAX_INIT_SEED


@dataclass(frozen=True)
class Recurrence:
    """Per-call settings: `num_steps` recurrence steps; initial states drawn with `init_scale` (0: zeros) keyed
    by `init_seed`."""

    num_steps: int
    init_scale: float
    init_seed: int | None


OPEN_BLOCKS: ContextVar[dict[int, Recurrence] | None] = ContextVar("huginn_recurrence", default=None)
"""The settings of the `recurrence` blocks open in this thread (or asyncio task), keyed by `id(HuginnModel)`: a
call's settings never live on the shared model, so threads decoding one model with different settings do not
interfere. Never mutated: a block sets a new dict and restores the previous one on exit."""


def state_seed(seed: int, sequence: int, position: int) -> int:
    """A generator seed for one token's initial state, mixed from (seed, sequence, position)."""
    mixed = (seed * 0x9E3779B97F4A7C15 + sequence * 0xBF58476D1CE4E5B9 + position * 0x94D049BB133111EB) % 2**64
    return (mixed ^ (mixed >> 31)) % 2**63
