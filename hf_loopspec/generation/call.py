"""What one `generate` call resolves once and its steps share, scoped to the call (never stored on the model).

transformers' `generate` reaches the model through hooks with fixed signatures (`_prepare_generation_config`,
`_validate_generation_mode`, `_prepare_cache_for_generation`, `_sample`). `LoopSpecGenerationMixin.generate`
opens a `GenerateCall` for the duration of the call in a context variable: the per-call options that are not
generation settings (`draft_hook`, `speculative_trace`) and the speculative settings, resolved once from the
call's generation config. A context variable is private to its thread (and asyncio task), so two threads calling
`generate` on one model each see their own call; nested calls restore the outer one on exit.
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from .config import SpeculativeConfig, asks, merged_exit
from .inputs import merged_setting

RUNTIME_KEYS = ("draft_hook", "second_draft_hook", "speculative_trace")
"""Per-call `generate` kwargs that are not generation settings: `draft_hook` (test-only: override draft proposals,
`draft_hook(sequence, position, proposed_token) -> token`), `second_draft_hook` (test-only: override second
proposals, `second_draft_hook(sequence, position, first_token, proposed_token) -> token`) and `speculative_trace`
(`True` or `"hidden"`: record every cycle in `out.trace`)."""


@dataclass
class GenerateCall:
    draft_hook: Callable[[int, int, int], int] | None = None
    second_draft_hook: Callable[[int, int, int, int], int] | None = None
    trace: bool | str = False
    speculative: SpeculativeConfig | None = None  # resolved once, when transformers prepares the generation config
    resolved: bool = False  # whether `speculative` has been resolved (None then means plain decoding)
    dynamic_cache: Any = None  # the caller's DynamicCache a speculative run continues: its KV copied in and back
    exits: tuple[int, SimpleNamespace] | None = None  # (id of the model, the exit options it merged): `pass_exit`
    segment_exits: tuple[int, SimpleNamespace] | None = None  # an auto call's `exits` while a segment runs

    def problem(self, generation_config) -> str | None:
        """Why this call's runtime options cannot be honoured under its resolved `generation_config`, or None: a trace
        asked for would be missing from the output without a word in a call that decodes plainly (no cycles; the
        test-only draft hooks are ignored there, as `draft_loops` is: one dict of settings can sweep modes, None
        included) or returns the ids alone."""
        if self.trace is False:
            return None
        if self.speculative is None:
            return (f"speculative_trace={self.trace!r} records a speculative mode's cycles, but this call decodes "
                    "plainly (speculative_mode=None): there are none. Set speculative_mode, or drop speculative_trace.")
        return None if generation_config.return_dict_in_generate else _unreturned(self.trace)


_CURRENT: ContextVar[GenerateCall | None] = ContextVar("hf_loopspec_generate_call", default=None)


def runtime_options(kwargs: dict, model_config=None) -> GenerateCall:
    """Pop the `RUNTIME_KEYS` from `generate`'s kwargs into a new call; raises `ValueError` for a bad value, and, given
    the model's `model_config` (auto: checked up front), for a trace asked for without `return_dict_in_generate`: it
    would be dropped with the output object (other calls: `GenerateCall.problem`, once resolved)."""
    hook = kwargs.pop("draft_hook", None)
    if hook is not None and not callable(hook):
        raise ValueError(f"draft_hook={hook!r} must be callable(seq, position, token).")
    second = kwargs.pop("second_draft_hook", None)
    if second is not None and not callable(second):
        raise ValueError(f"second_draft_hook={second!r} must be callable(seq, position, first_token, token).")
    trace = trace_setting(kwargs.pop("speculative_trace", None))
    if trace and model_config is not None and not _returns_dict(kwargs, model_config):
        raise ValueError(_unreturned(trace))
    parent = current_call()  # (auto's segment, a call nested in the auto call: its exits, `pass_exit`)
    return GenerateCall(draft_hook=hook, second_draft_hook=second, trace=trace, exits=parent and parent.segment_exits)


def trace_setting(value) -> bool | str:
    """`speculative_trace=value` as a call runs it (None: False; a numpy bool: Python's); `ValueError` unless it is
    True, False or 'hidden' (1.0 == True: refused)."""
    value = False if value is None else bool(value) if isinstance(value, (bool, np.bool_)) else value
    if not (isinstance(value, bool) or (isinstance(value, str) and value == "hidden")):
        raise ValueError(f"speculative_trace={value!r} must be True, False or 'hidden'.")
    return value


def _returns_dict(kwargs: dict, model_config) -> bool:
    """`return_dict_in_generate` as transformers merges it (`inputs.merged_setting`)."""
    return bool(merged_setting(kwargs, model_config, "return_dict_in_generate"))


def _unreturned(trace) -> str:
    return (f"speculative_trace={trace!r} is returned as out.trace, which needs return_dict_in_generate=True "
            "(without it generate returns the ids alone): pass that too, or drop speculative_trace.")


def checked_hook(name: str, hook: Callable[..., int] | None, vocab: int) -> Callable[..., int] | None:
    """`hook` (a draft hook, named `name`) with its result checked: a token id in `[0, vocab)`, as a Python int, a
    numpy integer or a one-element integer tensor or array; anything else raises `ValueError` naming the hook and the
    value (a negative id would read as 'not forced' in the wavefront engine, one past the vocabulary fail in the
    embedding). None stays None."""
    if hook is None:
        return None

    def call(*args) -> int:
        value = hook(*args)
        one = isinstance(value, (torch.Tensor, np.ndarray)) and value.reshape(-1).shape == (1,)
        item = value.item() if one else value
        if isinstance(item, bool) or not isinstance(item, numbers.Integral) or not 0 <= item < vocab:
            raise ValueError(f"{name} returned {value!r} for {args}: it must return a token id in [0, {vocab}).")
        return int(item)

    return call


def reject_configured_runtime_keys(config) -> None:
    """`ValueError` when a generation config asks for one of the `RUNTIME_KEYS` (a hook, a trace), which only a
    `generate` argument sets (the config's would be unread: no trace, no hook); None and False ask for nothing."""
    given = [f"{key}={getattr(config, key)!r}" for key in RUNTIME_KEYS if asks(getattr(config, key, None))]
    if given:
        raise ValueError(f"{', '.join(given)} in a generation config is not read: pass it to generate(...) as an "
                         "argument instead.")


@contextlib.contextmanager
def scoped(call: GenerateCall) -> Iterator[GenerateCall]:
    """Make `call` the current call of this thread until the block exits."""
    token = _CURRENT.set(call)
    try:
        yield call
    finally:
        _CURRENT.reset(token)


def current_call() -> GenerateCall | None:
    """The `GenerateCall` of the `generate` running in this thread, or None outside one."""
    return _CURRENT.get()


def pass_exit(model, given: dict, config) -> dict:
    """The exit options a call of `model` runs with (`merged_exit` of the call's `given` ones over `config`'s),
    merged once and recorded on the running call, which passes them to every forward of `model`: a forward inside the
    call (its steps, a criterion's scoring) reads them in place of the model's generation config (`call_exits`),
    which another thread may edit while the call runs (a plain call mixed two exits from that step on). A segment of
    an auto call (`auto_segment`) merges over the options the auto call recorded; any other nested call (a
    criterion's or a streamer's own generate) over its own config."""
    call = current_call()
    frozen = call_exits(model)
    options = merged_exit(given, config if frozen is None else frozen)
    if call is not None:
        call.exits = (id(model), SimpleNamespace(**options))  # (read as a config by each forward: built once)
    return options


@contextlib.contextmanager
def auto_segment() -> Iterator[None]:
    """Run one segment of the running auto call: the `generate` call it makes takes the exit options the auto call
    merged (`segment_exits`), which no other call nested in the auto call takes."""
    call = current_call()
    if call is not None:
        call.segment_exits = call.exits
    try:
        yield
    finally:
        if call is not None:
            call.segment_exits = None


def call_exits(model) -> SimpleNamespace | None:
    """The exit options the `generate` running in this thread merged for `model` (`pass_exit`), as attributes, or
    None outside such a call. (Under `torch.compile` tracing the caller reads its config: a context variable does not
    trace.)"""
    call = current_call()
    if call is None or call.exits is None or call.exits[0] != id(model):
        return None
    return call.exits[1]
