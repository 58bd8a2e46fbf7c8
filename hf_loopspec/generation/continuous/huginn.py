"""Models with recurrence settings and keyed initial states (Huginn: `recurrence`, `initial_states`) in continuous
batching.

Recurrence settings are the manager's, fixed at its start as `generate` takes them: a passed generation config's
`num_steps`, `init_scale` and `init_seed` where it sets them, over those in force where the manager is built (an open
`model.recurrence(...)` block, not a running `generate` call's own, else the model's defaults: its generation config's,
else `mean_recurrence` steps, init_scale 1.0, no seed) (`manager_recurrence`). `num_steps` and `init_scale` shape the
step (they are `Plan` constants), so they hold for every request.

Initial states are per request: at admission, slot b's row of `WavefrontState.init_states` is refilled with the
states plain `generate` of that request alone draws (a batch of one: sequence 0, positions 0, 1, ...) under the
request's seed (`fill_initial_states`), so its tokens do not depend on its slot or on what else is in flight. The
seed is the request's own `init_seed` (`add_request(..., init_seed=S)`, as `generate(..., init_seed=S)`), else the
manager's `init_seed` (as every `generate` call inside one `recurrence` block shares that block's seed), else one
drawn for that request at admission, as each `generate` call outside a block draws its own: from the manager's
generator when the continuous batching config has a `seed`, else from torch's global generator. With init_scale 0
the states are zeros and no seed is used.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace

import torch

from ...models.huginn.recurrence import GENERATION_KEYS, callers_settings, check_passed, updated, valid_init_seed

REQUEST_KEY = "init_seed"  # the per-request key of a model with recurrence settings
SET_UP_SEED = 0  # keys the placeholder states drawn at set-up (every admission replaces its slot's)


def manager_recurrence(model, passed: dict):
    """The recurrence settings of a manager built here with a generation config that sets `passed` (its
    `passed_settings`): see the module docstring. None for a model without them."""
    if not hasattr(model, "recurrence_settings"):
        return None
    check_passed(passed, model.config.mean_recurrence)
    given = (passed.get(key) for key in GENERATION_KEYS)  # (numpy numbers made Python's)
    current = callers_settings(model.transformer) or model.transformer.defaults()  # (inside a call: its caller's)
    return updated(current, *given, model.config.mean_recurrence)


def kept_recurrence_problem(model, passed: dict, kept) -> str | None:
    """Why a kept manager running `kept` (its `manager_recurrence`) cannot serve a call that would build one here
    (another `model.recurrence` block open, or none) with a generation config that sets `passed`, or None."""
    wanted = manager_recurrence(model, passed)
    if wanted is None or _effective(wanted) == _effective(kept):  # (None: a model without recurrence settings)
        return None
    seed_only = replace(wanted, init_seed=kept.init_seed) == kept
    why = (" Only the seed differs: a recurrence block given no init_seed draws its own, so give the blocks (or the "
           "generation config) one init_seed to reuse the manager." if seed_only else "")
    return (f"this model keeps a continuous batching manager built with the recurrence settings {kept}, but the call "
            f"runs under {wanted} (a passed generation config's num_steps, init_scale and init_seed over the "
            "model.recurrence(...) block open now, else over the model's defaults); call "
            f"model.destroy_cached_continuous_batching_manager() first, or call it under the same settings.{why}")


def _effective(recurrence):
    """What of `recurrence` decides the tokens: with init_scale 0 the states are zeros and the seed is unused."""
    return replace(recurrence, init_seed=None) if recurrence.init_scale == 0 else recurrence


def manager_block(model, recurrence):
    """The `model.recurrence` block the manager's set-up runs in (`ValueError` from it for a bad setting); no block
    for a model without recurrence settings."""
    if recurrence is None:
        return nullcontext()
    seed = SET_UP_SEED if recurrence.init_seed is None else recurrence.init_seed
    return model.recurrence(recurrence.num_steps, recurrence.init_scale, seed)


def request_problem(extra: dict) -> str | None:
    """Why a request's `init_seed` (if any) cannot run, or None."""
    seed = extra.get(REQUEST_KEY)  # None: the manager's seed, as no key
    if seed is not None and not valid_init_seed(seed):
        return f"{REQUEST_KEY}={seed!r}: give an integer in [0, 2**64), or None for the manager's seed."
    return None


@torch.no_grad()
def fill_initial_states(model, recurrence, state, b: int, request, seeds: torch.Generator | None) -> None:
    """Refill slot `b`'s row of `state.init_states` for `request` (a `RequestState`) before its prompt is embedded:
    positions 0 .. prompt + max_new_tokens - 1, those its committed tokens depend on (a later position holds the
    previous owner's states, read only by lanes past the request's limit, whose tokens are never committed). `seeds`:
    the manager's generator for requests without a seed (None: torch's global one). Nothing for a model without
    recurrence settings."""
    if recurrence is None:
        return
    seed = request.logit_processor_kwargs.get(REQUEST_KEY)
    seed = recurrence.init_seed if seed is None else int(seed)
    if seed is None and recurrence.init_scale > 0:
        seed = int(torch.randint(2**62, (), generator=seeds))
    reach = min(state.init_states.shape[1], len(request.initial_tokens) + request.max_new_tokens)
    positions = torch.arange(reach, device=state.init_states.device)
    with model.recurrence(recurrence.num_steps, recurrence.init_scale, seed):
        state.init_states[b, :reach] = model.initial_states(torch.zeros_like(positions), positions)
