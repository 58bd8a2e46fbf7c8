"""Per-call recurrence settings of the Huginn family (`HuginnModel.recurrence`): the settings, where the open blocks
keep them, the rule for a seed and the seed of one token's initial state."""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace

from ...generation.config import RECURRENCE_OPTIONS
from ..layers import is_finite_real, is_integer

MAX_INIT_SEED = 2**64  # a generator's seed is 64 bits: a larger one would act as another
GENERATION_KEYS = RECURRENCE_OPTIONS  # a generation config's recurrence settings: num_steps, init_scale, init_seed


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
    beams: int = 1  # consecutive batch rows of one prompt (beam search), keyed as one sequence: `beam_rows`


OPEN_BLOCKS: ContextVar[dict[int, Recurrence] | None] = ContextVar("huginn_recurrence", default=None)
"""The settings of the `recurrence` blocks open in this thread (or asyncio task), keyed by `id(HuginnModel)`: a
call's settings never live on the shared model, so threads decoding one model with different settings do not
interfere. Never mutated: a block sets a new dict and restores the previous one on exit."""


@contextmanager
def beam_rows(model, beams: int):
    """Inside the block, `model`'s (a `HuginnModel` in an open `recurrence` block) batch rows are `beams` beams per
    prompt, whose tokens draw the states of their prompt's (sequence = row // beams): beam search reorders the beams
    between steps, so a state keyed by the row would no longer be the one the beam's cached tokens were drawn with."""
    if beams <= 1:
        yield
        return
    token = OPEN_BLOCKS.set({**OPEN_BLOCKS.get(), id(model): replace(model.settings, beams=beams)})
    try:
        yield
    finally:
        OPEN_BLOCKS.reset(token)


RUNNING_CALLS: ContextVar[dict[int, tuple[Recurrence, Recurrence | None]] | None] = ContextVar("huginn_calls",
                                                                                               default=None)
"""For each `HuginnModel` (by id) with a `generate` call running in this thread (or asyncio task): the block the call
opened for its own steps, and the block its caller had open (None: none). Never mutated, as `OPEN_BLOCKS`."""


def callers_settings(model) -> Recurrence | None:
    """The innermost block of `model` (a `HuginnModel`) open outside its running `generate` calls (None: none): inside
    a call's own block (its streamer, a logits processor or a stopping criterion run there), the block that call's
    caller had open; a block opened since is the caller's. A `generate` call or a continuous batching manager made
    there starts from it, not from that call's settings."""
    block = (OPEN_BLOCKS.get() or {}).get(id(model))
    own, caller = (RUNNING_CALLS.get() or {}).get(id(model), (None, None))
    return caller if own is not None and block is own else block


@contextmanager
def callers_block(model):
    """Where a `generate` call of `model` (a `HuginnModel`) opens its block: its caller's (`callers_settings`),
    yielded."""
    blocks = OPEN_BLOCKS.get() or {}
    caller = callers_settings(model)
    if caller is blocks.get(id(model)):
        yield caller
        return
    others = {key: value for key, value in blocks.items() if key != id(model)}
    token = OPEN_BLOCKS.set(others | ({id(model): caller} if caller is not None else {}))
    try:
        yield caller
    finally:
        OPEN_BLOCKS.reset(token)


@contextmanager
def running_call(model, caller: Recurrence | None):
    """Inside `model`'s `generate` call, whose own block is open and whose caller had `caller` open
    (`callers_block`): the call recorded in `RUNNING_CALLS`."""
    token = RUNNING_CALLS.set({**(RUNNING_CALLS.get() or {}), id(model): (OPEN_BLOCKS.get()[id(model)], caller)})
    try:
        yield
    finally:
        RUNNING_CALLS.reset(token)


def passed_settings(model, generation_config) -> dict:
    """The recurrence settings a generation config passed to a call sets (those not None): they come before an open
    `recurrence` block's. The model's own generation config (`model.generation_config`, or None: no config passed)
    sets none here: its settings are the defaults (`HuginnModel.defaults`), which an open block overrides."""
    if generation_config is None or generation_config is model.generation_config:
        return {}
    return {key: value for key in GENERATION_KEYS if (value := getattr(generation_config, key, None)) is not None}


def check_passed(settings: dict, mean_recurrence: int) -> None:
    """`ValueError` naming the generation config when one of the `settings` a call reads from a passed config
    (`passed_settings`) is bad."""
    try:
        updated(Recurrence(1, 1.0, None), *map(settings.get, GENERATION_KEYS), mean_recurrence)
    except ValueError as error:
        raise ValueError(f"generation_config: {error}") from None


def check_saved(model, given: dict) -> None:
    """`ValueError` for a recurrence setting of `model.generation_config` (a `HuginnForCausalLM`'s) that a call giving
    the settings `given` (those not None) reads and refuses: an invalid one, in `updated`'s words, or a `num_steps`
    whose KV for one token exceeds the free memory (`check_steps_fit`)."""
    saved = [getattr(model.generation_config, key, None) if given.get(key) is None else None for key in GENERATION_KEYS]
    updated(Recurrence(1, 1.0, None), *saved, model.config.mean_recurrence)
    if saved[0] is not None:  # (the other two settings fixed: they do not size the KV)
        with model.recurrence(num_steps=saved[0], init_scale=1.0, init_seed=0):
            check_steps_fit(model)


def check_steps_fit(model) -> None:
    """`ValueError` when one token's KV over every plane of `model`'s call (a `HuginnForCausalLM` inside its call's
    `recurrence` block) takes more than the free memory: a call with such a `num_steps` (say 10**9, from a served
    request) would fail allocating, or be killed with its server, instead of saying why."""
    from ...generation.dispatch import free_memory  # (the generation package imports the models)

    layout = model.kv_layout
    per_token = 2 * layout.num_planes * layout.num_layers * layout.num_kv_heads * layout.head_dim * \
        model.lane_dtype.itemsize
    if per_token > free_memory(model.device):
        raise ValueError(f"num_steps={model.num_loops}: one token's KV over its {layout.num_planes} planes takes "
                         f"{per_token / 2**30:.1f} GiB, more than the free memory; use fewer steps (the checkpoint's "
                         f"mean_recurrence is {model.config.mean_recurrence}).")


def state_seed(seed: int, sequence: int, position: int) -> int:
    """A generator seed for one token's initial state, mixed from (seed, sequence, position)."""
    mixed = (seed * 0x9E3779B97F4A7C15 + sequence * 0xBF58476D1CE4E5B9 + position * 0x94D049BB133111EB) % 2**64
    return (mixed ^ (mixed >> 31)) % 2**63


def updated(current: Recurrence, num_steps, init_scale, init_seed, mean_recurrence: int) -> Recurrence:
    """`current` with the settings that are not None (Python or numpy numbers), each checked: `ValueError` naming a
    bad one."""
    if num_steps is not None and not (is_integer(num_steps) and num_steps >= 1):
        raise ValueError(f"num_steps={num_steps!r} must be an integer >= 1 (default: mean_recurrence="
                         f"{mean_recurrence}).")
    if init_scale is not None and not (is_finite_real(init_scale) and init_scale >= 0):
        raise ValueError(f"init_scale={init_scale!r} must be a finite number >= 0 (0 gives zero initial states).")
    if init_seed is not None and not valid_init_seed(init_seed):
        raise ValueError(f"init_seed={init_seed!r} must be an integer in [0, 2**64) or None (a generator's seed "
                         "is 64 bits: a larger one would act as another).")
    given = {"num_steps": num_steps, "init_scale": init_scale, "init_seed": init_seed}
    updates = {k: float(v) if k == "init_scale" else int(v) for k, v in given.items() if v is not None}
    return replace(current, **updates)
