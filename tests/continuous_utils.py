"""The continuous batching tests' helpers: a tiny model's request settings, a manager's sizes, the reference of one
request (plain greedy `generate` of it alone) and the collection of a manager's results."""

from __future__ import annotations

import time

import torch
from inputs import random_prompts
from speculative_utils import PAD, plain
from transformers import ContinuousBatchingConfig, GenerationConfig

VOCAB = 96  # the tiny models' vocabulary
PAGE = 16  # the managers' page size
WAIT_S = 30  # the longest wait for one result (a hung loop fails the test instead of hanging it)


def generation_config(settings: dict, **extra) -> GenerationConfig:
    """A manager's generation config: greedy, 8 new tokens, pad `PAD`, with `settings` and `extra`. Its EOS is unset,
    so requests stop at the model's EOS, as plain `generate` with this config does."""
    return GenerationConfig(**{"max_new_tokens": 8, "do_sample": False, "eos_token_id": None, "pad_token_id": PAD,
                               **settings, **extra})


def batching(slots: int = 2, positions: int = 64, blocks: int | None = None, **extra) -> ContinuousBatchingConfig:
    """B slots of `positions` positions each (`positions` a multiple of `PAGE`), sharing a KV pool of `blocks` pages
    of `PAGE` positions per plane (None: the manager's default), with the config's `extra` settings."""
    return ContinuousBatchingConfig(max_requests_per_batch=slots, max_blocks_per_request=positions // PAGE,
                                    page_size=PAGE, num_blocks=blocks, **extra)


def alone(model, prompt: list[int], max_new: int, eos=None, **kwargs) -> list[int]:
    """Plain greedy decoding of one request by itself (with `generate`'s `kwargs`): its new tokens (up to and with its
    EOS, `eos` or else the model's, as for a request of a `generation_config` manager)."""
    eos = model.generation_config.eos_token_id if eos is None else eos
    out = plain(model, torch.tensor([prompt]), None, max_new, eos_token_id=eos, speculative_mode=None, **kwargs)
    return out.sequences[0, len(prompt):].tolist()


def prompts(seed: int, lengths) -> list[list[int]]:
    """Seeded random prompts of `lengths` tokens, as lists of ids."""
    return [p.tolist() for p in random_prompts(seed, lengths, VOCAB)]


def collect(manager, ids) -> dict:
    """The final result of each of `ids` by id (waiting at most `WAIT_S` per request)."""
    results = {}
    deadline = time.monotonic() + WAIT_S * len(ids)
    while set(ids) - set(results) and time.monotonic() < deadline:
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            results[result.request_id] = result
    assert not set(ids) - set(results), f"no result for {sorted(set(ids) - set(results))}"
    return results


def starting(model, configure):
    """For a fixture: yields `start(*args, **kwargs)`, which builds a manager of `model` from
    `configure(*args, **kwargs) -> (GenerationConfig, ContinuousBatchingConfig)`, starts it and keeps it; every
    manager started is stopped when the fixture ends."""
    managers = []

    def start(*args, **kwargs):
        manager = model.init_continuous_batching(*configure(*args, **kwargs))
        manager.start()
        managers.append(manager)
        return manager

    yield start
    for manager in managers:
        manager.stop(block=True, timeout=WAIT_S)
