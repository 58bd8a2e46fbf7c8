"""`generate_batch` on a looped model: transformers' signature and result (`dict[request id, GenerationOutput]`, in
the order of the inputs), through `continuous_batching_context_manager` and the package's manager.

Unlike transformers' own, it never returns short or empty without saying so: an error of the manager's loop is
raised (a `RuntimeError` from it), and a request the manager refused is returned FAILED with the reason in its
`error`, and logged.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from tqdm.auto import tqdm

from ...logs import get_logger
from ...models.layers import is_integer
from .settings import MAX_EOS_IDS, check_config_types, eos_ids, extra_problem, manager_config, nested

logger = get_logger(__name__)

RESULT_WAIT_S = 1.0  # how long one wait for a result lasts before the loop's health is checked again


def generate_batch(model, inputs, generation_config=None, continuous_batching_config=None,
                   record_timestamps: bool = False, progress_bar: bool = False, persistent_manager: bool = False,
                   warmup: bool = True, **kwargs) -> dict:
    """Decode every prompt of `inputs` (lists of token ids) with continuous batching (see the module docstring).
    `kwargs`: `max_new_tokens`, `eos_token_id` (for every request) and per-request keys of `add_request` (`seed`)."""
    _check_arguments(inputs, kwargs)
    check_config_types(generation_config, continuous_batching_config)
    if not inputs:
        return {}
    config = manager_config(model, generation_config)  # as the manager reads it
    max_new_tokens = kwargs.pop("max_new_tokens", None)  # None: each request's from the generation config
    max_new_tokens = None if max_new_tokens is None else int(max_new_tokens)  # (a numpy integer, checked above)
    hints = SimpleNamespace(max_prompt_length=max(len(ids) for ids in inputs),
                            max_generated_length=max_new_tokens if max_new_tokens is not None
                            else config.max_new_tokens, num_requests=len(inputs))
    context = model.continuous_batching_context_manager(
        generation_config=generation_config, continuous_batching_config=continuous_batching_config, block=True,
        persistent_manager=persistent_manager, warmup=warmup, workload_hints=hints)
    results = {}
    with context as manager, tqdm(total=len(inputs), disable=not progress_bar, unit="request") as bar:
        _check_request_settings(manager, max_new_tokens, kwargs)
        ids = [manager.new_request_id() for _ in inputs]  # known before each is added: cleaned up on Ctrl-C
        pending, added = list(ids), set()  # (by id: a kept manager may serve requests of others)
        try:
            for request_id, prompt in zip(ids, inputs):
                added.add(request_id)  # (before the call: Ctrl-C inside add_request may leave it queued)
                try:
                    manager.add_request(prompt, request_id=request_id, max_new_tokens=max_new_tokens,
                                        record_timestamps=record_timestamps, **kwargs)
                except ValueError:  # the id is another caller's, open on the manager: not this call's to cancel
                    added.discard(request_id)
                    raise
            while pending:
                result = manager.get_result(pending[0], timeout=RESULT_WAIT_S)
                if result is not None and result.is_finished():
                    results[pending.pop(0)] = result
                    bar.update(1)
                elif result is None and not manager.is_running():
                    break
        except BaseException:  # Ctrl-C: a kept manager must not go on decoding, and holding, what nobody reads
            for request_id in (i for i in pending if i in added):
                if manager.output_router.abandon(request_id):
                    manager.cancel_request(request_id)
            raise
        fatal = manager.background_thread_status.fatal_error
    if fatal is not None:
        raise RuntimeError(f"generate_batch: the continuous batching loop failed: {fatal}") from fatal
    missing = [request_id for request_id in ids if request_id not in results]
    if missing:
        raise RuntimeError(f"generate_batch: the manager stopped before requests {missing[:8]} finished.")
    failed = [request_id for request_id in ids if results[request_id].error is not None]
    if failed:
        logger.error("generate_batch: requests %s failed: %s", failed[:8], results[failed[0]].error)
    return {request_id: results[request_id] for request_id in ids}


def _check_request_settings(manager, max_new_tokens, kwargs: dict) -> None:
    """`ValueError` for a setting that `generate_batch` gives every request and none can run with (each request
    would fail alone, all for the same reason). `eos_token_id` and `streaming` are `add_request`'s own arguments
    (`_check_arguments` checks the EOS ids)."""
    problem = extra_problem(manager.settings, {k: v for k, v in kwargs.items() if k not in ("eos_token_id",
                                                                                              "streaming")})
    if problem:
        raise ValueError(f"generate_batch: {problem}")


def _check_arguments(inputs, kwargs: dict) -> None:
    """`ValueError` naming a `generate_batch` argument it cannot take: `max_new_tokens` must be an integer >= 1 or
    None; `inputs` a list (or tuple) of prompts, each a list, 1-D tensor or 1-D array of token ids; `request_id` is
    the manager's to give (one per request). (The configs' types: `settings.check_config_types`.)"""
    max_new_tokens = kwargs.get("max_new_tokens")  # sizes the manager's slots: checked before it is built
    if max_new_tokens is not None and (not is_integer(max_new_tokens) or max_new_tokens < 1):
        raise ValueError(f"generate_batch: max_new_tokens={max_new_tokens!r}: give an integer >= 1, or None for the "
                         "generation config's.")
    if len(eos_ids(kwargs.get("eos_token_id"))) > MAX_EOS_IDS:  # (eos_ids: a ValueError for what is no id)
        raise ValueError(f"generate_batch: eos_token_id={kwargs['eos_token_id']!r} holds more than {MAX_EOS_IDS} "
                         "ids, the most a request takes.")
    if "request_id" in kwargs:
        raise ValueError(f"request_id={kwargs['request_id']!r} in generate_batch would give every request the same "
                         "id: drop it (the manager numbers the requests; the result is keyed by those ids), or add "
                         "requests one by one with manager.add_request(ids, request_id=...).")
    if not isinstance(inputs, (list, tuple)):
        shape = f"a tensor of shape {tuple(inputs.shape)}" if torch.is_tensor(inputs) else type(inputs).__name__
        raise ValueError(f"inputs: {shape}; give a list of prompts, each a list of token ids (e.g. "
                         "tokenizer(texts)['input_ids'], or tensor.tolist() of a [batch, length] tensor without "
                         "padding).")
    for i, ids in enumerate(inputs):
        deep = isinstance(ids, (list, tuple)) and nested(ids)
        if deep or not isinstance(ids, (list, tuple)) and getattr(ids, "ndim", None) != 1:
            shape = " of lists" if deep else f" of shape {tuple(ids.shape)}" if hasattr(ids, "shape") else ""
            raise ValueError(f"inputs[{i}]: a {type(ids).__name__}{shape}; each prompt must be a list (or 1-D tensor "
                             "or array) of token ids: tokenize texts first (tokenizer(texts)['input_ids']).")
