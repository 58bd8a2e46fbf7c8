"""`speculative_mode="auto"`: segments of plain / block / pipeline decoding chosen from a cost table and the observed
acceptance (`hf_loopspec.generation.auto`).

Every test injects a fixed cost table (`auto_costs.set_costs`) and a short policy (`auto_policy.set_policy`), so the
choice is deterministic and nothing is timed; forced draft patterns (`draft_hook`) make the acceptance, and so the
choice, change. References are independent of auto: plain greedy decoding (tokens, counts and the KV cache), the
cost model evaluated by hand, and for sampling the same chain of fixed-mode `generate` calls, seeded alike.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import logging
import os
import re
import sys
import threading
import time
import warnings
import weakref
from dataclasses import replace

import filelock
import pytest
import torch
import transformers.generation.utils as generation_utils
from huginn_utils import tiny_huginn
from inputs import left_pad, random_prompts
from speculative_utils import (
    PAD,
    assert_cache_matches_ar,
    assert_counter_invariants,
    first_new_occurrence,
    forcing_hook,
    generate_dict,
    generated_counts,
    plain,
    tiny_spec_model,
)
from tolerances import ouro_depth
from transformers import (
    DynamicCache,
    EosTokenCriteria,
    GenerationConfig,
    GenerationMixin,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)

from hf_loopspec import CacheCapacityError, PagedLoopCache
from hf_loopspec.bench import args as bench_args
from hf_loopspec.bench.args import parse_modes
from hf_loopspec.bench.main import run_bench
from hf_loopspec.cache.convert import to_paged
from hf_loopspec.generation import auto_cache, auto_policy
from hf_loopspec.generation.auto import candidates
from hf_loopspec.generation.auto_calibration import costs_for
from hf_loopspec.generation.auto_costs import Candidate, CostTable, observe, set_costs
from hf_loopspec.generation.auto_policy import AutoPolicy, acceptance_settings, forget, set_policy
from hf_loopspec.generation.config import merged_config
from hf_loopspec.generation.mixin import looped_static_cache
from hf_loopspec.prompting import generate_kwargs

VOCAB, NEW = 64, 48
PIPE1, PIPE2, BLOCK = Candidate("pipeline", 1), Candidate("pipeline", 2), Candidate("block", 1, 4)
# one plain step costs 4 units and an engine cycle 2: pipeline(d=1) wins 2x at acceptance 1, breaks even at 2/3
# (speed-up 2 / (4 - 3a)); pipeline(d=2) never beats plain (1 / (2 - a)); block(d=1, K=4) at most 1.25x
SPECULATIVE_WINS = CostTable(4.0, {PIPE1: 2.0, PIPE2: 2.0, BLOCK: 2.0})
PLAIN_WINS = CostTable(1.0, {PIPE1: 5.0, PIPE2: 5.0, BLOCK: 5.0})  # no setting beats plain even at acceptance 1
POLICY = AutoPolicy(interval=6, max_interval=12, probe_tokens=4, reprobe_after=1, min_verified=2)


@pytest.fixture(scope="module")
def case():
    model = tiny_spec_model(5, vocab=VOCAB, damp=0.3)
    prompts = random_prompts(5, [5, 3], VOCAB)
    ids, mask = left_pad(prompts)
    ref = plain(model, ids, mask, NEW)
    reference = [row[m.bool()].tolist() for row, m in zip(ref.sequences, torch.cat(
        [mask, torch.ones(len(ids), NEW, dtype=mask.dtype)], 1))]
    return model, prompts, ids, mask, ref, reference


@pytest.fixture(autouse=True)
def fixed_costs(case):
    model = case[0]
    set_policy(model, POLICY)
    forget(model)  # what another test's calls stored for the same weights (the session's cache folder)
    yield
    forget(model)
    set_costs(model, None)
    set_policy(model, None)


def accept_outside(low: int, high: int):
    """Drafts of generated tokens i with low <= i < high are wrong, the others right."""
    return lambda seq, i: not low <= i < high


def test_choice_follows_forced_acceptance(case):
    """Right drafts, then wrong ones from token 12 to 30, then right ones: auto probes pipeline(d=1), keeps it,
    falls back to plain once the rejections show, probes again and returns to pipeline when drafts are right again;
    the tokens equal plain decoding's, and the reported speed-ups are the cost model's at the reported acceptance."""
    model, prompts, ids, mask, ref, reference = case
    set_costs(model, SPECULATIVE_WINS)
    hook = forcing_hook(reference, [len(p) for p in prompts], accept_outside(12, 30), VOCAB)
    start = time.perf_counter()
    out = generate_dict(model, ids, mask, NEW, speculative_mode="auto", draft_hook=hook)
    wall = time.perf_counter() - start
    assert torch.equal(out.sequences, ref.sequences)
    stats, choices = out.speculation, out.speculation.choices
    # each stretch's seconds are its own generate call's, timed inside this one
    assert all(c.seconds > 0 for c in choices) and sum(c.seconds for c in choices) <= wall
    assert (choices[0].mode, choices[0].draft_loops, choices[0].reason) == ("pipeline", 1, "probe")
    starts = [c.at_token for c in choices]
    assert starts == [0] + [sum(c.tokens for c in choices[:i]) for i in range(1, len(choices))]
    assert sum(c.tokens for c in choices) == NEW
    modes = [(c.mode, c.at_token) for c in choices]
    first_plain = next(at for mode, at in modes if mode == "plain")
    assert 12 <= first_plain <= 30, modes  # the rejections were noticed within the wrong stretch
    assert any(mode == "pipeline" and at >= 30 for mode, at in modes), modes  # and their end too
    assert stats.switches == [b.at_token for a, b in zip(choices, choices[1:]) if (a.mode, a.draft_loops,
                              a.num_speculative_tokens) != (b.mode, b.draft_loops, b.num_speculative_tokens)]
    for choice in choices[1:]:
        a = choice.acceptance
        assert choice.speedups["pipeline(d=1)"] == pytest.approx(2 / (4 - 3 * a), abs=1e-3)
        tokens_per_round = sum(a ** i for i in range(5))
        assert choice.speedups["block(d=1,K=4)"] == pytest.approx(tokens_per_round / 4, abs=1e-3)
    assert stats.plain_tokens == sum(c.tokens for c in choices if c.mode == "plain")
    assert_counter_invariants(stats, [NEW] * len(ids))


def test_a_calls_none_clears_its_configs_setting_in_every_stretch(case):
    """`min_new_tokens=None`, `min_length=None` (or 0) or `pad_token_id=None` of the call clears a passed generation
    config's value, as in plain decoding; auto's stretches read the config's value again (transformers fills a
    config's None from the model's generation config): the minimum held back an EOS, and a finished row was padded
    with the config's pad id instead of the EOS (plain decoding's pad without one)."""
    model, prompts, ids, mask, ref, reference = case
    set_costs(model, SPECULATIVE_WINS)
    # row 0 stops at its second or third new token, and row 1 goes on (the token is none of its own)
    eos = next(t for t in reference[0][len(prompts[0]) + 1:len(prompts[0]) + 3] if t not in reference[1])
    for config, cleared in ((GenerationConfig(min_new_tokens=5, eos_token_id=eos, pad_token_id=0),
                             {"min_new_tokens": None}),
                            (GenerationConfig(min_length=ids.shape[1] + 5, eos_token_id=eos, pad_token_id=0),
                             {"min_length": None}),
                            (GenerationConfig(min_length=ids.shape[1] + 5, eos_token_id=eos, pad_token_id=0),
                             {"min_length": 0}),
                            (GenerationConfig(eos_token_id=eos, pad_token_id=7), {"pad_token_id": None})):
        want, got = (model.generate(ids, attention_mask=mask, generation_config=config, max_new_tokens=NEW,
                                    do_sample=False, speculative_mode=mode, **cleared) for mode in (None, "auto"))
        new = want[0, ids.shape[1]:].tolist()
        stop, pad = new.index(eos), eos if "pad_token_id" in cleared else config.pad_token_id
        assert stop < 3 and set(new[stop + 1:]) == {pad}  # (cleared: no minimum; no pad id, the EOS's)
        assert want.shape[1] == ids.shape[1] + NEW and torch.equal(got, want), cleared


@pytest.mark.parametrize("key, value", [("second_draft_loops", 3), ("second_draft_loops", 1),
                                        ("speculative_engine", "bogus")])
def test_a_calls_none_clears_a_speculative_setting_of_the_models_config(case, key, value):
    """A call's `second_draft_loops=None` or `speculative_engine=None` clears the model's generation config's value, as
    in the fixed modes: auto's stretches read it again (second proposals auto says it never makes; or a refusal of
    the cleared value, whose message offered None as the fix)."""
    model, prompts, ids, mask, ref, reference = case
    set_costs(model, SPECULATIVE_WINS)
    saved = getattr(model.generation_config, key, None)
    setattr(model.generation_config, key, value)
    try:
        out = generate_dict(model, ids, mask, NEW, speculative_mode="auto", **{key: None})
    finally:
        setattr(model.generation_config, key, saved)
    assert torch.equal(out.sequences, ref.sequences) and out.speculation.second_drafts == 0


def test_plain_when_no_setting_can_win(case):
    """A cost table under which no speculative setting beats plain even at acceptance 1: one plain segment for
    the whole call, and no draft is ever made (the hook is never called)."""
    model, prompts, ids, mask, ref, reference = case
    set_costs(model, PLAIN_WINS)
    calls = []
    hook = forcing_hook(reference, [len(p) for p in prompts], accept_outside(0, 0), VOCAB, calls)
    out = generate_dict(model, ids, mask, NEW, speculative_mode="auto", draft_hook=hook)
    assert torch.equal(out.sequences, ref.sequences)
    [choice] = out.speculation.choices
    assert (choice.mode, choice.reason, choice.tokens, choice.acceptance) == ("plain", "costs", NEW, None)
    assert calls == [] and out.speculation.drafted == 0
    assert out.speculation.core_calls == model.num_loops * NEW


@pytest.mark.parametrize("setting, processor", [({"no_repeat_ngram_size": 2}, "NoRepeatNGramLogitsProcessor"),
                                                ({"bad_words_ids": [[9]]}, "NoBadWordsLogitsProcessor")])
@pytest.mark.parametrize("costs", ["plain wins", "speculation wins"])
def test_compile_core_with_a_host_processor_is_refused_whatever_auto_would_choose(case, costs, setting, processor,
                                                                                  monkeypatch):
    """`compile_core` with a logits processor the compiled step cannot run (an n-gram ban, a banned word, which
    reads the EOS tensors) is refused up front, as in the fixed modes: the same call ran plainly (compile_core
    dropped without a word) while plain won, and raised mid-call once a reprobe ran a speculative segment."""
    model, prompts, ids, mask, ref, reference = case
    set_costs(model, PLAIN_WINS if costs == "plain wins" else SPECULATIVE_WINS)
    counter = []
    monkeypatch.setattr(model, "core", lambda *args, **kwargs: counter.append(1))  # no core call may run
    with pytest.raises(ValueError, match=rf"speculative_mode='auto' cannot run logits processor {processor} with "
                                         r"compile_core .*drop compile_core"):
        generate_dict(model, ids, mask, NEW, speculative_mode="auto", compile_core=True, **setting)
    assert counter == []


def test_later_calls_start_from_observed_acceptance(case):
    """Every draft wrong: the first call probes and turns plain; the next call, knowing the acceptance, decodes
    plainly throughout on transformers' `DynamicCache` with no probe; after `reprobe_calls` such calls one probes
    again. Every call's tokens equal plain decoding's."""
    model, prompts, ids, mask, ref, reference = case
    set_costs(model, SPECULATIVE_WINS)
    set_policy(model, replace(POLICY, reprobe_calls=1))
    hook = forcing_hook(reference, [len(p) for p in prompts], accept_outside(0, NEW), VOCAB)
    runs = [generate_dict(model, ids, mask, NEW, speculative_mode="auto", draft_hook=hook) for _ in range(3)]
    assert all(torch.equal(out.sequences, ref.sequences) for out in runs)
    first, second, third = (out.speculation.choices for out in runs)
    assert [c.reason for c in first[:2]] == ["probe", "acceptance"] and first[1].mode == "plain"
    assert [(c.mode, c.reason, c.tokens) for c in second] == [("plain", "acceptance", NEW)]
    assert isinstance(runs[1].cache, DynamicCache) and runs[1].speculation.drafted == 0
    assert third[0].reason == "reprobe" and third[0].mode == "pipeline"


def test_a_later_process_starts_from_the_stored_acceptance(case, monkeypatch):
    """Every draft wrong: the acceptance the first call observed is stored on disk, so a later process (here: the
    process's memory cleared) decodes its first call plainly with no probe; a model of the same shape with other
    weights, or a damaged file, starts without an acceptance and probes."""
    model, prompts, ids, mask, ref, reference = case
    set_costs(model, SPECULATIVE_WINS)
    hook = forcing_hook(reference, [len(p) for p in prompts], accept_outside(0, NEW), VOCAB)
    first = generate_dict(model, ids, mask, NEW, speculative_mode="auto", draft_hook=hook)
    assert first.speculation.choices[0].reason == "probe"
    monkeypatch.setattr(auto_policy, "_MEMORY", weakref.WeakKeyDictionary())  # a new process
    later = generate_dict(model, ids, mask, NEW, speculative_mode="auto", draft_hook=hook)
    assert [(c.mode, c.reason) for c in later.speculation.choices] == [("plain", "acceptance")]
    assert torch.equal(later.sequences, ref.sequences)
    call = {"do_sample": False, "draft_hook": hook}
    settings = acceptance_settings(call, merged_config(model, call), model.num_loops)
    assert auto_policy.remembered(model, settings).rate(1, POLICY.min_verified) == 0.0  # the calls' key
    other = tiny_spec_model(6, vocab=VOCAB, damp=0.3)  # same config, other weights
    assert other.config.to_dict() == model.config.to_dict()
    assert auto_policy.remembered(other, settings) == auto_policy.Acceptance()
    path = auto_cache._path(auto_cache.acceptance_key(model), "acceptance")
    path.write_text('{"key": "damaged')
    monkeypatch.setattr(auto_policy, "_MEMORY", weakref.WeakKeyDictionary())
    assert auto_policy.remembered(model, settings) == auto_policy.Acceptance()


def test_the_stored_acceptance_is_kept_per_decoding_settings(case, monkeypatch):
    """The acceptance a call observed serves later calls with the same decoding settings only: a call with a
    repetition penalty (which changes how often drafts agree) starts without it and probes; both are stored side by
    side, so a later process still finds the first one."""
    model, prompts, ids, mask, ref, reference = case
    set_costs(model, SPECULATIVE_WINS)
    hook = forcing_hook(reference, [len(p) for p in prompts], accept_outside(0, NEW), VOCAB)
    assert generate_dict(model, ids, mask, NEW, speculative_mode="auto", draft_hook=hook).speculation.choices[
        0].reason == "probe"
    penalised = generate_dict(model, ids, mask, NEW, speculative_mode="auto", draft_hook=hook, repetition_penalty=1.3)
    assert penalised.speculation.choices[0].reason == "probe"
    assert torch.equal(penalised.sequences, plain(model, ids, mask, NEW, repetition_penalty=1.3).sequences)
    monkeypatch.setattr(auto_policy, "_MEMORY", weakref.WeakKeyDictionary())  # a new process
    later = generate_dict(model, ids, mask, NEW, speculative_mode="auto", draft_hook=hook)
    assert [(c.mode, c.reason) for c in later.speculation.choices] == [("plain", "acceptance")]


def test_only_the_most_recent_settings_are_kept(case, monkeypatch):
    """A model keeps the acceptance of its `KEPT_SETTINGS` most recently used settings: a sweep over more drops the
    oldest (on disk too), and using a setting again makes it the most recent."""
    model = case[0]
    monkeypatch.setattr(auto_policy, "KEPT_SETTINGS", 2)
    seen = auto_policy.Acceptance({1: 3.0}, {1: 8.0})
    for settings in ("a", "b", "a", "c"):  # "a" used again after "b": "b" is the oldest when "c" comes
        auto_policy.remember(model, seen, settings)
    monkeypatch.setattr(auto_policy, "_MEMORY", weakref.WeakKeyDictionary())  # a new process reads the file
    assert [auto_policy.remembered(model, k) == seen for k in ("a", "b", "c")] == [True, False, True]


def test_processes_sharing_the_folder_keep_each_others_acceptance(case, monkeypatch, tmp_path):
    """Process A read the model's file, then process B stored an entry of other settings, then A stored one: B's
    entry stays on disk (A wrote its own copy over the whole file before) and A now sees it too."""
    model = case[0]
    monkeypatch.setenv(auto_cache.CACHE_ENV, str(tmp_path))
    seen = auto_policy.Acceptance({1: 3.0}, {1: 8.0})
    process_a = weakref.WeakKeyDictionary()
    monkeypatch.setattr(auto_policy, "_MEMORY", process_a)
    auto_policy.remember(model, seen, "first")
    monkeypatch.setattr(auto_policy, "_MEMORY", weakref.WeakKeyDictionary())  # process B
    auto_policy.remember(model, seen, "second")
    monkeypatch.setattr(auto_policy, "_MEMORY", process_a)
    auto_policy.remember(model, seen, "third")
    assert auto_policy.remembered(model, "second") == seen
    monkeypatch.setattr(auto_policy, "_MEMORY", weakref.WeakKeyDictionary())  # a later process reads the file
    assert [auto_policy.remembered(model, k) == seen for k in ("first", "second", "third")] == [True] * 3


def test_a_model_cast_to_another_dtype_reads_and_stores_that_dtypes_acceptance(monkeypatch, tmp_path):
    """The acceptance is kept per model and dtype (the stored key has the dtype): after `model.to(dtype)` the same
    object used the acceptance it had seen in the old dtype, with no probe, and stored it under the new dtype's key,
    over what that dtype had observed."""
    monkeypatch.setenv(auto_cache.CACHE_ENV, str(tmp_path))
    model = tiny_spec_model(8, vocab=VOCAB)
    seen_fp32, seen_fp64 = auto_policy.Acceptance({1: 3.0}, {1: 8.0}), auto_policy.Acceptance({1: 7.0}, {1: 8.0})
    auto_policy.remember(model, seen_fp32, "s")
    model.to(torch.float64)
    assert auto_policy.remembered(model, "s") == auto_policy.Acceptance()  # nothing seen in fp64 yet
    auto_policy.remember(model, seen_fp64, "s")
    model.to(torch.float32)
    assert auto_policy.remembered(model, "s") == seen_fp32
    monkeypatch.setattr(auto_policy, "_MEMORY", weakref.WeakKeyDictionary())  # a later process reads both files
    assert auto_policy.remembered(model, "s") == seen_fp32
    assert auto_policy.remembered(model.to(torch.float64), "s") == seen_fp64


def test_forget_after_an_in_place_weight_change_files_under_the_new_weights(monkeypatch, tmp_path):
    """docs/generation.md: after changing weights in place, `forget` makes auto file what it sees under the new
    weights. The fingerprint was computed once per model object, so the new weights' acceptance went into the file
    of the weights before, which every later process loading the unchanged checkpoint then started from."""
    monkeypatch.setenv(auto_cache.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(auto_policy, "_MEMORY", weakref.WeakKeyDictionary())
    model, before = tiny_spec_model(8, vocab=VOCAB), tiny_spec_model(8, vocab=VOCAB)  # (`before`: unchanged)
    seen_before, seen_after = auto_policy.Acceptance({1: 3.0}, {1: 8.0}), auto_policy.Acceptance({1: 7.0}, {1: 8.0})
    auto_policy.remember(model, seen_before, "s")
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.01)
    forget(model)
    assert auto_policy.remembered(model, "s") == auto_policy.Acceptance()
    auto_policy.remember(model, seen_after, "s")
    monkeypatch.setattr(auto_policy, "_MEMORY", weakref.WeakKeyDictionary())  # later processes read the files
    assert auto_policy.remembered(before, "s") == seen_before
    assert auto_policy.remembered(model, "s") == seen_after


def test_forget_in_a_folder_it_cannot_write_starts_anew_and_names_the_file(monkeypatch, tmp_path, caplog):
    """The file's removal failed without a word, and the next call read it again: `forget` had no effect; nor may
    a later call's `remember`, which merges the entries other processes stored, bring the forgotten ones back."""
    monkeypatch.setenv(auto_cache.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(auto_policy, "_MEMORY", weakref.WeakKeyDictionary())
    model = tiny_spec_model(8, vocab=VOCAB)
    for settings in ("s", "t"):
        auto_policy.remember(model, auto_policy.Acceptance({1: 3.0}, {1: 8.0}), settings)
    path = auto_cache._path(auto_cache.acceptance_key(model), "acceptance")

    def refused(self, missing_ok=False):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(type(path), "unlink", refused)
    with caplog.at_level(logging.WARNING, logger="hf_loopspec"):
        forget(model)
    assert auto_policy.remembered(model, "s") == auto_policy.Acceptance()
    assert any(f"cannot remove {path} (" in record.getMessage() for record in caplog.records)
    auto_policy.remember(model, auto_policy.Acceptance({1: 5.0}, {1: 8.0}), "s")  # (a later auto call's end)
    assert auto_policy.remembered(model, "t") == auto_policy.Acceptance()


def test_a_stored_table_has_the_mode_the_umask_gives(tmp_path, monkeypatch):
    """A table is readable by whoever the umask lets read new files, as the lock file beside it: other users sharing
    the folder keep its entries (it was 0600 whatever the umask, from mkstemp, and their reads failed as if it were
    missing, so they measured again and replaced it)."""
    monkeypatch.setenv(auto_cache.CACHE_ENV, str(tmp_path))
    key = {"format": auto_cache.FORMAT, "test": "mode"}
    before = os.umask(0o022)
    try:
        auto_cache.store(key, {"entries": []})
    finally:
        os.umask(before)
    assert auto_cache._path(key).stat().st_mode & 0o777 == 0o644
    assert [p.name for p in auto_cache._path(key).parent.iterdir()] == [auto_cache._path(key).name]  # no temporary


def test_an_update_waits_for_another_holder_of_the_files_lock(tmp_path, monkeypatch):
    """While another process (here: a thread with its own lock object) holds a table's lock, reads it and writes it
    back, `auto_cache.update` waits and then changes what that one wrote; unlocked it would have read the file
    before, and the other's write would have replaced its change."""
    monkeypatch.setenv(auto_cache.CACHE_ENV, str(tmp_path))
    key = {"format": auto_cache.FORMAT, "test": "lock"}
    auto_cache.store(key, {"entries": []})
    holding = threading.Event()

    def other_process():
        with filelock.FileLock(f"{auto_cache._path(key)}.lock"):
            holding.set()
            entries = auto_cache.load(key)["entries"]
            time.sleep(0.3)
            auto_cache.store(key, {"entries": entries + ["other"]})

    worker = threading.Thread(target=other_process)
    worker.start()
    holding.wait()
    auto_cache.update(key, lambda table: {"entries": table["entries"] + ["this"]})
    worker.join()
    assert auto_cache.load(key) == {"entries": ["other", "this"]}


@pytest.mark.parametrize("entry", [
    {"accepted": {"1": 3}, "verified": {"1": 8}, "plain_calls": float("inf")},  # int(inf): OverflowError
    {"accepted": {"1": 10**400}, "verified": {"1": 10**400}, "plain_calls": 0},  # float(10**400): OverflowError
    {"accepted": {"1": 500}, "verified": {"1": 10}, "plain_calls": 0},  # more accepted than verified
    {"accepted": {"1": float("nan")}, "verified": {"1": 8}, "plain_calls": 0},
    {"accepted": {"1": 3}, "verified": {"1": float("inf")}, "plain_calls": 0},
    {"accepted": {"1": 3}, "verified": {"1": 8}, "plain_calls": -1},
])
def test_a_stored_acceptance_no_decoding_could_make_is_ignored(case, monkeypatch, entry):
    """A readable acceptance file with impossible counts (an Infinity, a 400-digit number, a NaN, more accepted
    than verified) is ignored like an unreadable one: auto starts without an acceptance and decodes plain's
    tokens (an OverflowError made every auto call fail until the file was deleted; a rate of 50 was reported)."""
    model, prompts, ids, mask, ref, reference = case
    set_costs(model, SPECULATIVE_WINS)
    settings = acceptance_settings({"do_sample": False}, merged_config(model, {"do_sample": False}), model.num_loops)
    auto_cache.store(auto_cache.acceptance_key(model), {"by_settings": {settings: entry}}, "acceptance")
    monkeypatch.setattr(auto_policy, "_MEMORY", weakref.WeakKeyDictionary())  # a new process reads the file
    assert auto_policy.remembered(model, settings) == auto_policy.Acceptance()
    out = generate_dict(model, ids, mask, NEW, speculative_mode="auto")
    assert torch.equal(out.sequences, ref.sequences) and out.speculation.choices[0].reason == "probe"


def test_threads_remembering_acceptance_on_one_model(case, monkeypatch):
    """Threads storing acceptance for different settings on one model (each auto call's end) while others read it:
    no 'dictionary changed size during iteration', and every setting's latest value is kept."""
    model = case[0]
    monkeypatch.setattr(auto_policy, "_MEMORY", weakref.WeakKeyDictionary())  # this test's entries stay its own
    monkeypatch.setattr(auto_policy, "KEPT_SETTINGS", 8)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: the unguarded dict failed most runs so
    seen = [auto_policy.Acceptance({1: float(i)}, {1: 8.0 + i}) for i in range(6)]

    def work(i):
        for round_ in range(40):
            auto_policy.remember(model, seen[i], f"settings-{i}-{round_ % 10}")
            auto_policy.remembered(model, f"settings-{(i + 1) % 6}-{round_ % 10}")

    try:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            list(pool.map(work, range(6)))  # re-raises a thread's exception
    finally:
        sys.setswitchinterval(interval)
    assert len(auto_policy._observed(model, auto_cache.acceptance_key(model))) == 8


def test_forget_during_a_remember_leaves_nothing_stored(case, monkeypatch):
    """`forget` while another thread's `remember` writes the table: the forgotten acceptance does not come back
    from disk in a later process (the write used to land after the removal)."""
    model = case[0]
    monkeypatch.setattr(auto_policy, "_MEMORY", weakref.WeakKeyDictionary())
    store, forgetting = auto_cache.store, []

    def slow_store(*args):  # a slow disk: `forget` is called while the table is being written
        forgetting.append(threading.Thread(target=forget, args=(model,)))
        forgetting[0].start()
        time.sleep(0.2)
        store(*args)

    monkeypatch.setattr(auto_cache, "store", slow_store)
    auto_policy.remember(model, auto_policy.Acceptance({1: 3.0}, {1: 8.0}), "settings")
    forgetting[0].join()
    monkeypatch.setattr(auto_policy, "_MEMORY", weakref.WeakKeyDictionary())  # a new process reads the disk
    assert auto_policy.remembered(model, "settings") == auto_policy.Acceptance()


def test_the_policy_functions_refuse_what_is_no_looped_model():
    """`forget` and `set_policy` name a model that auto never decodes, and a policy that is no `AutoPolicy` (a
    weakref TypeError or an AttributeError before, or a policy stored to fail at the next call)."""
    for bad in (None, "ByteDance/Ouro-1.4B", torch.nn.Linear(2, 2)):
        for call, args in ((forget, (bad,)), (set_policy, (bad, None))):
            with pytest.raises(ValueError, match=rf"model is {type(bad).__name__}, not a looped model of hf_loopspec"):
                call(*args)
    model = tiny_spec_model(5, vocab=VOCAB)
    with pytest.raises(ValueError, match="policy is dict; pass an AutoPolicy"):
        set_policy(model, {"margin": 0.1})


def test_a_prompt_that_fills_the_positions_is_refused_as_in_plain_decoding():
    """No max_length or max_new_tokens anywhere, and a prompt as long as the model's positions: plain decoding
    raises, and so does auto (it returned the prompt with no new token and no word)."""
    model = tiny_spec_model(3, vocab=VOCAB)
    ids = random_prompts(4, [model.config.max_position_embeddings], VOCAB)[0][None]
    assert model.generation_config.max_length is None
    for mode in (None, "auto"):
        with pytest.raises(ValueError, match="Input length of input_ids is 512"):
            model.generate(ids, speculative_mode=mode, pad_token_id=PAD)


def test_a_dynamic_cache_is_continued_and_refilled(case):
    """A call that decodes plainly throughout returns transformers' `DynamicCache`; an auto call continuing it may
    speculate (the KV moves to a `PagedLoopCache` and back, `cache.convert`): its tokens equal one plain call's, and
    the caller's `DynamicCache` object ends holding plain decoding's KV of the whole output."""
    model, _, ids, mask, ref, _ = case
    set_costs(model, PLAIN_WINS)
    half = NEW // 2
    first = generate_dict(model, ids, mask, half, speculative_mode="auto")
    assert isinstance(first.cache, DynamicCache)
    grown = torch.cat([mask, torch.ones(len(ids), half, dtype=mask.dtype)], 1)
    set_costs(model, SPECULATIVE_WINS)
    second = generate_dict(model, first.sequences, grown, NEW - half, speculative_mode="auto", cache=first.cache)
    assert second.speculation.choices[0].mode == "pipeline"
    assert torch.equal(second.sequences, ref.sequences)
    assert second.cache is first.cache
    full = torch.cat([mask, torch.ones(len(ids), NEW, dtype=mask.dtype)], 1)
    assert_cache_matches_ar(to_paged(second.cache, model.kv_layout, full), ref.cache, mask, [NEW] * len(ids),
                            model.config.num_hidden_layers, model_depth=ouro_depth(model.config))


def test_a_huginn_dynamic_cache_is_continued_speculatively():
    """Huginn too (entry and exit planes, the draft depth's exit plane missing from plain decoding's cache): an auto
    call continuing the `DynamicCache` of a plain call speculates, and the two calls' tokens equal one plain call's
    (seeded initial states: every decoder draws the same state per token)."""
    model, _ = tiny_huginn(seed=3, damp=0.3)
    forget(model)  # what other tests' auto calls stored for the same weights (the session's cache folder)
    settings = {"num_steps": 4, "init_scale": 1.0, "init_seed": 77}
    ids, mask = left_pad(random_prompts(3, [4, 6], model.config.vocab_size))
    ref = plain(model, ids, mask, 16, **settings)
    first = plain(model, ids, mask, 8, **settings)
    grown = torch.cat([mask, torch.ones_like(mask[:, :1]).expand(-1, 8)], 1)
    set_costs(model, CostTable(4.0, dict.fromkeys(candidates(4, None, None)[1:], 2.0)))
    set_policy(model, POLICY)
    try:
        second = generate_dict(model, first.sequences, grown, 8, speculative_mode="auto", cache=first.cache,
                               **settings)
    finally:
        set_costs(model, None)
        set_policy(model, None)
        forget(model)
    assert second.speculation.choices[0].mode == "pipeline" and second.cache is first.cache
    assert torch.equal(second.sequences, ref.sequences)


@pytest.mark.parametrize("kind", ["huginn", "huginn-paged", "huginn-no-entry-exit", "ouro"])
def test_a_cache_filled_at_fewer_loops_is_refused_alike_by_every_decoder(kind):
    """A cache filled at fewer loops (Huginn: 4 recurrence steps, continued at 6; Ouro: `total_ut_steps` 2, then 4)
    is refused with one message by plain decoding, pipeline and auto whichever decoder auto picks (auto's choice
    depends on remembered acceptance and timed costs): a plain call's forward and the engine each found the
    mismatch at another plane, the engine's message naming the PagedLoopCache it had made of the caller's
    DynamicCache. Also without Huginn's entry and exit planes (a prelude and coda of no layers), as Ouro."""
    if kind == "ouro":
        model, fill, more = tiny_spec_model(5, vocab=VOCAB, damp=0.3), {}, {}
    else:
        layers = {"n_layers_in_prelude": 0, "n_layers_in_coda": 0} if kind == "huginn-no-entry-exit" else {}
        model = tiny_huginn(seed=3, damp=0.3, **layers)[0]
        fill, more = {"num_steps": 4, "init_seed": 7}, {"num_steps": 6, "init_seed": 7}
    forget(model)
    ids, mask = left_pad(random_prompts(3, [4, 6], model.config.vocab_size))
    grown = torch.cat([mask, torch.ones_like(mask[:, :1]).expand(-1, 5)], 1)
    messages = []
    for mode, costs in [(None, None), ("pipeline", None), ("auto", PLAIN_WINS),
                        ("auto", CostTable(4.0, dict.fromkeys(candidates(6, None, None)[1:], 2.0)))]:
        if kind == "ouro":
            model.config.total_ut_steps = 2
        cache = PagedLoopCache(model.config.kv_layout(4)) if kind == "huginn-paged" else None
        first = plain(model, ids, mask, 5, **fill, **({"cache": cache} if cache else {}))
        if kind == "ouro":
            model.config.total_ut_steps = 6
        set_costs(model, costs)
        set_policy(model, POLICY)
        try:
            with pytest.raises(ValueError) as refused:
                generate_dict(model, first.sequences, grown, 6, speculative_mode=mode, cache=first.cache, **more)
        finally:
            set_costs(model, None)
            set_policy(model, None)
            forget(model)
        messages.append(str(refused.value))
    assert len(set(messages)) == 1, messages
    assert re.match(r"the cache passed \(cache= or past_key_values=\)"
                    r"( holds KV in \d+ layers|: the PagedLoopCache was made for)", messages[0])


@pytest.mark.parametrize("costs", ["plain", "speculative"])
def test_huginn_call_settings_win_over_the_generation_config_in_every_segment(costs):
    """The call's `num_steps` / `init_seed` win over a generation config's (docs: the call's keyword arguments
    first) in every segment of an auto call, as in the fixed modes. Each segment is a `generate` call of its own,
    which read the config again: one plain segment decoded at the config's steps and seed, and a speculative one
    raised a layout mismatch."""
    model, _ = tiny_huginn(seed=3, damp=0.3)
    forget(model)  # what other tests' auto calls stored for the same weights (the session's cache folder)
    model.generation_config.num_steps, model.generation_config.init_seed = 2, 1
    settings = {"num_steps": 4, "init_scale": 1.0, "init_seed": 2}
    ids, mask = left_pad(random_prompts(3, [4, 6], model.config.vocab_size))
    ref = plain(model, ids, mask, 12, **settings)
    assert not torch.equal(ref.sequences, plain(model, ids, mask, 12, init_scale=1.0).sequences)  # the config's
    wins = PLAIN_WINS if costs == "plain" else CostTable(4.0, dict.fromkeys(candidates(4, None, None)[1:], 2.0))
    set_costs(model, wins)
    set_policy(model, POLICY)
    try:
        out = generate_dict(model, ids, mask, 12, speculative_mode="auto", **settings)
    finally:
        set_costs(model, None)
        set_policy(model, None)
        forget(model)
    assert out.speculation.choices[0].mode == ("plain" if costs == "plain" else "pipeline")
    assert torch.equal(out.sequences, ref.sequences)


def test_another_kind_of_cache_decodes_plainly(case):
    """A `StaticCache` cannot back speculation: even where speculation would win, the call runs one plain segment
    with reason "cache-type", and its tokens equal plain decoding's."""
    model, _, ids, mask, ref, _ = case
    set_costs(model, SPECULATIVE_WINS)
    static = looped_static_cache(model.config, model.kv_layout, ids.shape[1] + NEW)
    out = generate_dict(model, ids, mask, NEW, speculative_mode="auto", cache=static)
    [choice] = out.speculation.choices
    assert (choice.mode, choice.reason, choice.tokens) == ("plain", "cache-type", NEW)
    assert out.speculation.drafted == 0 and torch.equal(out.sequences, ref.sequences)


def test_a_fixed_capacity_cache_too_small_for_a_speculative_segment_decodes_plainly(case):
    """A `PagedLoopCache` with just the pages plain decoding takes: the segments whose up-front reservation fits
    speculate, the first that would not fit and the rest of the call decode plainly (reason "capacity"), where a
    fixed pipeline call refuses, and the tokens equal plain decoding's."""
    model, prompts, ids, mask, ref, reference = case
    set_costs(model, SPECULATIVE_WINS)  # and every draft right: speculation wins wherever it fits
    hook = forcing_hook(reference, [len(p) for p in prompts], accept_outside(0, 0), VOCAB)
    sizing = PagedLoopCache(model.kv_layout, page_size=4)
    plain(model, ids, mask, NEW, cache=sizing)
    cache = PagedLoopCache(model.kv_layout, page_size=4, max_pages=sizing.pages_in_use)
    with pytest.raises(CacheCapacityError):
        generate_dict(model, ids, mask, NEW, speculative_mode="pipeline", draft_loops=1,
                      cache=PagedLoopCache(model.kv_layout, page_size=4, max_pages=sizing.pages_in_use))
    out = generate_dict(model, ids, mask, NEW, speculative_mode="auto", cache=cache, draft_hook=hook)
    reasons = [choice.reason for choice in out.speculation.choices]
    assert out.speculation.choices[0].mode == "pipeline" and reasons[-1] == "capacity", out.speculation.choices
    assert reasons.count("capacity") == 1 and torch.equal(out.sequences, ref.sequences)


def test_an_interrupted_call_leaves_the_callers_cache_as_it_was(case):
    """A streamer that raises in the third segment of an auto call continuing a `PagedLoopCache`: the cache holds
    the first turn only (not the tokens of the segments that had finished, which the caller never got), and the
    retried turn equals plain decoding."""
    model, _, ids, mask, _, _ = case
    set_costs(model, SPECULATIVE_WINS)
    cache = PagedLoopCache(model.kv_layout)
    first = generate_dict(model, ids, mask, 6, speculative_mode=None, cache=cache).sequences
    held = [cache.lengths(plane) for plane in range(cache.num_planes)], cache.get_seq_length()
    whole = torch.cat([mask, torch.ones(len(ids), 6, dtype=mask.dtype)], 1)

    class Interrupting:
        puts = 0

        def put(self, value):
            self.puts += 1
            if self.puts == 2 + POLICY.probe_tokens + POLICY.interval:  # the prompt, two segments, then one token
                raise KeyboardInterrupt

        def end(self):
            pass

    with pytest.raises(KeyboardInterrupt):
        generate_dict(model, first, whole, NEW, speculative_mode="auto", cache=cache, streamer=Interrupting())
    assert ([cache.lengths(plane) for plane in range(cache.num_planes)], cache.get_seq_length()) == held
    out = generate_dict(model, first, whole, NEW, speculative_mode="auto", cache=cache)
    assert torch.equal(out.sequences, plain(model, first, whole, NEW).sequences)


def test_the_default_length_is_new_tokens_as_in_plain_decoding(case):
    """No max_new_tokens and no max_length anywhere: transformers decodes its default length (20) as new tokens after
    the prompt, and so does auto, whatever the prompt's length (it took 20 as the output's length: fewer tokens,
    or a ValueError for a prompt of 20 columns or more)."""
    model, _, ids, mask, _, _ = case
    assert model.generation_config.max_length is None
    for width in (ids.shape[1], 24):
        prompt = torch.randint(1, VOCAB, (1, width), generator=torch.Generator().manual_seed(width))
        expected = model.generate(prompt, do_sample=False, pad_token_id=PAD, speculative_mode=None)
        assert expected.shape[1] == width + 20
        assert torch.equal(model.generate(prompt, do_sample=False, pad_token_id=PAD, speculative_mode="auto"),
                           expected)


def test_integer_tensors_are_taken_as_in_the_fixed_modes(case, tmp_path, monkeypatch):
    """0-d tensor `draft_loops` / `num_speculative_tokens` (taken by the fixed modes) decode as plain decoding (they
    raised a TypeError storing the costs, and left a stray temporary file in the cache folder)."""
    model, _, ids, mask, ref, _ = case
    monkeypatch.setenv(auto_cache.CACHE_ENV, str(tmp_path))
    set_costs(model, None)  # measured and stored, with the settings in the key
    out = generate_dict(model, ids, mask, NEW, speculative_mode="auto", draft_loops=torch.tensor(1),
                        num_speculative_tokens=torch.tensor(4))
    assert torch.equal(out.sequences, ref.sequences)
    assert not list(tmp_path.rglob("*.tmp"))


def test_right_padding_is_refused_whatever_was_stored(case):
    """A right-padded row is refused as in the fixed speculative modes, naming 'auto', before and after a call
    stored an acceptance under which auto would decode plainly (it then ran, silently, where it had raised)."""
    model, _, ids, mask, _, _ = case
    set_costs(model, PLAIN_WINS)
    right = torch.ones_like(mask)
    right[1, -2:] = 0
    for _ in range(2):
        with pytest.raises(ValueError, match=r"right padding\), which speculative_mode='auto' does not decode"):
            generate_dict(model, ids, right, 8, speculative_mode="auto")
        generate_dict(model, ids, mask, 8, speculative_mode="auto")


@pytest.mark.parametrize("fallback", [False, True], ids=["speculative", "plain-fallback"])
def test_rows_that_stop_stay_stopped(case, fallback):
    """Row 0 stops at EOS early; the later segments keep it stopped: tokens and every KV plane of the returned cache
    equal plain decoding's (which feeds the stopped row pad tokens). Its scores and logits are zeros from the step
    after its EOS, in every segment (a plain segment gave it the pad token's forced 0 / -inf scores), and the other
    row's are plain decoding's. A call that decodes plainly in one stretch (a user processor) returns plain
    decoding's own scores and logits."""
    model, prompts, ids, mask, _, reference = case
    set_costs(model, SPECULATIVE_WINS)
    first = [first_new_occurrence(r[len(p):]) for r, p in zip(reference, prompts)]
    window = range(1, 3) if fallback else range(8, 17)  # speculative: after the probe (POLICY.probe_tokens)
    eos = next(t for t, i in first[0].items() if i in window and t not in first[1])  # stops row 0 only
    outputs = dict(output_scores=True, output_logits=True, eos_token_id=eos)
    if fallback:
        outputs["logits_processor"] = LogitsProcessorList([Unvetted()])
    ref = plain(model, ids, mask, 30, **outputs)
    hook = forcing_hook(reference, [len(p) for p in prompts], accept_outside(20, 24), VOCAB)
    out = generate_dict(model, ids, mask, 30, speculative_mode="auto", draft_hook=hook, **outputs)
    assert torch.equal(out.sequences, ref.sequences)
    if fallback:  # decided before anything runs: one plain stretch
        assert [(c.mode, c.reason) for c in out.speculation.choices] == [("plain", "fallback")]
    else:
        assert len(out.speculation.choices) > 2 and out.speculation.choices[-1].reason == "stopped-rows"
        assert "plain" in {c.mode for c in out.speculation.choices} != {"plain"}
    end = first[0][eos]  # row 0's EOS is its new token number `end`
    for name in ("scores", "logits"):
        got, want = torch.stack(getattr(out, name), 1), torch.stack(getattr(ref, name), 1)  # [B, steps, V]
        assert got.shape == want.shape
        if fallback:  # one plain stretch: plain decoding's own (the Outputs item of docs/generation.md)
            assert torch.equal(got, want)
            continue
        assert not got[0, end + 1:].any()
        # fp32: the same computation in another batching order (segments, speculative rows) rounds differently
        torch.testing.assert_close(got[0, : end + 1], want[0, : end + 1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)
    if fallback:
        return
    counts = generated_counts(out.sequences, ids.shape[1], 30, eos)
    assert_counter_invariants(out.speculation, counts)
    steps = out.sequences.shape[1] - ids.shape[1]
    assert isinstance(out.cache, DynamicCache)  # the last segments decoded plainly, on transformers' cache
    paged = to_paged(out.cache, model.kv_layout, torch.cat([mask, torch.ones_like(out.sequences[:, ids.shape[1]:])], 1))
    assert_cache_matches_ar(paged, ref.cache, mask, [steps] * len(ids), model.config.num_hidden_layers,
                            model_depth=ouro_depth(model.config))


@pytest.mark.parametrize("setting", ["min_new_tokens", "min_length", "cache_implementation"])
def test_settings_of_the_whole_call_hold_across_stretches(case, setting):
    """A minimum length beyond the first stretch (the probe), given as min_new_tokens or min_length, and a
    cache_implementation: plain decoding's tokens, with no warning about the stretches' own lengths (transformers
    warns of a minimum beyond a call's maximum) and no refusal of the cache later stretches continue."""
    model, prompts, ids, mask, _, reference = case
    set_costs(model, SPECULATIVE_WINS)
    first = [first_new_occurrence(r[len(p):]) for r, p in zip(reference, prompts)]
    eos = next(t for t, i in first[0].items() if i <= 6)  # would stop row 0 within the probe
    kwargs = {"min_new_tokens": {"min_new_tokens": 20}, "min_length": {"min_length": ids.shape[1] + 20},
              "cache_implementation": {"cache_implementation": "static"}}[setting] | {"eos_token_id": eos}
    ref = generate_dict(model, ids, mask, 30, speculative_mode=None, **kwargs)  # plain, on the cache it sets up
    hook = forcing_hook(reference, [len(p) for p in prompts], accept_outside(12, 30), VOCAB)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*(Unfeasible|larger than the maximum possible length)")
        out = generate_dict(model, ids, mask, 30, speculative_mode="auto", draft_hook=hook, **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.speculation.choices) > 1 and out.speculation.choices[0].tokens < 20  # the probe, then more


def test_min_new_tokens_takes_precedence_over_min_length_as_in_plain_decoding(case):
    """transformers ignores `min_length` when `min_new_tokens` is set; auto held EOS back for the larger of the two,
    so a row plain decoding ends at its EOS went on (found by the differential soak, seed 70838)."""
    model, prompts, ids, mask, _, reference = case
    set_costs(model, SPECULATIVE_WINS)
    first = [first_new_occurrence(r[len(p):]) for r, p in zip(reference, prompts)]
    eos = next(t for t, i in first[0].items() if 3 <= i <= 6 and t not in first[1])  # row 0's, after the minimum
    kwargs = {"min_new_tokens": 2, "min_length": ids.shape[1] + 20, "eos_token_id": eos}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (transformers warns that min_new_tokens takes precedence)
        ref = generate_dict(model, ids, mask, 30, speculative_mode=None, **kwargs)
        out = generate_dict(model, ids, mask, 30, speculative_mode="auto", **kwargs)
    assert ref.sequences[0, ids.shape[1] + first[0][eos]] == eos  # plain ends row 0 there
    assert torch.equal(out.sequences, ref.sequences)


def test_a_model_min_length_brings_no_warning_of_a_min_new_tokens_the_call_did_not_pass(case, monkeypatch):
    """The stretches carry what is left of the call's minimum as a min_length: given as min_new_tokens, transformers
    warned 'Both min_new_tokens and min_length' on every auto call of a model whose generation config sets
    min_length (plain decoding gives no warning); the minimum still holds EOS back as in plain decoding."""
    model, prompts, ids, mask, _, reference = case
    set_costs(model, SPECULATIVE_WINS)
    first = [first_new_occurrence(r[len(p):]) for r, p in zip(reference, prompts)]
    eos = next(t for t, i in first[0].items() if 3 <= i <= 6)  # would stop row 0 before the minimum
    warned = []
    monkeypatch.setattr(generation_utils.logger, "warning", lambda message, *args: warned.append(message))
    monkeypatch.setattr(model.generation_config, "min_length", ids.shape[1] + 20)
    ref = generate_dict(model, ids, mask, 30, speculative_mode=None, eos_token_id=eos)
    out = generate_dict(model, ids, mask, 30, speculative_mode="auto", eos_token_id=eos)
    assert ref.sequences.shape[1] > ids.shape[1] + 20 and torch.equal(out.sequences, ref.sequences)
    assert len(out.speculation.choices) > 1  # stretches, each with its part of the minimum
    assert not [message for message in warned if "min_new_tokens" in message]


def test_sampling_equals_the_chain_of_its_choices(case):
    """Sampled: an auto call (switching as the forced pattern makes it) equals, seed for seed, the chain of
    fixed-mode `generate` calls its choices name, each continuing the previous one's cache."""
    model, prompts, ids, mask, _, _ = case
    set_costs(model, SPECULATIVE_WINS)

    def hook(seq, position, proposed):  # drafts for positions 14..25 of row 0 are wrong (a fixed token)
        return (proposed + 1) % VOCAB if seq == 0 and 14 <= position < 26 else proposed

    sampling = dict(do_sample=True, temperature=1.3, draft_hook=hook)
    torch.manual_seed(11)
    out = generate_dict(model, ids, mask, 30, speculative_mode="auto", **sampling)
    assert len({c.mode for c in out.speculation.choices}) == 2  # plain and pipeline segments both ran
    torch.manual_seed(11)
    sequences, seg_mask, cache = ids, mask, PagedLoopCache(model.kv_layout)
    for choice in out.speculation.choices:
        setting = Candidate(None if choice.mode == "plain" else choice.mode, choice.draft_loops,
                            choice.num_speculative_tokens)
        sequences = generate_dict(model, sequences, seg_mask, choice.tokens, cache=cache, **setting.kwargs(),
                                  **sampling).sequences
        seg_mask = torch.cat([seg_mask, torch.ones(len(ids), choice.tokens, dtype=mask.dtype)], 1)
    assert torch.equal(out.sequences, sequences)


def test_from_generation_config_and_saved(case, tmp_path):
    """`speculative_mode="auto"` on a `GenerationConfig` and through save_pretrained / from_pretrained."""
    model, _, ids, mask, ref, _ = case
    set_costs(model, SPECULATIVE_WINS)
    config = GenerationConfig(speculative_mode="auto", max_new_tokens=NEW, pad_token_id=PAD, do_sample=False,
                              return_dict_in_generate=True)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, generation_config=config)
    assert torch.equal(out.sequences, ref.sequences) and out.speculation.mode == "auto"
    model.generation_config.speculative_mode = "auto"
    try:
        model.save_pretrained(tmp_path)
    finally:
        model.generation_config.speculative_mode = None
    loaded = type(model).from_pretrained(tmp_path)
    assert loaded.generation_config.speculative_mode == "auto"


class StopAtLength(StoppingCriteria):
    """Stops every row once the sequences have `length` columns; records the lengths it was asked about."""

    def __init__(self, length: int):
        self.length, self.seen = length, []

    def __call__(self, input_ids, scores, **kwargs):
        self.seen.append(input_ids.shape[1])
        return torch.full((len(input_ids),), input_ids.shape[1] >= self.length, dtype=torch.bool)


class StopsRowAt(StoppingCriteria):
    """Row `row` is answered `value` (as `dtype`) once it has `new` new tokens after `width` prompt columns, the others
    0; counts its calls. Plain decoding reads any answer as `unfinished & ~answer`: 2 stops no row."""

    def __init__(self, width: int, row: int, new: int, dtype: torch.dtype, value: int = 1):
        self.width, self.row, self.new, self.dtype, self.value, self.calls = width, row, new, dtype, value, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        done = torch.zeros(input_ids.shape[0], dtype=self.dtype)
        done[self.row] = self.value * int(input_ids.shape[1] - self.width >= self.new)
        return done


class CountingEos(EosTokenCriteria):
    """A subclass of a kind transformers builds: the call's own criterion (it replaces only one of that very class),
    which may keep state; counts its calls."""

    def __init__(self, eos: int):
        super().__init__(eos)
        self.calls = 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        return super().__call__(input_ids, scores, **kwargs)


@pytest.mark.parametrize("answer", ["bool", "uint8", "int64", "int64-even", "subclass"])
def test_a_plain_stretch_counts_each_row_to_the_criterion_that_stopped_it(case, answer):
    """A call's own criterion stops row 0 early in a plain stretch; the model pads with an EOS id. Its tokens and its
    calls are plain decoding's and each row counts to its stop, as pipeline mode counts it (`RowEnds`; a review
    found a subclass of `EosTokenCriteria` called twice per step, an integer answer a crash or a row miscounted, and
    an answer of 2, which stops no row in plain decoding, counted as a stop)."""
    model, prompts, ids, mask, _, reference = case
    set_costs(model, PLAIN_WINS)
    width, stop_after = ids.shape[1], 4
    new = [r[len(p):] for r, p in zip(reference, prompts)]
    first = [first_new_occurrence(row) for row in new]
    eos = next(t for t, i in first[1].items() if 6 <= i and first[0].get(t, NEW) >= stop_after)  # stops row 1 later
    stopper = new[0][stop_after - 1]  # (subclass: an EOS criterion of row 0's fourth token)
    ends = [[stop_after] if answer in ("bool", "uint8", "int64") and b == 0 else [] for b in range(len(new))]
    if answer == "subclass":
        ends = [[i + 1 for i, t in enumerate(row) if t == stopper][:1] for row in new]
    expected = [min(end + [i + 1 for i, t in enumerate(row) if t == eos][:1] + [24]) for end, row in zip(ends, new)]
    assert (expected[0] > stop_after if answer == "int64-even" else expected[0] <= stop_after < expected[1] < 24)
    outputs = {}
    for mode in (None, "pipeline", "auto"):
        criterion = CountingEos(stopper) if answer == "subclass" else StopsRowAt(
            width, 0, stop_after, getattr(torch, answer.split("-")[0]), 2 if answer.endswith("even") else 1)
        with torch.no_grad():
            outputs[mode] = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                                           return_dict_in_generate=True, speculative_mode=mode, eos_token_id=eos,
                                           pad_token_id=eos, stopping_criteria=StoppingCriteriaList([criterion]))
        outputs[mode].calls = criterion.calls
    want, spec, auto = outputs.values()
    assert torch.equal(auto.sequences, want.sequences) and auto.calls == want.calls
    assert [c.mode for c in auto.speculation.choices] == ["plain"]
    counts = [s.committed for s in auto.speculation.per_sequence]
    assert counts == [s.committed for s in spec.speculation.per_sequence] == expected


def test_without_an_eos_id_a_row_a_criterion_stops_decodes_on_and_counts_whole(case):
    """Without an EOS id transformers pads no stopped row: row 0, which the criterion stops, decodes on until every row
    has stopped, and all its tokens are the output (pipeline counts them all). Auto counted it to the criterion's
    answer (a review of `RowEnds`)."""
    model, prompts, ids, mask, _, reference = case
    set_costs(model, PLAIN_WINS)
    outputs = {}
    for mode in (None, "pipeline", "auto"):
        criteria = StoppingCriteriaList([StopsRowAt(ids.shape[1], 0, 3, torch.bool)])
        outputs[mode] = generate_dict(model, ids, mask, 14, speculative_mode=mode, stopping_criteria=criteria)
    want, spec, auto = outputs.values()
    assert torch.equal(auto.sequences, want.sequences) and auto.sequences.shape[1] == ids.shape[1] + 14
    counts = [s.committed for s in auto.speculation.per_sequence]
    assert counts == [s.committed for s in spec.speculation.per_sequence] == [14] * len(ids)


def test_a_criterion_answering_a_column_ends_the_rows_together_as_in_plain_decoding(case):
    """A criterion answering a `[B, 1]` column (`input_ids[:, -1:] == id`), without an EOS id: plain decoding ends
    the rows together (docs/generation.md, stopping criteria). Auto's plain stretch raised an IndexError recording
    where rows stopped; it records nothing of an answer that names no row, and decodes as plain decoding."""
    model, prompts, ids, mask, _, reference = case
    set_costs(model, PLAIN_WINS)
    stopper = reference[1][len(prompts[1]) + 4]  # row 1's fifth new token

    class Column(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1:] == stopper

    want = plain(model, ids, mask, 24, stopping_criteria=StoppingCriteriaList([Column()]))
    auto = generate_dict(model, ids, mask, 24, speculative_mode="auto",
                         stopping_criteria=StoppingCriteriaList([Column()]))
    assert torch.equal(auto.sequences, want.sequences)
    new = auto.sequences.shape[1] - ids.shape[1]
    assert [s.committed for s in auto.speculation.per_sequence] == [new] * len(ids)


@pytest.mark.parametrize("setting", ["stopping_criteria", "forced_eos_token_id", "begin_suppress_tokens",
                                     "exponential_decay_length_penalty"])
def test_settings_of_the_whole_call_decode_in_one_segment(case, setting):
    """A stopping criterion, or a processor transformers measures from a call's input length or `max_length`, would
    act anew in each segment: such a call runs one segment, and its tokens (and the criterion's calls) are plain
    decoding's. The segments the same call runs without the setting show it would otherwise switch."""
    model, prompts, ids, mask, _, reference = case
    set_costs(model, SPECULATIVE_WINS)
    first = reference[0][5]  # row 0's first generated token
    values = {"stopping_criteria": lambda: StoppingCriteriaList([StopAtLength(ids.shape[1] + 20)]),
              "forced_eos_token_id": lambda: 3, "begin_suppress_tokens": lambda: [first],
              "exponential_decay_length_penalty": lambda: (4, 1.5)}
    ours, theirs = values[setting](), values[setting]()
    want = plain(model, ids, mask, NEW, eos_token_id=3, **{setting: theirs})
    out = generate_dict(model, ids, mask, NEW, speculative_mode="auto", eos_token_id=3, **{setting: ours})
    assert torch.equal(out.sequences, want.sequences)
    assert len(out.speculation.choices) == 1
    if setting == "stopping_criteria":
        assert ours[0].seen == theirs[0].seen and out.sequences.shape[1] == ids.shape[1] + 20
    forget(model)
    hook = forcing_hook(reference, [len(p) for p in prompts], accept_outside(12, NEW), VOCAB)
    assert len(generate_dict(model, ids, mask, NEW, speculative_mode="auto", draft_hook=hook).speculation.choices) > 1


def test_inputs_as_plain_decoding_takes_them(case):
    """No attention mask: the one transformers infers from the pad token; `sequence_bias` as a dict of tuples; a
    generation config without speculative keys on a model whose own config says auto: each equals plain decoding."""
    model, _, ids, mask, ref, _ = case
    set_costs(model, SPECULATIVE_WINS)
    assert (ids == PAD).any()  # left padding that the mask must hide
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW, pad_token_id=PAD, do_sample=False, speculative_mode="auto")
    assert torch.equal(out, ref.sequences)
    bias = {(int(ref.sequences[0, ids.shape[1] + 1]),): -50.0}
    out = generate_dict(model, ids, mask, NEW, speculative_mode="auto", sequence_bias=bias)
    assert torch.equal(out.sequences, plain(model, ids, mask, NEW, sequence_bias=bias).sequences)
    model.generation_config.speculative_mode = "auto"
    try:
        config = GenerationConfig(max_new_tokens=NEW, pad_token_id=PAD, do_sample=False, return_dict_in_generate=True)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, generation_config=config)
    finally:
        model.generation_config.speculative_mode = None
    assert out.speculation.mode == "auto" and torch.equal(out.sequences, ref.sequences)


@pytest.mark.parametrize("costs", ["plain", "speculative"])
def test_sampled_rows_are_repeated_for_num_return_sequences(case, costs):
    """`num_return_sequences=2` with sampling: each row twice, as plain decoding returns them; decoded plainly
    (one segment), seed for seed plain decoding's samples."""
    model, _, ids, mask, _, _ = case
    set_costs(model, PLAIN_WINS if costs == "plain" else SPECULATIVE_WINS)
    sampling = dict(do_sample=True, num_return_sequences=2)
    torch.manual_seed(5)
    out = generate_dict(model, ids, mask, 20, speculative_mode="auto", **sampling)
    assert out.sequences.shape == (2 * len(ids), ids.shape[1] + 20)
    assert torch.equal(out.sequences[:, : ids.shape[1]], ids.repeat_interleave(2, 0))
    if costs == "plain":
        torch.manual_seed(5)
        assert torch.equal(out.sequences, plain(model, ids, mask, 20, **sampling).sequences)


@pytest.mark.parametrize("kwargs, named", [
    ({"second_draft_loops": 2}, "second_draft_loops=2"),
    ({"draft_loops": 4}, "draft_loops=4"),
    ({"num_beams": 2}, "num_beams=2"),
    ({"cache": ({}, {})}, "cache: a tuple is no transformers Cache"),
    ({"output_attentions": True}, "output_attentions=True"),
    ({"output_hidden_states": True}, "output_hidden_states=True"),
    # with the fix that keeps it (the mode may be the checkpoint's default; the message said only to drop one)
    ({"prompt_lookup_num_tokens": 3}, "prompt_lookup_num_tokens=3.*Pass speculative_mode=None for assisted.*drop "
                                      "prompt_lookup_num_tokens"),
    ({"penalty_alpha": 0.6, "top_k": 4}, r"penalty_alpha=0\.6"),
    ({"assistant_early_exit": 1}, "assistant_early_exit=1 drafts from the first layers"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": None, "max_length": 5}, "max_length=5"),
])
def test_refusals_name_the_argument(case, kwargs, named):
    """Refused up front whatever auto would choose (with costs under which plain wins, too)."""
    model, _, ids, mask, _, _ = case
    kwargs = dict(kwargs)
    new = kwargs.pop("max_new_tokens", 4)
    for costs in (SPECULATIVE_WINS, PLAIN_WINS):
        set_costs(model, costs)
        with pytest.raises(ValueError, match=named):
            generate_dict(model, ids, mask, new, speculative_mode="auto", **kwargs)


def test_auto_reached_past_the_models_generate_is_refused_naming_it(case):
    """transformers' `GenerationMixin.generate(model, ...)` skips the model's own `generate`, where auto runs, and
    reaches the decoding loop with speculative_mode='auto' (from the call, or the model's generation config): a
    `ValueError` that says so and names the fix, before any token is decoded."""
    model, _, ids, mask, _, _ = case
    message = r"speculative_mode='auto' is decoded by the model's own generate, which this call bypassed.*\(\.\.\.\)"
    with pytest.raises(ValueError, match=message):
        GenerationMixin.generate(model, ids, attention_mask=mask, max_new_tokens=4, pad_token_id=PAD,
                                 speculative_mode="auto")
    model.generation_config.speculative_mode = "auto"
    try:
        with pytest.raises(ValueError, match=message):
            GenerationMixin.generate(model, ids, attention_mask=mask, max_new_tokens=4, pad_token_id=PAD)
    finally:
        del model.generation_config.speculative_mode


def test_inputs_embeds_are_refused_naming_input_ids(case):
    model, _, ids, _, _, _ = case
    with pytest.raises(ValueError, match="(?s)(?=.*auto)(?=.*input_ids)"):
        model.generate(inputs_embeds=model.get_input_embeddings()(ids), max_new_tokens=4, pad_token_id=PAD,
                       speculative_mode="auto")


@pytest.mark.parametrize("costs", ["speculative wins", "plain wins"])
def test_without_a_prompt_auto_starts_from_bos_as_plain_decoding_does(case, costs):
    """`generate()` without input_ids decodes one sequence from the BOS id in plain, pipeline and block mode; auto
    raised. It returns plain decoding's sequence (BOS first); without a BOS id anywhere it names bos_token_id."""
    model = case[0]
    set_costs(model, SPECULATIVE_WINS if costs == "speculative wins" else PLAIN_WINS)
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": PAD, "bos_token_id": 1}
    expected = model.generate(**kwargs, speculative_mode=None)
    assert expected[0, 0] == 1 and expected.shape == (1, 7)
    assert torch.equal(model.generate(**kwargs, speculative_mode="auto"), expected)
    with pytest.raises(ValueError, match="bos_token_id"):
        model.generate(**(kwargs | {"bos_token_id": None}), speculative_mode="auto")
    rows = torch.ones(2, 1, dtype=torch.long)  # a mask alone: one row from BOS per mask row
    expected = model.generate(**kwargs, attention_mask=rows, speculative_mode=None)
    assert expected.shape == (2, 7)
    assert torch.equal(model.generate(**kwargs, attention_mask=rows, speculative_mode="auto"), expected)


def test_costs_are_measured_once(case):
    """Without an injected table the first call measures one (a positive cost per candidate), later calls reuse it."""
    model = case[0]
    set_costs(model, None)
    table = costs_for(model, 1, [Candidate(None), PIPE1])
    assert table.plain_step > 0 and table.cycle[PIPE1] > 0
    assert costs_for(model, 1, [Candidate(None), PIPE1]) is table


def test_measured_tables_follow_the_segments(case):
    """A measured table (adapt) moves halfway to each observed cost; plain observations scale the speculative
    costs alike; an injected table stays as it is."""
    model = case[0]
    set_costs(model, CostTable(4.0, {PIPE1: 2.0}, adapt=True), batch=2)
    observe(model, 2, PIPE1, seconds=30.0, steps=10)  # 3 s per call: 2 -> 2.5
    observe(model, 2, PIPE1, seconds=10.0, steps=10)  # 1 s per call: 2.5 -> 1.75
    observe(model, 2, Candidate(None), seconds=12.0, steps=2)  # plain 6 s per step: 4 -> 5, so pipeline x 1.25
    assert costs_for(model, 2, [PIPE1]) == CostTable(5.0, {PIPE1: 1.75 * 1.25}, adapt=True)
    set_costs(model, SPECULATIVE_WINS, batch=2)
    observe(model, 2, PIPE1, seconds=30.0, steps=10)
    assert costs_for(model, 2, [PIPE1]) is SPECULATIVE_WINS


def test_command_line_auto():
    """`--mode auto` passes only the speculative settings the user gave; the bench takes auto in --modes."""
    args = argparse.Namespace(max_new_tokens=8, do_sample=False, temperature=None, top_k=None, top_p=None,
                              repetition_penalty=None, mode="auto", draft_loops=1, num_speculative_tokens=4)
    model = argparse.Namespace(generation_config=GenerationConfig(pad_token_id=0), num_loops=4, generation_keys=(),
                               call_block=lambda config, **given: contextlib.nullcontext(),
                               exit_rule=lambda **exit_options: None, config=argparse.Namespace(vocab_size=16))
    assert generate_kwargs(args, model, None)["speculative_mode"] == "auto"
    assert "draft_loops" not in generate_kwargs(args, model, None)
    args.speculative_given = {"--draft-loops": 2}
    args.draft_loops = 2
    assert generate_kwargs(args, model, None)["draft_loops"] == 2
    assert parse_modes("plain,pipeline,auto") == ["plain", "pipeline", "auto"]


def test_bench_runs_auto_beside_the_fixed_modes():
    """`hf-loopspec bench --modes plain,pipeline,auto`: auto's row is checked against plain greedy decoding like the
    fixed modes' and lists what its segments ran."""
    args = bench_args.parse_args(["--model", "ouro-tiny", "--device", "cpu", "--prompt-len", "8", "--new-tokens", "8",
                                  "--repeats", "1", "--calibration-seconds", "0.05", "--quiet",
                                  "--modes", "plain,pipeline,auto"])
    rows = {row["mode"]: row for row in run_bench(args)["rows"]}
    assert rows["auto"]["check_passed"] is True and rows["pipeline"]["check_passed"] is True
    choices = rows["auto"]["auto_choices"]
    assert choices and sum(c["tokens"] for c in choices) == 8


class Unvetted(LogitsProcessor):
    """A user's processor, not known to be row-pure: the speculative modes decode plainly with it, saying why."""

    def __call__(self, input_ids, scores):
        return scores


def test_a_processor_that_decodes_plainly_reports_its_fallback(case):
    """Where speculation would win, a processor the speculative modes decode plainly with makes auto report the
    same fallback and decode the call plainly in one stretch (it once reported a pipeline probe and kept nothing;
    then a probe that fell back), with plain decoding's tokens."""
    model, _, ids, mask, ref, _ = case
    set_costs(model, SPECULATIVE_WINS)
    processors = LogitsProcessorList([Unvetted()])
    out = generate_dict(model, ids, mask, NEW, speculative_mode="auto", logits_processor=processors)
    fixed = generate_dict(model, ids, mask, NEW, speculative_mode="pipeline", draft_loops=1,
                          logits_processor=processors)
    assert out.speculation.fallback is not None and out.speculation.fallback == fixed.speculation.fallback
    assert [(c.mode, c.reason, c.tokens) for c in out.speculation.choices] == [("plain", "fallback", NEW)]
    assert out.speculation.drafted == 0 and torch.equal(out.sequences, ref.sequences)


def test_positions_of_the_callers_own_decode_plainly(case):
    """`position_ids` (which only plain decoding follows; transformers' assisted loop passes them to an assistant
    model whose generation config says auto): one plain segment, reason "position-ids", tokens of plain decoding with
    the same positions (it raised, so plain assisted decoding failed with such an assistant)."""
    model, _, ids, mask, _, _ = case
    set_costs(model, SPECULATIVE_WINS)
    positions = 2 * (mask.long().cumsum(-1) - 1).clamp(min=0)  # spread (RoPE is relative: a shift is no change)
    expected = generate_dict(model, ids, mask, NEW, position_ids=positions)
    assert not torch.equal(expected.sequences, plain(model, ids, mask, NEW).sequences)
    out = generate_dict(model, ids, mask, NEW, speculative_mode="auto", position_ids=positions)
    assert [(c.mode, c.reason, c.tokens) for c in out.speculation.choices] == [("plain", "position-ids", NEW)]
    assert torch.equal(out.sequences, expected.sequences)


def test_plain_assisted_decoding_with_an_auto_assistant(case):
    """An assistant model whose generation config says auto assists plain decoding (transformers calls its generate
    with positions of its own): the tokens are plain decoding's."""
    model, _, ids, mask, ref, _ = case
    assistant = tiny_spec_model(5, vocab=VOCAB, damp=0.3)
    assistant.generation_config.speculative_mode = "auto"
    out = model.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=NEW, do_sample=False, pad_token_id=PAD,
                         eos_token_id=None, assistant_model=assistant, speculative_mode=None)
    assert torch.equal(out, plain(model, ids[:1], mask[:1], NEW).sequences)


def test_a_generation_config_passed_to_auto_brings_no_deprecation_warning(case, monkeypatch):
    """Each segment's settings go into a copy of the call's generation config: transformers warns when a config and
    generation arguments come together, which the user's call did not do."""
    model, _, ids, mask, ref, _ = case
    set_costs(model, SPECULATIVE_WINS)
    warned = []
    monkeypatch.setattr(generation_utils.logger, "warning_once", lambda message, *args: warned.append(message))
    config = GenerationConfig(max_new_tokens=NEW, do_sample=False, pad_token_id=PAD, eos_token_id=None,
                              speculative_mode="auto")
    out = model.generate(ids, attention_mask=mask, generation_config=config)
    assert torch.equal(out, ref.sequences)
    # also with a minimum the prompt already meets (the stretches were given min_length=None as a keyword)
    config.min_length = ids.shape[1] - 1
    assert torch.equal(model.generate(ids, attention_mask=mask, generation_config=config), ref.sequences)
    assert not [message for message in warned if "generation_config` together with" in message]
    one = ids[:1, mask[0].bool()]  # one row, no mask, pad = eos: transformers warns of batches only (auto did here)
    model.generate(one, max_new_tokens=4, do_sample=False, pad_token_id=PAD, eos_token_id=PAD, speculative_mode="auto")
    assert not [message for message in warned if "attention mask is not set with a batched input" in message]
    model.generate(ids, attention_mask=mask, generation_config=config, use_cache=True)  # the user's own call does
    assert [message for message in warned if "generation_config` together with" in message]
