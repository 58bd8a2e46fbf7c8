"""A returned `PagedLoopCache` is a transformers cache that any mode can continue.

For every pair of modes (plain / pipeline / block -> plain / pipeline / block), on Ouro and Huginn, a padded batch
in which rows stop early at EOS in the first call: the first call fills a `PagedLoopCache`; the second call passes
the whole sequence (the first output, then a new suffix per row, padded in the middle) with that cache. Its output
must equal one uninterrupted plain call over the whole sequence without a cache (transformers' loop on a fresh
`DynamicCache`), and the cache must report what it holds (`get_seq_length` per layer, tokens per row).
A 3-turn chat with the embedded default model continues its cache across turns in mixed modes.
"""

from __future__ import annotations

import contextlib
import copy
import itertools

import numpy as np
import pytest
import torch
from huginn_utils import tiny_huginn
from inputs import extend, left_pad, random_prompts
from speculative_utils import generate_dict, named_modes, paged_cache, tiny_spec_model
from tolerances import assert_fp32_close, fp32_tolerance, huginn_depth, ouro_depth, rms
from transformers import AutoTokenizer, StoppingCriteria, StoppingCriteriaList
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

import hf_loopspec
from hf_loopspec import PagedLoopCache
from hf_loopspec.generation import mixin
from hf_loopspec.generation.history import run_planes
from hf_loopspec.generation.mixin import looped_static_cache

# plain decoding and one setting of each speculative mode from the shared matrix, by name
MODES = named_modes()
PIPELINE, BLOCK = list(MODES)[1:]
FIRST, SECOND = 7, 6  # new tokens of the two calls


def generate(model, ids, mask, new, mode, eos, cache=None, **extra):
    """One call in the mode named `mode` (`MODES`), stopping at `eos`, on `cache` (None: generate's own)."""
    return generate_dict(model, ids, mask, new, eos_token_id=eos, cache=cache, **MODES[mode], **extra)


def ouro_case():
    model = tiny_spec_model(61, 4, vocab=64, damp=0.3)
    return model, 64, {}


def huginn_case():
    model, _ = tiny_huginn(seed=3, damp=0.3)
    return model, model.config.vocab_size, {"num_steps": 4, "init_scale": 1.0, "init_seed": 77}


@pytest.fixture(scope="module", params=["ouro", "huginn"])
def case(request):
    model, vocab, settings = {"ouro": ouro_case, "huginn": huginn_case}[request.param]()
    ids, mask = left_pad(random_prompts(7, [5, 2, 4], vocab))
    free = generate(model, ids, mask, FIRST, "plain", None, **settings).sequences[:, ids.shape[1]:]
    eos = int(free[0, 2])  # row 0 stops within 3 tokens (at its first `eos`), the others if they meet it
    suffixes = random_prompts(8, [3, 1, 2], vocab)
    return model, settings, ids, mask, eos, suffixes


def assert_cache_reports(model, cache: PagedLoopCache, mode: str, columns: int, mask, settings):
    """The cache consumed every column but the last and stores, per row, the real tokens of those columns."""
    assert cache.get_seq_length() == columns
    layout, loops = cache.kv_layout, settings.get("num_steps", model.num_loops)
    for plane in run_planes(layout, loops, MODES[mode].get("draft_loops")):
        assert cache.get_seq_length(plane * layout.num_layers) == columns, plane
        assert [cache.length(s, plane) for s in range(len(mask))] == mask[:, :columns].sum(-1).tolist(), plane


@pytest.mark.parametrize("first,second", list(itertools.product(MODES, MODES)))
def test_continue_any_mode_from_any_mode(case, first, second):
    model, settings, ids, mask, eos, suffixes = case
    cache = paged_cache(model, debug=True, num_steps=settings.get("num_steps"))
    out = generate(model, ids, mask, FIRST, first, eos, cache, **settings)
    assert out.cache is cache
    full, full_mask = extend(out.sequences, mask, suffixes)
    assert_cache_reports(model, cache, first, out.sequences.shape[1] - 1, full_mask, settings)
    expected = generate(model, full, full_mask, SECOND, "plain", eos, DynamicCache(), **settings).sequences
    got = generate(model, full, full_mask, SECOND, second, eos, cache, **settings)
    assert got.sequences.tolist() == expected.tolist(), f"{first} -> {second}"
    assert_cache_reports(model, cache, second, got.sequences.shape[1] - 1,
                         torch.cat([full_mask, torch.ones(len(full), got.sequences.shape[1] - full.shape[1],
                                                          dtype=full_mask.dtype)], dim=1), settings)


@pytest.mark.parametrize("second", ["plain", "auto"])
def test_a_cache_filled_under_inference_mode_continues_outside_it(case, second):
    """Pools made under `torch.inference_mode` took writes only there: plain decoding (and auto, which decodes
    plainly here) continued such a cache outside it with torch's "Inplace update to inference tensor" error."""
    model, settings, ids, mask, eos, suffixes = case
    with torch.inference_mode():
        out = generate(model, ids, mask, FIRST, PIPELINE, eos, paged_cache(model, num_steps=settings.get("num_steps")),
                       **settings)
    full, full_mask = extend(out.sequences, mask, suffixes)
    expected = generate(model, full, full_mask, SECOND, "plain", eos, DynamicCache(), **settings).sequences
    got = generate_dict(model, full, full_mask, SECOND, eos_token_id=eos, cache=out.cache,
                        speculative_mode=None if second == "plain" else "auto", **settings)
    assert got.sequences.tolist() == expected.tolist()


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_three_turn_chat_reuses_the_cache_in_mixed_modes():
    """The embedded model's tokenizer has no chat template of its own, so the test gives it a ChatML one. Each turn
    appends the template's text after the assistant's reply (its generated ids kept as they are) and the next user
    message, and continues the previous turn's cache; every turn equals a plain call over the whole conversation."""
    path = hf_loopspec.default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = tokenizer.chat_template or CHATML
    model = hf_loopspec.OuroForCausalLM.from_pretrained(path).eval()
    users = ["Hello there.", "Tell me about loops.", "And then?"]
    marker = "\u0000REPLY\u0000"
    ids = tokenizer.apply_chat_template([{"role": "user", "content": users[0]}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    cache = PagedLoopCache(model.kv_layout)
    history = [{"role": "user", "content": users[0]}]
    for turn, mode in enumerate([PIPELINE, BLOCK, "plain"]):
        if turn:
            text = tokenizer.apply_chat_template(
                history + [{"role": "assistant", "content": marker}, {"role": "user", "content": users[turn]}],
                add_generation_prompt=True, tokenize=False)
            suffix = tokenizer(text[text.index(marker) + len(marker):], return_tensors="pt")["input_ids"]
            ids = torch.cat([ids, suffix], dim=1)
            history.append({"role": "user", "content": users[turn]})
        mask = torch.ones_like(ids)
        expected = generate(model, ids, mask, 12, "plain", tokenizer.eos_token_id, DynamicCache()).sequences
        out = generate(model, ids, mask, 12, mode, tokenizer.eos_token_id, cache)
        assert out.sequences.tolist() == expected.tolist(), f"turn {turn} ({mode})"
        assert cache.get_seq_length() == out.sequences.shape[1] - 1
        ids = out.sequences
        history.append({"role": "assistant", "content": tokenizer.decode(ids[0, -12:])})


@pytest.mark.parametrize("mode", list(MODES))
def test_a_cache_filled_for_fewer_rows_is_refused(mode):
    """A cache filled at batch 1 continued with a batch of 2 (the conversation duplicated): the second row's history
    is not in the cache, so every mode raises (the speculative ones decoded it from its new tokens alone, silently)
    and leaves what the cache holds as it was."""
    model, vocab, _ = ouro_case()
    ids, mask = left_pad(random_prompts(1, [6], vocab))
    cache = PagedLoopCache(model.kv_layout)
    first = generate(model, ids, mask, 4, mode, None, cache=cache).sequences
    held = cache.get_seq_length()
    two = torch.cat([torch.cat([first, first]), torch.randint(1, vocab, (2, 2))], 1)
    with pytest.raises(ValueError, match=r"stores \[9, 0\] tokens per sequence"):
        generate(model, two, torch.ones_like(two), 5, mode, None, cache=cache)
    assert cache.get_seq_length() == held and cache.length(0, 0) == first.shape[1] - 1


def _held(cache) -> list:
    """What a cache holds, per table (paged) or per layer (dense: its length, None for an empty layer)."""
    if isinstance(cache, PagedLoopCache):
        return [cache.lengths(plane) for plane in range(cache.num_planes)]
    return [layer.get_seq_length() if layer.is_initialized else None for layer in cache.layers]


@pytest.mark.parametrize("kind", ["paged", "dynamic"])
@pytest.mark.parametrize("mode", list(MODES))
def test_an_interrupted_call_leaves_the_cache_as_it_was(mode, kind):
    """A stopping criterion that raises in the middle of a second turn: the cache keeps its first turn (a speculative
    run's tables held its reserved positions, plain decoding's the positions it had fed, so no later call could
    continue it; plain decoding's `DynamicCache` kept the columns it had fed), and the retried turn gives plain
    decoding's tokens."""
    model, vocab, _ = ouro_case()
    ids, mask = left_pad(random_prompts(2, [6, 3, 5], vocab))
    cache = PagedLoopCache(model.kv_layout) if kind == "paged" else DynamicCache()
    first = generate(model, ids, mask, FIRST, mode, None, cache=cache).sequences
    held = _held(cache)
    second, second_mask = extend(first, mask, random_prompts(3, [2, 2, 2], vocab))

    class Interrupt(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            if input_ids.shape[1] > second.shape[1] + 1:
                raise KeyboardInterrupt
            return torch.zeros(len(input_ids), dtype=torch.bool)

    with pytest.raises(KeyboardInterrupt):
        generate(model, second, second_mask, SECOND, mode, None, cache=cache,
                 stopping_criteria=StoppingCriteriaList([Interrupt()]))
    assert _held(cache) == held
    assert cache.get_seq_length() == first.shape[1] - 1  # the columns the first turn fed
    out = generate(model, second, second_mask, SECOND, mode, None, cache=cache).sequences
    expected = generate(model, second, second_mask, SECOND, "plain", None).sequences
    assert torch.equal(out, expected)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_full_cache_keeps_its_first_turn(mode):
    """A second turn that needs more pages than a fixed-capacity cache has raises `CacheCapacityError` and leaves the
    first turn in the cache (lengths, columns and pages in use as before); with the capacity raised (the error's own
    advice) the turn continues to plain decoding's tokens."""
    model, vocab, _ = ouro_case()
    ids, mask = left_pad(random_prompts(4, [6, 3], vocab))
    first = generate(model, ids, mask, FIRST, mode, None, cache=PagedLoopCache(model.kv_layout, page_size=4)).sequences
    sizing = PagedLoopCache(model.kv_layout, page_size=4)
    generate(model, ids, mask, FIRST, "plain", None, cache=sizing)
    cache = PagedLoopCache(model.kv_layout, page_size=4, max_pages=sizing.num_pages)  # the first turn fits
    assert torch.equal(generate(model, ids, mask, FIRST, mode, None, cache=cache).sequences, first)
    held, used = [cache.lengths(plane) for plane in range(cache.num_planes)], cache.pages_in_use
    second, second_mask = extend(first, mask, random_prompts(5, [2, 2], vocab))
    with pytest.raises(hf_loopspec.CacheCapacityError):
        generate(model, second, second_mask, 4 * sizing.num_pages, mode, None, cache=cache)
    assert [cache.lengths(plane) for plane in range(cache.num_planes)] == held
    assert cache.pages_in_use == used and cache.get_seq_length() == first.shape[1] - 1
    cache.max_pages = None
    out = generate(model, second, second_mask, SECOND, mode, None, cache=cache).sequences
    assert torch.equal(out, generate(model, second, second_mask, SECOND, "plain", None).sequences)


def test_a_refused_beam_search_leaves_the_cache_as_it_was():
    """Beam search asked to continue a one-row `PagedLoopCache` raises a `ValueError` that names the expanded batch
    (as transformers refuses it on a `DynamicCache`); the cache still holds its one sequence, and a greedy turn
    continues it to plain decoding's tokens."""
    model, vocab, _ = ouro_case()
    ids, mask = left_pad(random_prompts(6, [5], vocab))
    cache = PagedLoopCache(model.kv_layout)
    first = generate(model, ids, mask, FIRST, "plain", None, cache=cache).sequences
    second, second_mask = extend(first, mask, random_prompts(7, [2], vocab))
    with pytest.raises(ValueError, match=r"holds 1 sequences, the input has batch size 3: beam search"):
        generate(model, second, second_mask, SECOND, "plain", None, cache=cache, num_beams=3)
    assert cache.num_sequences == 1 and cache.get_seq_length() == first.shape[1] - 1
    with torch.no_grad(), pytest.raises(ValueError, match="the input has batch size 2"):  # a forward of its own
        model(second[:, cache.get_seq_length():].repeat(2, 1), attention_mask=second_mask.repeat(2, 1),
              past_key_values=cache)
    assert cache.num_sequences == 1
    out = generate(model, second, second_mask, SECOND, "plain", None, cache=cache).sequences
    assert torch.equal(out, generate(model, second, second_mask, SECOND, "plain", None).sequences)


class InterruptAt(StoppingCriteria):
    """Raises `KeyboardInterrupt` (Ctrl-C) at its `at`-th call."""

    def __init__(self, at: int):
        self.at, self.calls = at, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return torch.zeros(len(input_ids), dtype=torch.bool)


@pytest.mark.parametrize("fault", ["capacity", "interrupt"])
@pytest.mark.parametrize("assisted", ["lookup", "assistant"])
def test_an_assisted_call_that_raises_leaves_the_cache_empty(assisted, fault):
    """Prompt lookup and an assistant model (transformers' assisted decoding, plain mode) on a fresh `PagedLoopCache`
    that fills up (a fixed capacity) or is interrupted after a few steps: the error propagates, and the cache holds
    nothing (no columns, no pages in use), ready for a retry."""
    model, vocab, _ = ouro_case()
    extra = dict(prompt_lookup_num_tokens=3) if assisted == "lookup" else \
        dict(assistant_model=tiny_spec_model(62, 4, vocab=64, damp=0.3))
    ids, mask = left_pad(random_prompts(8, [6], vocab))
    cache = PagedLoopCache(model.kv_layout, page_size=4, max_pages=3 * model.kv_layout.num_planes
                           if fault == "capacity" else None)
    if fault == "interrupt":
        extra["stopping_criteria"] = StoppingCriteriaList([InterruptAt(3)])
    with pytest.raises(hf_loopspec.CacheCapacityError if fault == "capacity" else KeyboardInterrupt):
        generate(model, ids, mask, 40, "plain", None, cache=cache, **extra)
    assert cache.get_seq_length() == 0 and cache.num_sequences == 0 and cache.pages_in_use == 0


@pytest.mark.parametrize("kind", ["paged", "dynamic"])
@pytest.mark.parametrize("assisted", ["lookup", "assistant"])
def test_assisted_decoding_does_not_continue_a_filled_cache(assisted, kind):
    """transformers' assisted decoding feeds the whole input again when it continues a filled cache (the history
    would be stored twice, the tokens wrong): refused with a `ValueError` naming the setting, the cache unchanged."""
    model, vocab, _ = ouro_case()
    extra = dict(prompt_lookup_num_tokens=3) if assisted == "lookup" else \
        dict(assistant_model=tiny_spec_model(62, 4, vocab=64, damp=0.3))
    ids, mask = left_pad(random_prompts(8, [6], vocab))
    cache = PagedLoopCache(model.kv_layout) if kind == "paged" else DynamicCache()
    first = generate(model, ids, mask, FIRST, "plain", None, cache=cache).sequences
    held = cache.get_seq_length()
    second, second_mask = extend(first, mask, random_prompts(9, [2], vocab))
    name = "prompt_lookup_num_tokens=3" if assisted == "lookup" else "assistant_model"
    with pytest.raises(ValueError, match=rf"{name} cannot continue a cache that already holds {held} columns"):
        generate(model, second, second_mask, 4, "plain", None, cache=cache, **extra)
    assert cache.get_seq_length() == held
    if assisted == "lookup":  # the call's None overrides a configured lookup, as transformers merges it: no refusal
        model.generation_config.prompt_lookup_num_tokens = 3
        continued = generate(model, second, second_mask, 4, "plain", None, cache=cache, prompt_lookup_num_tokens=None)
        expected = generate(model, second, second_mask, 4, "plain", None, prompt_lookup_num_tokens=None)
        assert torch.equal(continued.sequences, expected.sequences)


def test_the_cache_api_answers_as_a_dynamic_cache():
    """transformers' questions to a cache (`len`, `get_seq_length`, `get_mask_sizes`, `get_max_length`) get the
    answers of a `DynamicCache` filled by the same plain call, layer by layer."""
    model, vocab, _ = ouro_case()
    ids, mask = left_pad(random_prompts(10, [6, 4], vocab))
    paged, dynamic = PagedLoopCache(model.kv_layout), DynamicCache()
    for cache in (paged, dynamic):
        generate(model, ids, mask, FIRST, "plain", None, cache=cache)
    assert len(paged) == len(dynamic) == model.kv_layout.num_planes * model.kv_layout.num_layers
    assert paged.get_max_length() == dynamic.get_max_length() == -1
    for layer in range(len(dynamic)):
        assert paged.get_seq_length(layer) == dynamic.get_seq_length(layer)
        assert paged.get_mask_sizes(3, layer) == dynamic.get_mask_sizes(3, layer)


def test_sequence_selection_takes_masks_and_indices_as_a_dynamic_cache_does():
    """`batch_select_indices` with a boolean mask keeps the masked rows (it read True/False as indices 1/0 and
    swapped rows); with negative indices it counts from the end. Continuing either cache with the kept rows'
    sequences gives a `DynamicCache` continuation's tokens."""
    model, vocab, _ = ouro_case()
    ids, mask = left_pad(random_prompts(11, [6, 3, 5], vocab))
    for keep in (torch.tensor([True, False, True]), torch.tensor([-1, 0]), [2, 0]):
        paged, dynamic = PagedLoopCache(model.kv_layout), DynamicCache()
        first = [generate(model, ids, mask, FIRST, "plain", None, cache=c).sequences for c in (paged, dynamic)]
        assert torch.equal(*first)
        for cache in (paged, dynamic):
            cache.batch_select_indices(keep if torch.is_tensor(keep) else torch.tensor(keep))
        rows = torch.arange(3)[keep if torch.is_tensor(keep) else torch.tensor(keep)]
        whole, whole_mask = first[0][rows], torch.cat([mask, torch.ones(3, FIRST, dtype=mask.dtype)], 1)[rows]
        out = [generate(model, whole, whole_mask, SECOND, mode, None, cache=c).sequences
               for mode, c in (("plain", dynamic), ("plain", paged))]
        assert torch.equal(out[0], out[1]), keep


def test_bad_cache_arguments_raise_value_errors_naming_them():
    """Every cache argument a user can get wrong gets a `ValueError` naming it (they were bare IndexError /
    AttributeError / TypeError, or float indices were truncated and a negative repeat emptied the cache)."""
    model, vocab, _ = ouro_case()
    cache = PagedLoopCache(model.kv_layout)
    ids, mask = left_pad(random_prompts(12, [4, 6], vocab))
    generate(model, ids, mask, 3, "plain", None, cache=cache)
    before = repr(cache)
    for call, match in [
        (lambda: cache.batch_select_indices(torch.tensor([0.7, 1.2])), "indices: torch.float32 values"),
        (lambda: cache.batch_select_indices([0.5]), r"indices holds \[0\.5\]"),
        (lambda: cache.batch_select_indices(torch.tensor([0, 5])), r"indices holds? \[5\].*\[-2, 2\)"),
        (lambda: cache.batch_select_indices(torch.tensor([True])), "boolean mask of 1 values for a cache of 2"),
        (lambda: cache.reorder_cache(torch.tensor([2, 0])), r"beam_idx holds? \[2\]"),
        (lambda: cache.reorder_cache(torch.tensor([True, False])), "beam_idx: a boolean mask"),
        (lambda: cache.batch_select_indices(torch.tensor([1, 0], dtype=torch.uint8)), r"indices: uint8 values"),
        (lambda: cache.reorder_cache(np.array([1, 0], dtype=np.uint8)), r"beam_idx: uint8 values.*\.bool\(\)"),
        (lambda: cache.batch_repeat_interleave(-1), "repeats=-1"),
        (lambda: cache.crop(2.5), r"crop\(2\.5\)"),
        (lambda: cache.has_previous_state(), "linear-attention"),
        # transformers' linear-attention and indexer methods (an IndexError of the empty `layers`)
        (lambda: cache.get_conv_state(0), "get_conv_state applies to linear-attention"),
        (lambda: cache.get_recurrent_state(0), "get_recurrent_state applies to linear-attention"),
        (lambda: cache.update_conv_state(torch.zeros(1), 0), "update_conv_state applies to linear-attention"),
        (lambda: cache.update_recurrent_state(torch.zeros(1), 0), "update_recurrent_state applies to linear"),
        (lambda: cache.update_indexer(torch.zeros(1), 0), "update_indexer applies to indexed attention"),
        (lambda: PagedLoopCache(model), "layout: a OuroForCausalLM.*model.kv_layout"),
        (lambda: PagedLoopCache(model.kv_layout, page_size=2.5), "page_size=2.5"),
        (lambda: PagedLoopCache(model.kv_layout, page_size="16"), "page_size='16'"),
        (lambda: PagedLoopCache(model.kv_layout, page_size=True), "page_size=True"),
        (lambda: PagedLoopCache(model.kv_layout, max_pages=0), "max_pages=0"),
        # (-1 made get_seq_length() -1; a plane past the layout raised an IndexError)
        (lambda: cache.set_columns(-1, [0]), r"count=-1 must be an integer >= 0"),
        (lambda: cache.set_columns(3, [cache.num_planes]), rf"plane={cache.num_planes} is no loop depth"),
    ]:
        with pytest.raises(ValueError, match=match):
            call()
    with pytest.raises(NotImplementedError, match="allocates its page pool at its first write"):  # (named 0 layers)
        cache.early_initialization(1, 2, 8, torch.float32, "cpu")
    assert repr(cache) == before  # nothing refused changed it
    columns = cache.get_seq_length()
    cache.crop(torch.tensor(-2))
    assert cache.get_seq_length() == columns - 2 and type(cache.get_seq_length()) is int


@pytest.mark.parametrize("kind", ["paged", "dynamic"])
@pytest.mark.parametrize("mode", ["plain", PIPELINE, "auto"])
def test_a_cache_of_another_dtype_is_refused_and_kept(mode, kind):
    """A cache filled in fp32 continued by the same model in bf16: a `ValueError` naming the cache, its class and
    both dtypes in every mode (plain raised torch's index_put dtype error on a PagedLoopCache and SDPA's on a
    DynamicCache; pipeline silently mixed dtypes, then named the PagedLoopCache it had made of a DynamicCache), the
    cache unchanged."""
    model, vocab, _ = ouro_case()
    ids, mask = left_pad(random_prompts(13, [4, 6], vocab))
    cache = PagedLoopCache(model.kv_layout) if kind == "paged" else DynamicCache()
    out = generate(model, ids, mask, 3, "plain", None, cache=cache).sequences
    before = repr(cache) if kind == "paged" else [layer.keys.clone() for layer in cache.layers]
    half = tiny_spec_model(61, 4, vocab=64, damp=0.3).to(torch.bfloat16)
    whole = torch.cat([out, torch.tensor([[5], [6]])], 1)
    name = {"paged": "PagedLoopCache", "dynamic": "DynamicCache"}[kind]
    whole_mask = torch.cat([mask, torch.ones(2, 4, dtype=mask.dtype)], 1)
    with pytest.raises(ValueError, match=rf"cache: the {name} holds torch.float32 KV on cpu, but the model computes "
                                         r"in torch.bfloat16"):
        if mode == "auto":
            generate_dict(half, whole, whole_mask, 2, eos_token_id=None, cache=cache, speculative_mode="auto")
        else:
            generate(half, whole, whole_mask, 2, mode, None, cache=cache)
    if kind == "paged":
        assert repr(cache) == before
    else:
        assert all(torch.equal(layer.keys, keys) for layer, keys in zip(cache.layers, before))


@pytest.mark.parametrize("mode", [PIPELINE, BLOCK])
def test_a_static_cache_implementation_is_said_not_to_apply(mode, monkeypatch):
    """`cache_implementation="static"` with a speculative mode: the KV goes to a PagedLoopCache (tokens of plain
    decoding) and a warning says the setting does not apply (it was dropped without a word)."""
    model, vocab, _ = ouro_case()
    ids, mask = left_pad(random_prompts(14, [4, 6], vocab))
    warned = []
    monkeypatch.setattr(mixin.logger, "warning_once", lambda message, *args: warned.append(message % args))
    out = generate(model, ids, mask, FIRST, mode, None, cache_implementation="static")
    assert isinstance(out.cache, PagedLoopCache)
    assert torch.equal(out.sequences, generate(model, ids, mask, FIRST, "plain", None).sequences)
    assert any("cache_implementation='static' does not apply" in message for message in warned)


@pytest.mark.parametrize("share", ["repeat", "select", "fork"])
@pytest.mark.parametrize("mode", [PIPELINE, BLOCK])
def test_debug_checks_accept_sequences_that_share_pages(share, mode):
    """`debug=True` after a beam-like expansion (`batch_repeat_interleave`, a repeated index) or a `fork`: both
    sequences share the first turn's pages; each continuation reads its own history and gives plain decoding's
    tokens (the lineage tags of one overwrote the other's in the shared pages: a false I1 violation)."""
    model, vocab, _ = ouro_case()
    ids, mask = left_pad(random_prompts(7, [5], vocab))
    cache = PagedLoopCache(model.kv_layout, debug=True)
    first = generate(model, ids, mask, FIRST, "plain", None, cache=cache).sequences
    {"repeat": lambda: cache.batch_repeat_interleave(2), "select": lambda: cache.batch_select_indices([0, 0]),
     "fork": lambda: cache.fork(0)}[share]()
    full = torch.cat([mask, torch.ones(1, FIRST, dtype=mask.dtype)], 1)
    whole, whole_mask = extend(torch.cat([first, first]), torch.cat([full, full]), random_prompts(5, [2, 3], vocab))
    expected = torch.cat([generate(model, whole[r:r + 1], whole_mask[r:r + 1], SECOND, "plain", None).sequences
                          for r in range(2)])
    assert torch.equal(generate(model, whole, whole_mask, SECOND, mode, None, cache=cache).sequences, expected)


@pytest.mark.parametrize("empty", [lambda c: c.reset(), lambda c: c.batch_repeat_interleave(0),
                                   lambda c: c.batch_select_indices(torch.tensor([False, False]))])
def test_a_cache_emptied_by_selection_starts_afresh(empty):
    """Selecting no sequence empties the cache as `reset()` does: no consumed columns, and the next call (any batch
    size) decodes from scratch, as on a `DynamicCache` emptied the same way; in another dtype too (the emptied
    cache kept its float32 pool, and refused a bfloat16 model as holding float32 KV)."""
    model, vocab, _ = ouro_case()
    ids, mask = left_pad(random_prompts(8, [6, 3], vocab))
    cache = PagedLoopCache(model.kv_layout)
    generate(model, ids, mask, FIRST, "plain", None, cache=cache)
    empty(cache)
    assert cache.get_seq_length() == 0 and cache.num_sequences == 0 and not cache.is_initialized
    ids, mask = left_pad(random_prompts(9, [4, 2, 5], vocab))
    expected = generate(model, ids, mask, SECOND, "plain", None).sequences
    assert torch.equal(generate(model, ids, mask, SECOND, PIPELINE, None, cache=cache).sequences, expected)
    cache.reset()
    half = copy.deepcopy(model).to(torch.bfloat16)
    expected = generate(half, ids, mask, SECOND, "plain", None).sequences
    assert torch.equal(generate(half, ids, mask, SECOND, "plain", None, cache=cache).sequences, expected)


@pytest.mark.parametrize("mode", ["plain", PIPELINE])
def test_a_call_on_a_cache_with_an_open_branch_names_the_branch(mode):
    """A branch's slot counts among the cache's sequences but is none of the batch's: a call refuses the cache
    naming the open branch and how to close it (it blamed the batch size)."""
    model, vocab, _ = ouro_case()
    ids, mask = left_pad(random_prompts(12, [4, 6, 5], vocab))
    cache = PagedLoopCache(model.kv_layout)
    first = generate(model, ids, mask, 3, "plain", None, cache=cache).sequences
    cache.branches.open(0, 3)
    full = torch.cat([mask, torch.ones(3, 3, dtype=mask.dtype)], 1)
    with pytest.raises(ValueError, match=r"open branch\(es\).*close_all"):
        generate(model, first, full, 2, mode, None, cache=cache)


@pytest.mark.parametrize("mode", ["plain", "auto", PIPELINE, BLOCK])
def test_an_encoder_decoder_cache_is_refused_naming_it(mode):
    """An `EncoderDecoderCache` (a transformers cache without a list of layers) raised AttributeError in plain and
    auto decoding and in `forward`; every mode refuses it naming the cache class."""
    model, vocab, _ = ouro_case()
    ids, mask = left_pad(random_prompts(13, [5, 2], vocab))
    with pytest.raises(ValueError, match="EncoderDecoderCache"):
        generate_dict(model, ids, mask, SECOND, cache=EncoderDecoderCache(DynamicCache(), DynamicCache()),
                      **MODES.get(mode, {"speculative_mode": mode}))
    with pytest.raises(ValueError, match="cache is an instance of EncoderDecoderCache"):
        model(ids, attention_mask=mask, cache=EncoderDecoderCache(DynamicCache(), DynamicCache()))


@pytest.mark.parametrize("mode", ["plain", PIPELINE, BLOCK])
def test_a_dynamic_cache_of_fixed_layers_continues_like_plain_decoding(mode):
    """`DynamicCache(config=...)` (transformers' fixed layers, from the config's layer types): one sized by the
    model's config is refused before any work in every mode (speculative runs raised IndexError after decoding, as
    the run's KV went back into it); one with a layer per (plane, layer) gets plain decoding's tokens and KV."""
    model, vocab, _ = ouro_case()
    ids, mask = left_pad(random_prompts(13, [5, 2, 4], vocab))
    with pytest.raises(ValueError, match="cache has 2 layers"):
        generate(model, ids, mask, SECOND, mode, None, cache=DynamicCache(config=model.config))
    config = model.config.__class__(**model.config.to_dict())
    config.num_hidden_layers = len(config.layer_types) * model.kv_layout.num_planes
    config.layer_types = config.layer_types * model.kv_layout.num_planes
    cache, reference = DynamicCache(config=config), DynamicCache()
    out = generate(model, ids, mask, SECOND, mode, None, cache=cache)
    assert torch.equal(out.sequences, generate(model, ids, mask, SECOND, "plain", None, cache=reference).sequences)
    real = torch.cat([mask, torch.ones(len(mask), SECOND, dtype=mask.dtype)], 1).bool()  # [B, columns + 1]
    for layer in range(len(reference.layers)):  # every plane plain decoding wrote, at its real columns
        keys, expected = (c.layers[layer].keys.transpose(1, 2) for c in (cache, reference))  # [B, C, Hkv, D]
        assert keys.shape == expected.shape
        kept, wanted = keys[real[:, :keys.shape[1]]], expected[real[:, :keys.shape[1]]]
        # the same layers over other row groupings: rounding of the whole model's depth (`tolerances`)
        torch.testing.assert_close(kept, wanted, **fp32_tolerance(**ouro_depth(model.config), scale=rms(wanted)))


@pytest.mark.parametrize("first,second", [("plain", PIPELINE), (BLOCK, "plain"), (PIPELINE, BLOCK)])
def test_cropping_a_turn_returns_the_cache_to_the_turn_before(case, first, second):
    """After two turns whose second is padded in the middle (`extend`), `crop(-n)` for every n leaves each plane
    holding, per row, exactly the real tokens of the columns that remain (the mask's count, an independent account;
    before, every cut column was taken to be a real token of every row, so rows lost tokens of the first turn; and
    of a forked row's copy, or a sequence a fork was committed into).
    Cropping the second turn's columns and continuing with another suffix equals a plain call without a cache."""
    model, settings, ids, mask, eos, suffixes = case
    cache = paged_cache(model, debug=True, num_steps=settings.get("num_steps"))
    out = generate(model, ids, mask, FIRST, first, eos, cache, **settings)
    turn1 = cache.get_seq_length()
    full, full_mask = extend(out.sequences, mask, suffixes)
    got = generate(model, full, full_mask, SECOND, second, eos, cache, **settings).sequences
    whole = torch.cat([full_mask, full_mask.new_ones(len(full), got.shape[1] - full.shape[1])], dim=1)
    edits = {(0, 1, 2): lambda c: c.batch_select_indices(torch.tensor([0, 1, 2])),  # rows -> the edit that gives them
             (2, 0, 0): lambda c: c.batch_select_indices(torch.tensor([2, 0, 0])),
             (0, 1, 2, 2): lambda c: c.fork(2),  # into a fourth slot
             (2, 1, 2): lambda c: (c.fork(2), c.commit(3, into=0), c.batch_select_indices(torch.tensor([0, 1, 2])))}
    for keep, (order, edit) in itertools.product(range(cache.get_seq_length() + 1), edits.items()):
        cropped = copy.deepcopy(cache)  # the padding record follows the sequences, selected, forked or committed
        edit(cropped)
        cropped.crop(keep - cache.get_seq_length())
        assert cropped.get_seq_length() == keep
        for plane in range(cache.num_planes):
            columns = cropped.columns(plane)
            assert columns == min(keep, cache.columns(plane)), (keep, plane)
            assert cropped.lengths(plane) == whole[list(order), :columns].sum(-1).tolist(), (keep, order, plane)
    cache.crop(turn1 - cache.get_seq_length())
    again, again_mask = extend(out.sequences, mask, random_prompts(9, [1, 3, 2], full.max().item() + 1))
    expected = generate(model, again, again_mask, SECOND, "plain", eos, DynamicCache(), **settings).sequences
    assert generate(model, again, again_mask, SECOND, second, eos, cache, **settings).sequences.tolist() \
        == expected.tolist()


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_a_forward_that_runs_out_of_pages_leaves_the_cache_as_it_was(family):
    """A one-token `forward` on a fixed-capacity cache with room for its first plane only raises
    `CacheCapacityError`; the planes it wrote are rolled back (before, plane 0 kept the new token and no later call
    could continue the cache), and with the capacity raised the same step gives the uncached forward's logits."""
    model, vocab, settings = {"ouro": ouro_case, "huginn": huginn_case}[family]()
    ids, mask = left_pad(random_prompts(10, [4, 4, 4], vocab))
    with torch.no_grad(), model.recurrence(**settings) if settings else contextlib.nullcontext():
        cache = PagedLoopCache(model.kv_layout, page_size=4)
        model(ids, attention_mask=mask, cache=cache)  # every table holds one full page
        held, used = [cache.lengths(plane) for plane in range(cache.num_planes)], cache.pages_in_use
        cache.max_pages = used + len(ids)  # room for one more plane's pages
        step, step_mask = torch.tensor([[5], [6], [7]]), torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1)
        with pytest.raises(hf_loopspec.CacheCapacityError):
            model(step, attention_mask=step_mask, cache=cache)
        assert [cache.lengths(plane) for plane in range(cache.num_planes)] == held
        assert cache.pages_in_use == used and cache.get_seq_length() == ids.shape[1]
        cache.max_pages = None
        logits = model(step, attention_mask=step_mask, cache=cache).logits[:, -1]
        expected = model(torch.cat([ids, step], 1), attention_mask=step_mask, use_cache=False).logits[:, -1]
    assert_fp32_close(logits, expected, **_depth(model, family, settings))  # cached vs full forward (tolerances.py)


@pytest.mark.parametrize("family", ["ouro", "huginn"])
@pytest.mark.parametrize("kind", ["dynamic", "paged"])
@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_a_forward_given_a_cache_and_use_cache_false_raises_and_leaves_it(family, kind, name):
    """`forward(..., cache, use_cache=False)` raises `ValueError` naming the argument, as `generate` does (before, it
    wrote the call's columns into the cache and returned no cache); the cache stays empty."""
    model, vocab, settings = {"ouro": ouro_case, "huginn": huginn_case}[family]()
    ids, mask = left_pad(random_prompts(11, [4, 3], vocab))
    cache = DynamicCache() if kind == "dynamic" else PagedLoopCache(model.kv_layout)
    with torch.no_grad(), model.recurrence(**settings) if settings else contextlib.nullcontext():
        with pytest.raises(ValueError, match=f"{name}: a cache given to a forward call with use_cache=False"):
            model(ids, attention_mask=mask, use_cache=False, **{name: cache})
        assert cache.get_seq_length() == 0
        assert model(ids, attention_mask=mask, use_cache=False).past_key_values is None


@pytest.mark.parametrize("family", ["ouro", "huginn"])
@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_an_interrupted_forward_leaves_a_dense_cache_as_it_was(family, kind):
    """A step interrupted in its second loop (Ctrl-C from a hook) after its first wrote a plane: every layer is cut
    back, a static cache's length counter too (a retry then gave other logits), and the retried step gives the
    uncached forward's logits. A first forward interrupted on a fresh cache leaves it empty (a `DynamicCache` for any
    batch size; a static one keeps the buffers of its first batch)."""
    model, vocab, settings = {"ouro": ouro_case, "huginn": huginn_case}[family]()
    ids, mask = left_pad(random_prompts(10, [4, 4], vocab))
    step, step_mask = torch.tensor([[5], [6]]), torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
    core = model.model.layers[0] if family == "ouro" else model.transformer.core_block[0]
    calls = []

    def interrupt_second_loop(module, args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt

    with torch.no_grad(), model.recurrence(**settings) if settings else contextlib.nullcontext():
        def fresh():
            return DynamicCache() if kind == "dynamic" else looped_static_cache(model.config, model.kv_layout, 32)

        cache = fresh()
        model(ids, attention_mask=mask, cache=cache)
        held = [int(layer.get_seq_length()) for layer in cache.layers]
        handle = core.register_forward_pre_hook(interrupt_second_loop)
        with pytest.raises(KeyboardInterrupt):
            model(step, attention_mask=step_mask, cache=cache)
        assert [int(layer.get_seq_length()) for layer in cache.layers] == held
        calls.clear()
        empty = fresh()
        with pytest.raises(KeyboardInterrupt):
            model(ids, attention_mask=mask, cache=empty)
        handle.remove()
        logits = model(step, attention_mask=step_mask, cache=cache).logits[:, -1]
        expected = model(torch.cat([ids, step], 1), attention_mask=step_mask, use_cache=False).logits[:, -1]
        assert int(empty.get_seq_length()) == 0
        rows = 1 if kind == "dynamic" else 2  # (a dynamic cache takes another batch size than before)
        again = model(ids[:rows], attention_mask=mask[:rows], cache=empty).logits
        assert_fp32_close(again, model(ids[:rows], attention_mask=mask[:rows], use_cache=False).logits,
                          **_depth(model, family, settings))
    assert_fp32_close(logits, expected, **_depth(model, family, settings))  # cached vs full forward (tolerances.py)


def _depth(model, family, settings):
    return ouro_depth(model.config) if family == "ouro" else huginn_depth(model.config, settings["num_steps"])


@pytest.mark.parametrize("mode", list(MODES) + ["auto"])
@pytest.mark.parametrize("kind", ["paged", "dynamic"])
def test_a_cache_given_with_use_cache_false_is_refused(mode, kind):
    """`use_cache=False` decodes without a cache: a cache given as well raised a deep mask error (plain decoding),
    or was left holding the run's KV with no columns consumed, so that the next call on it raised (speculative). It
    raises a `ValueError` naming the argument, and the cache stays empty."""
    model, vocab, _ = ouro_case()
    ids, mask = left_pad(random_prompts(11, [5, 2], vocab))
    cache = PagedLoopCache(model.kv_layout) if kind == "paged" else DynamicCache()
    settings = {"speculative_mode": "auto"} if mode == "auto" else MODES[mode]
    for name in ("cache", "past_key_values"):
        with pytest.raises(ValueError, match=rf"^{name}: .*use_cache=False"):
            generate_dict(model, ids, mask, 4, use_cache=False, **{name: cache}, **settings)
        assert cache.get_seq_length() == 0
    plain_tokens = generate(model, ids, mask, 4, "plain", None).sequences
    assert torch.equal(generate(model, ids, mask, 4, mode if mode != "auto" else "plain", None, cache).sequences,
                       plain_tokens)
