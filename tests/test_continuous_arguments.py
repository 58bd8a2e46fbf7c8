"""Arguments of continuous batching that transformers' signatures accept but a looped model's manager must check:
request ids, `max_new_tokens` and the generation config's `max_length`, settings a manager cannot honour, a kept
manager asked for with other settings, integer types. The reference of every tokens check is plain greedy
`generate` of the request alone (fp32)."""

from __future__ import annotations

import contextlib
import logging

import accelerate
import numpy as np
import pytest
import torch
from continuous_utils import VOCAB, WAIT_S, alone, batching, generation_config, prompts
from speculative_utils import named_modes, tiny_spec_model
from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.generation import GenerationMode
from transformers.generation.continuous_batching import RequestStatus

from hf_loopspec.generation.continuous.settings import manager_settings

PIPELINE = named_modes()["pipeline-d1"]


@pytest.fixture(scope="module")
def model():
    return tiny_spec_model(0, vocab=VOCAB, damp=0.5)


@pytest.mark.parametrize("name", ["persistent_manager", "warmup", "record_timestamps", "progress_bar"])
def test_switches_of_generate_batch_are_booleans(model, name):
    """`persistent_manager="no"` kept the manager (a non-empty string is true), so the next call with another
    config was refused for a manager the caller never asked to keep."""
    with pytest.raises(ValueError, match=f"{name}='no' must be True or False"):
        model.generate_batch([[5, 6, 7]], max_new_tokens=2, **{name: "no"})
    assert getattr(model, "_cached_continuous_batching_manager", None) is None
    done = model.generate_batch([[5, 6, 7]], max_new_tokens=2, **{name: np.bool_(name == "warmup")})  # (numpy's)
    assert [len(out.generated_tokens) for out in done.values()] == [2]


def test_request_ids_must_be_new(model):
    """`generate_batch(request_id=...)` would give every request one id (it waited forever); an id still open on a
    manager is refused; once that request has finished, its id is free again."""
    inputs = prompts(2, [4, 6])
    with pytest.raises(ValueError, match="request_id='x' in generate_batch"):
        model.generate_batch(inputs, generation_config=generation_config({}), continuous_batching_config=batching(),
                             request_id="x")
    manager = model.init_continuous_batching(generation_config(PIPELINE), batching())
    manager.start()
    try:
        manager.add_request(inputs[0], request_id="dup", max_new_tokens=5)
        with pytest.raises(ValueError, match="request_id='dup' is already waiting or in flight"):
            manager.add_request(inputs[1], request_id="dup", max_new_tokens=5)
        first = next(r for r in manager.request_id_iter("dup") if r.is_finished())
        assert first.generated_tokens == alone(model, inputs[0], 5)
        manager.add_request(inputs[1], request_id="dup", max_new_tokens=5)
        second = next(r for r in manager.request_id_iter("dup") if r.is_finished())
        assert second.generated_tokens == alone(model, inputs[1], 5)
    finally:
        manager.stop(block=True, timeout=30)


def test_add_request_checks_its_id_and_switches(model):
    """`streaming="no"` streamed (a non-empty string is true) and an unhashable id raised a TypeError from the
    result router; both are refused up front, naming the argument, and nothing is queued for them."""
    inputs = prompts(1, [4])
    manager = model.init_continuous_batching(generation_config(PIPELINE), batching())
    manager.start()
    try:
        for kwargs, match in (({"streaming": "no"}, "streaming='no' must be True or False"),
                              ({"record_timestamps": 1}, "record_timestamps=1 must be True or False"),
                              ({"request_id": ["a"]}, r"request_id=\['a'\] must be a string"),
                              ({"request_id": 7}, r"request_id=7 must be a string .* str\(request_id\)")):
            with pytest.raises(ValueError, match=match):
                manager.add_request(inputs[0], max_new_tokens=3, **kwargs)
        assert manager.input_queue.empty()
        rid = manager.add_request(inputs[0], max_new_tokens=3, streaming=np.bool_(False), record_timestamps=None)
        assert manager.get_result(rid, timeout=WAIT_S).generated_tokens == alone(model, inputs[0], 3)
        nested = manager.get_result(manager.add_request([inputs[0]], max_new_tokens=3), timeout=WAIT_S)
        assert "a list of lists; give one flat list of token ids per request" in nested.error  # (named "token ids")
    finally:
        manager.stop(block=True, timeout=30)


@pytest.mark.parametrize("settings", [{}, PIPELINE], ids=["plain", "pipeline"])
def test_max_length_of_the_config_counts_the_prompt(model, settings):
    """A generation config with `max_length` and no `max_new_tokens` stops each request where `generate` does
    (prompt included); a prompt that already fills it fails alone, naming max_length."""
    inputs = prompts(3, [4, 6, 9])
    config = generation_config(settings, max_new_tokens=None, max_length=9)
    out = model.generate_batch(inputs, generation_config=config, continuous_batching_config=batching())
    expected = [model.generate(torch.tensor([p]), generation_config=config, speculative_mode=None)[0, len(p):].tolist()
                for p in inputs[:2]]
    assert [r.generated_tokens for r in list(out.values())[:2]] == expected
    assert [len(e) for e in expected] == [5, 3]
    last = list(out.values())[2]
    assert last.status == RequestStatus.FAILED and "max_length=9" in last.error


@pytest.mark.parametrize("length", [0, 3])
def test_a_max_length_that_leaves_no_new_token_fails_each_request(model, length):
    """`max_length` 0 (as 3, below the prompt) with no `max_new_tokens` leaves no new token: each request fails
    naming it, where `generate` raises (0 was read as unset: 20 new tokens, transformers' default)."""
    config = generation_config({}, max_new_tokens=None, max_length=length)
    with pytest.raises(ValueError, match=f"`max_length` is set to {length}"):
        model.generate(torch.tensor(prompts(3, [4])), generation_config=config, speculative_mode=None)
    out = model.generate_batch(prompts(3, [4]), generation_config=config, continuous_batching_config=batching())
    assert [(r.status, f"max_length={length} in the generation config" in r.error) for r in out.values()] == \
        [(RequestStatus.FAILED, True)]


def test_a_prompt_on_the_meta_device_fails_alone_naming_it(model):
    """A prompt tensor on the meta device (no values), or a list of 0-d ones, fails its request, naming the device,
    and the others decode (torch's "Cannot copy out of meta tensor" or its `item()` error ended generate_batch)."""
    good = prompts(4, [5])[0]
    meta = [torch.tensor(good, device="meta"), [torch.tensor(t, device="meta") for t in good]]  # (one, or its items)
    out = model.generate_batch([*meta, good], generation_config=generation_config({}))
    *failed, decoded = out.values()
    assert [(r.status, "on the meta device" in r.error) for r in failed] == [(RequestStatus.FAILED, True)] * 2
    assert decoded.generated_tokens == alone(model, good, 8)


def test_a_block_round_drafts_at_most_the_tokens_a_slot_holds(model):
    """A block manager with K far past a slot's positions (10**6) decodes plain's tokens with K capped at the slot's
    positions, as `generate` caps K at its new tokens (its lanes were allocated in full: torch's allocator failed
    inside the running loop)."""
    config = generation_config({"speculative_mode": "block", "num_speculative_tokens": 10**6})
    assert manager_settings(model, config, batching()).num_speculative_tokens == 64  # (batching(): 64 positions)
    inputs = prompts(5, [4, 6])
    out = model.generate_batch(inputs, generation_config=config, continuous_batching_config=batching())
    assert [r.generated_tokens for r in out.values()] == [alone(model, p, 8) for p in inputs]


def test_zero_new_tokens_fails_instead_of_taking_the_default(model):
    """generate_batch raises (every request would fail), also for a value of another type, before the manager is
    sized by it (2.5 and "5" raised TypeErrors from deep inside); one request added with it fails alone."""
    for bad in (0, 2.5, "5", [3, 4], torch.tensor(4)):  # slots sized from the workload (max_new_tokens among it)
        with pytest.raises(ValueError, match=r"generate_batch: max_new_tokens=.*: give an integer >= 1"):
            model.generate_batch(prompts(2, [4]), generation_config=generation_config({}),
                                 continuous_batching_config=ContinuousBatchingConfig(max_requests_per_batch=2),
                                 max_new_tokens=bad)
    manager = model.init_continuous_batching(generation_config({}), batching())
    manager.start()
    try:
        request = manager.add_request(prompts(2, [4])[0], max_new_tokens=0)
        result = manager.get_result(request, timeout=WAIT_S)
    finally:
        manager.stop(block=True, timeout=WAIT_S)
    assert result.status == RequestStatus.FAILED and "max_new_tokens=0" in result.error


def test_without_any_length_a_request_decodes_transformers_default_of_new_tokens(model):
    """Neither the config nor the model's sets a length: `generate` decodes 20 new tokens, whatever the prompt's
    length, and so does each request (after the configs were merged, the default max_length 20 counted the prompt:
    a 22-token prompt failed)."""
    inputs = prompts(6, [4, 22])
    config = generation_config({}, max_new_tokens=None)
    assert model.generation_config.max_length is None and config.max_length is None
    expected = [model.generate(torch.tensor([p]), generation_config=config, speculative_mode=None)[0, len(p):]
                .tolist() for p in inputs]
    out = model.generate_batch(inputs, generation_config=config, continuous_batching_config=batching())
    assert [r.generated_tokens for r in out.values()] == expected
    assert len(expected[1]) == 20 or expected[1][-1] == model.generation_config.eos_token_id


@pytest.mark.parametrize("settings", [{}, PIPELINE], ids=["plain", "pipeline"])
def test_the_models_generation_config_fills_what_the_callers_leaves_unset(model, settings):
    """As `generate` merges them: a caller's config without EOS ids stops each request at the EOS ids of the model's
    generation config (which config.json lacks, as a chat checkpoint's end-of-turn id), and a minimum length set
    there is refused by name. Before, config.json's EOS ids were used and the minimum dropped without a word."""
    inputs = prompts(5, [4, 6])
    free = model.generate(torch.tensor([inputs[0]]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                          pad_token_id=0, speculative_mode=None)[0, 4:].tolist()
    saved = model.generation_config.eos_token_id, model.generation_config.min_new_tokens
    try:
        assert model.config.eos_token_id != free[2]
        model.generation_config.eos_token_id = [free[2]]
        config = generation_config(settings)  # no EOS ids of its own
        expected = [model.generate(torch.tensor([p]), generation_config=config, speculative_mode=None)[0, len(p):]
                    .tolist() for p in inputs]
        assert expected[0] == free[:free.index(free[2]) + 1]  # stopped at the second EOS id
        out = model.generate_batch(inputs, generation_config=config, continuous_batching_config=batching())
        assert [r.generated_tokens for r in out.values()] == expected
        model.generation_config.min_new_tokens = 3
        with pytest.raises(ValueError, match="MinNewTokensLengthLogitsProcessor .* in continuous batching"):
            model.init_continuous_batching(config, batching())
    finally:
        model.generation_config.eos_token_id, model.generation_config.min_new_tokens = saved


@pytest.mark.parametrize("extra", [{"max_time": 1e-4}, {"penalty_alpha": 0.6, "top_k": 4},
                                   {"assistant_early_exit": 1}, {"dola_layers": "low"}, {"token_healing": True},
                                   {"force_words_ids": [[3]]}],
                         ids=["max_time", "penalty_alpha", "assistant_early_exit", "dola_layers", "token_healing",
                              "force_words_ids"])
def test_settings_a_manager_would_drop_are_refused(model, extra):
    """Each was dropped without a word (token_healing: `generate` heals the prompt through its tokenizer, or raises
    without one, and a manager decoded the prompt unhealed; force_words_ids: `generate` refuses constrained beam
    search, and a manager decoded greedily)."""
    key = next(iter(extra))
    with pytest.raises(ValueError, match=f"{key}=.* in continuous batching"):
        model.init_continuous_batching(generation_config({}, **extra), batching())


@pytest.mark.parametrize("extra", [{"penalty_alpha": 0.0, "top_k": 4}, {"penalty_alpha": 0.6, "top_k": 1},
                                   {"token_healing": 0}], ids=["alpha-0", "top_k-1", "healing-0"])
def test_settings_plain_decoding_reads_as_off_are_accepted(model, extra):
    """Contrastive search runs only with `penalty_alpha > 0` and `top_k > 1`, and `token_healing=0` heals nothing:
    plain `generate` decodes greedily with them, and a manager built with them returns its tokens (they were refused
    as contrastive search or token healing)."""
    config = generation_config({}, **extra)
    assert config.get_generation_mode() == GenerationMode.GREEDY_SEARCH
    inputs = prompts(9, [5, 8])
    out = model.generate_batch(inputs, generation_config=config, continuous_batching_config=batching())
    assert [r.generated_tokens for r in out.values()] == [alone(model, p, 8, **extra) for p in inputs]


def test_prompt_lookup_in_the_models_config_is_left_unused():
    """A checkpoint's generation config may ask for prompt lookup, a lossless speed-up of plain decoding: the manager
    runs without it and each request gets plain decoding's tokens (refusing it made such a checkpoint unusable in
    continuous batching and serve, with no config to pass that drops it)."""
    model = tiny_spec_model(8, vocab=VOCAB)
    model.generation_config.prompt_lookup_num_tokens = 3
    inputs = prompts(9, [5, 8])
    out = model.generate_batch(inputs, generation_config=generation_config({}),
                               continuous_batching_config=batching())
    assert [r.generated_tokens for r in out.values()] == [alone(model, p, 8) for p in inputs]


def test_a_kept_manager_refuses_other_settings(model):
    """A manager kept for the next session runs its own settings for life: asking for it with another generation
    config raises instead of decoding with the old one; the same config (or none) gets it back."""
    inputs = prompts(2, [4, 6])
    config = generation_config({})
    model.generate_batch(inputs, generation_config=config, continuous_batching_config=batching(),
                         persistent_manager=True)
    try:
        with pytest.raises(ValueError, match="generation_config: this model keeps a continuous batching manager"):
            model.generate_batch(inputs, generation_config=generation_config({}, repetition_penalty=1.5),
                                 continuous_batching_config=batching(), persistent_manager=True)
        out = model.generate_batch(inputs, generation_config=generation_config({}),
                                   continuous_batching_config=batching(), persistent_manager=True)
        assert [r.generated_tokens for r in out.values()] == [alone(model, p, 8) for p in inputs]
    finally:
        model.destroy_cached_continuous_batching_manager()


def test_a_kept_manager_built_with_numpy_settings_serves_equal_configs_again(model):
    """numpy numbers and 0-d tensors pass everywhere else (generate, a manager's first call); reusing a kept manager
    built with them raised transformers' TypeError from comparing the configs through JSON ("int64 is not JSON
    serializable", "Object of type Tensor is not JSON serializable")."""
    inputs = prompts(2, [4, 6])
    numpy = generation_config({}, max_new_tokens=np.int64(5), eos_token_id=[np.int64(0)], temperature=np.float32(1))
    tensor = generation_config({**PIPELINE, "draft_loops": torch.tensor(PIPELINE["draft_loops"])}, max_new_tokens=5,
                               eos_token_id=[0])
    python = generation_config({}, max_new_tokens=5, eos_token_id=[0], temperature=1.0)
    expected = [alone(model, p, 5, eos=[0]) for p in inputs]
    try:
        for config in (numpy, numpy, python, None, tensor, tensor):
            if config is None:  # (a manager of other settings)
                model.destroy_cached_continuous_batching_manager()
                continue
            out = model.generate_batch(inputs, generation_config=config, continuous_batching_config=batching(),
                                       persistent_manager=True)
            assert [r.generated_tokens for r in out.values()] == expected
    finally:
        model.destroy_cached_continuous_batching_manager()


@pytest.mark.parametrize("change", ["loops", "dtype", "hook"])
def test_a_kept_manager_is_refused_once_the_model_changed(change):
    """A kept manager's slots are built for the model as it was: after its loop count or dtype changed (it decoded
    the old loop count without a word, or raised a dtype error from deep inside), or a hook was put on it, asking
    for the manager raises a ValueError; a fresh one (after destroying it) decodes the changed model as generate
    does."""
    model = tiny_spec_model(0, vocab=VOCAB, damp=0.5)
    inputs, config = prompts(2, [4, 6]), generation_config(PIPELINE)
    model.generate_batch(inputs, generation_config=config, continuous_batching_config=batching(),
                         persistent_manager=True)
    if change == "loops":
        model.config.total_ut_steps = 2
    elif change == "dtype":
        model.to(torch.float64)
    else:
        model.register_forward_hook(lambda module, args, output: output)
    with pytest.raises(ValueError, match="keeps a continuous batching manager built before|forward hooks"):
        model.generate_batch(inputs, generation_config=config, continuous_batching_config=batching(),
                             persistent_manager=True)
    model.destroy_cached_continuous_batching_manager()
    if change == "hook":
        return
    out = model.generate_batch(inputs, generation_config=config, continuous_batching_config=batching())
    assert [r.generated_tokens for r in out.values()] == [alone(model, p, 8) for p in inputs]


def test_a_kept_manager_serves_on_after_changes_that_leave_its_slots_alone(tmp_path):
    """Saving the model (which fills config.architectures and dtype of a model built from a config) and config edits
    that no slot depends on (use_cache, output_hidden_states) keep the kept manager: it was refused before."""
    model = tiny_spec_model(0, vocab=VOCAB, damp=0.5)
    inputs, config = prompts(2, [4, 6]), generation_config(PIPELINE)
    kept = dict(generation_config=config, continuous_batching_config=batching(), persistent_manager=True)
    try:
        first = model.generate_batch(inputs, **kept)
        model.save_pretrained(tmp_path)
        model.config.use_cache, model.config.output_hidden_states = False, True
        again = model.generate_batch(inputs, **kept)
        assert [r.generated_tokens for r in again.values()] == [r.generated_tokens for r in first.values()]
    finally:
        model.destroy_cached_continuous_batching_manager()


def test_generate_batch_takes_only_its_own_results_from_a_kept_manager(model):
    """A kept manager may still hold the result of an earlier call's request (a call interrupted by Ctrl-C leaves
    them): `generate_batch` counted it as one of its own, stopped short and raised, on every later call."""
    inputs, config = prompts(2, [4, 6]), generation_config({})
    kept = dict(generation_config=config, continuous_batching_config=batching(), persistent_manager=True)
    try:
        model.generate_batch(inputs, **kept)
        manager = model._cached_continuous_batching_manager
        manager.start()
        manager.add_request(prompts(3, [5])[0], max_new_tokens=3)  # left uncollected, as by an interrupted call
        manager.stop(block=True, keep_for_next_session=True)
        out = model.generate_batch(inputs, **kept)
        assert [r.generated_tokens for r in out.values()] == [alone(model, p, 8) for p in inputs]
    finally:
        model.destroy_cached_continuous_batching_manager()


@pytest.mark.parametrize("change", ["hook", "global hook", "quantized", "offloaded"])
def test_a_model_the_stages_cannot_decode_as_generate_does_is_refused(change):
    """A hook on the model (or on every module), dynamically quantized layers, weights offloaded by accelerate:
    `generate` decodes such a model plainly (or, offloaded, moves the weights in per call), but a manager calls the
    stages on its device, so the hook never ran and the tokens differed, without a word. Continuous batching
    refuses such a model, naming why."""
    model = tiny_spec_model(0, vocab=VOCAB, damp=0.5)
    context = contextlib.nullcontext()
    if change == "hook":
        model.model.register_forward_pre_hook(lambda module, args: None)
    elif change == "global hook":
        context = torch.nn.modules.module.register_module_forward_hook(lambda module, args, output: output)
    elif change == "quantized":
        model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    else:
        accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    named = {"hook": "forward hooks on its base model", "global hook": "global module hooks",
             "quantized": "dynamically quantized", "offloaded": "meta device"}[change]
    with context, pytest.raises(ValueError, match=f"continuous batching: .*{named}"):
        model.generate_batch(prompts(2, [4]), generation_config=generation_config({}),
                             continuous_batching_config=batching())


def test_a_kept_manager_built_from_the_models_config_is_refused_once_that_config_changed(model):
    """A manager built without a config runs `model.generation_config` as it was then: asked for again without one
    after that config was edited, it raises (it ran the old settings: other tokens than `generate`'s); unedited, it
    comes back."""
    inputs = prompts(2, [4, 6])
    saved = model.generation_config.repetition_penalty
    try:
        model.generate_batch(inputs, max_new_tokens=5, continuous_batching_config=batching(), persistent_manager=True)
        kept = model.init_continuous_batching()
        assert model.init_continuous_batching() is kept
        model.generation_config.repetition_penalty = 1.5
        with pytest.raises(ValueError, match="merged over model.generation_config as it is now"):
            model.generate_batch(inputs, max_new_tokens=5, continuous_batching_config=batching(),
                                 persistent_manager=True)
    finally:
        model.generation_config.repetition_penalty = saved
        model.destroy_cached_continuous_batching_manager()


def test_a_started_manager_fails_requests_once_the_models_loop_count_changed(model):
    """A running manager's slots are built for the loop count (and KV layout, vocabulary, dtype, device) it started
    with: after `model.config.total_ut_steps` changes, a request it admits fails naming the change (it decoded the old
    loop count's tokens without a word), and with the change set back it serves as plain decoding does."""
    [prompt] = prompts(3, [5])
    manager = model.init_continuous_batching(generation_config({"speculative_mode": "pipeline", "draft_loops": 1}),
                                             batching())
    manager.start()
    try:
        model.config.total_ut_steps = 2
        result = manager.get_result(request_id=manager.add_request(prompt, max_new_tokens=6), timeout=WAIT_S)
        assert result.status == RequestStatus.FAILED and "the model changed since this continuous batching manager " \
            "was built (its loop count" in str(result.error)
        model.config.total_ut_steps = 4
        result = manager.get_result(request_id=manager.add_request(prompt, max_new_tokens=6), timeout=WAIT_S)
        assert result.status == RequestStatus.FINISHED and result.generated_tokens == alone(model, prompt, 6)
    finally:
        model.config.total_ut_steps = 4
        manager.stop(block=True)


@pytest.mark.parametrize(("config", "match"), [
    (ContinuousBatchingConfig(page_size=0), "page_size=0"),
    (ContinuousBatchingConfig(max_blocks_per_request=4, block_size=-16), "block_size=-16"),
    (ContinuousBatchingConfig(seed="x"), "seed='x'"),
    (ContinuousBatchingConfig(seed=-1), "seed=-1"),
    # a bound the manager would not keep (add_request never blocks): 8 requests all queued past a bound of 2
    (ContinuousBatchingConfig(max_queue_size=2), "max_queue_size=2 .*add_request never blocks"),
    (ContinuousBatchingConfig(return_logprobs=True), "return_logprobs=True"),
    # slots far past any request (a billion blocks: a raw allocator error; a million ran the machine out of memory)
    (ContinuousBatchingConfig(max_blocks_per_request=10**9, page_size=16),
     r"slots of 16000000000 positions .* more than half the free memory. The positions come from "
     r"max_blocks_per_request x block or page size: pass a smaller max_blocks_per_request"),
])
def test_bad_continuous_batching_config_values_are_named(model, config, match):
    with pytest.raises(ValueError, match=match):
        model.init_continuous_batching(generation_config({}), config)


def test_the_eos_and_the_default_length_are_read_as_generate_reads_them():
    """A generation config without an EOS decodes to the length, as `generate` does (the manager fell back to
    model.config's eos_token_id, which `generate` never reads, and cut the request short); without any length setting
    the default 20 new tokens stop at the model's positions, as `generate` caps them (the manager decoded past)."""
    model = tiny_spec_model(3, 4, vocab=VOCAB)
    prompt = prompts(2, [4])[0]
    free = alone(model, prompt, 12, eos=[])
    model.config.eos_token_id, model.generation_config.eos_token_id = free[1], None  # (a token it decodes)
    out = model.generate_batch([prompt], max_new_tokens=12)
    assert [result.generated_tokens for result in out.values()] == [free]
    long = prompts(3, [model.config.max_position_embeddings - 5])[0]
    want = model.generate(torch.tensor([long]), eos_token_id=[], speculative_mode=None)[0, len(long):].tolist()
    out = model.generate_batch([long], eos_token_id=[])
    assert len(want) == 5 and [result.generated_tokens for result in out.values()] == [want]
    full = prompts(4, [model.config.max_position_embeddings])[0]  # (refused as generate refuses it, naming why)
    (result,) = model.generate_batch([full], eos_token_id=[]).values()
    assert result.status == RequestStatus.FAILED and "fills the model's 512 positions" in result.error


def test_slots_sized_by_max_new_tokens_name_it(model):
    """Without a ContinuousBatchingConfig a slot holds the longest prompt plus max_new_tokens: a billion new tokens is
    refused naming max_new_tokens (the message named max_blocks_per_request, which the caller never set)."""
    with pytest.raises(ValueError, match=r"1 slots of 1000000003 positions .* The positions come from the longest "
                                         r"prompt plus max_new_tokens: lower max_new_tokens"):
        model.generate_batch([[5, 6, 7]], generation_config=generation_config({}), max_new_tokens=10**9)


def test_a_prompt_of_0d_tensors_or_arrays_is_read_as_their_values(model):
    """A prompt listing 0-d tensors or arrays (what iterating a 1-D tensor gives) decodes as its values (each request
    failed with "token ids must be integers" for ids that were)."""
    prompt = prompts(1, [4])[0]
    for items in ([torch.tensor(t) for t in prompt], [np.array(t) for t in prompt]):
        out = model.generate_batch([items], generation_config=generation_config({}), max_new_tokens=3)
        assert [result.generated_tokens for result in out.values()] == [alone(model, prompt, 3)]


def test_a_slot_longer_than_the_models_positions_is_taken(model):
    """A slot may be longer than the model's positions (one block of 1024 positions on a 512-position model): its
    requests may decode past them as `generate` does, with a warning; only a slot whose state would not fit in
    memory is refused (above; slots longer than the positions were refused for a while, a regression)."""
    prompt = prompts(1, [4])[0]
    out = model.generate_batch([prompt], generation_config=generation_config({}), max_new_tokens=3,
                               continuous_batching_config=ContinuousBatchingConfig(max_blocks_per_request=1,
                                                                                   page_size=1024))
    assert [result.generated_tokens for result in out.values()] == [alone(model, prompt, 3)]


def test_a_continuous_batching_config_field_the_manager_does_not_use_is_warned_of(model, caplog):
    """`max_batch_tokens` and `use_cuda_graph` (transformers' manager's, `--cb-max-batch-tokens` of `serve`) did
    nothing without a word; a manager now names them in a warning, and fields it uses or checks pass quietly (the
    `per_request_processors` that `transformers serve` sets included)."""
    used = batching()
    used.per_request_processors = True
    unused = batching()
    unused.max_batch_tokens, unused.use_cuda_graph = 1, True
    for config, expected in ((used, None), (unused, "max_batch_tokens=1, use_cuda_graph=True")):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hf_loopspec"):
            model.init_continuous_batching(generation_config({}), config)
        warned = [r.getMessage() for r in caplog.records if "ContinuousBatchingConfig" in r.getMessage()]
        if expected is None:
            assert warned == []
        else:
            assert len(warned) == 1 and expected in warned[0]


def test_a_request_past_the_models_positions_is_warned_of_once(model, monkeypatch, caplog):
    """A request longer than `max_position_embeddings` decodes (as `generate` does, plain decoding's tokens) with one
    warning per manager, as `generate` warns; it decoded without a word before."""
    monkeypatch.setattr(model.config, "max_position_embeddings", 8)
    inputs = prompts(3, [4, 6, 3])
    with caplog.at_level(logging.WARNING, logger="hf_loopspec"):
        out = model.generate_batch(inputs, generation_config=generation_config(PIPELINE), max_new_tokens=5)
    assert [r.generated_tokens for r in out.values()] == [alone(model, ids, 5) for ids in inputs]
    warned = [r.getMessage() for r in caplog.records if "max_position_embeddings=8" in r.getMessage()]
    assert len(warned) == 1 and "a request of 9 positions" in warned[0]


def test_bad_generate_batch_arguments_are_named(model):
    with pytest.raises(ValueError, match=r"inputs: a tensor of shape \(2, 4\)"):
        model.generate_batch(torch.ones(2, 4, dtype=torch.long), generation_config=generation_config({}))
    with pytest.raises(ValueError, match="inputs: generator"):
        model.generate_batch((p for p in prompts(2, [4])), generation_config=generation_config({}))
    with pytest.raises(ValueError, match="generation_config: a dict"):
        model.generate_batch(prompts(2, [4]), generation_config={"max_new_tokens": 3})
    # a dict's settings were read as unset, each ignored without a word (a num_blocks far too large ran)
    with pytest.raises(ValueError, match=r"continuous_batching_config: a dict; give a transformers.Continuous"):
        model.generate_batch(prompts(2, [4]), continuous_batching_config={"num_blocks": 10**9})
    for bad in ({"max_requests_per_batch": 0}, "x"):
        with pytest.raises(ValueError, match="continuous_batching_config: a "):
            model.init_continuous_batching(generation_config({}), continuous_batching_config=bad)
    with pytest.raises(ValueError, match="generation_config: a str"):
        model.init_continuous_batching("x")
    # token ids read as generate reads them: a list of 0-d tensors is EOS ids, a string is refused by name
    with pytest.raises(ValueError, match="eos_token_id='5' must be a token id"):
        model.generate_batch(prompts(2, [4]), generation_config=GenerationConfig(eos_token_id="5"))
    done = {}
    for eos in (VOCAB - 1, [torch.tensor(VOCAB - 1)]):  # (the second was refused)
        out = model.generate_batch(prompts(1, [4]), generation_config=generation_config({}), max_new_tokens=2,
                                   eos_token_id=eos)
        done[str(eos)] = [result.generated_tokens for result in out.values()]
    assert len(set(map(str, done.values()))) == 1
    for bad, match in [("abc", r"inputs\[1\]: a str;"), (torch.ones(1, 3, dtype=torch.long),
                                                      r"inputs\[1\]: a Tensor of shape \(1, 3\);"),
                       ([[5, 6]], r"inputs\[1\]: a list of lists;")]:  # (a FAILED request naming "token ids")
        with pytest.raises(ValueError, match=match):
            model.generate_batch([[5, 6], bad], generation_config=generation_config({}))


def test_a_setting_every_request_would_fail_on_raises_in_generate_batch(model):
    """A keyword argument generate_batch passes to every request that none can run with raises, naming it (every
    request came back FAILED for the same reason); the manager is stopped and a next call runs."""
    for kwargs, match in [({"temperature": 0.3}, r"\['temperature'\]"), ({"max_new_tokens": "5"}, "max_new_tokens='5'"),
                          ({"seed": 3}, "seed=3 on a greedy manager")]:
        with pytest.raises(ValueError, match=f"generate_batch: .*{match}"):
            model.generate_batch(prompts(2, [4]), generation_config=generation_config({}),
                                 continuous_batching_config=batching(), **kwargs)
    out = model.generate_batch(prompts(2, [4]), generation_config=generation_config({}),
                               continuous_batching_config=batching(), max_new_tokens=3)
    assert [r.generated_tokens for r in out.values()] == [alone(model, prompts(2, [4])[0], 3)]


@pytest.mark.parametrize("settings", [{}, PIPELINE], ids=["plain", "pipeline"])
def test_generate_batch_gives_its_eos_ids_to_every_request(model, settings):
    """`generate_batch(..., eos_token_id=...)` stops every request there, as `generate` with that EOS id does (it
    was refused as a setting a request cannot take, though `add_request` takes it)."""
    inputs = prompts(5, [4, 6])
    free = alone(model, inputs[0], 8)
    config = generation_config(settings)
    expected = [model.generate(torch.tensor([p]), generation_config=config, eos_token_id=free[2],
                               speculative_mode=None)[0, len(p):].tolist() for p in inputs]
    assert expected[0] == free[:free.index(free[2]) + 1]
    out = model.generate_batch(inputs, generation_config=config, continuous_batching_config=batching(),
                               eos_token_id=free[2])
    assert [r.generated_tokens for r in out.values()] == expected
    for bad in ("x", 2.5, list(range(1, 18))):
        with pytest.raises(ValueError, match="eos_token_id="):
            model.generate_batch(inputs, generation_config=config, continuous_batching_config=batching(),
                                 eos_token_id=bad)


def test_prompts_as_numpy_arrays_decode_like_lists(model):
    """1-D arrays are prompts in generate_batch as in add_request (they were refused with a message naming the list)."""
    inputs = prompts(2, [4, 6])
    out = model.generate_batch([np.array(p) for p in inputs], generation_config=generation_config({}),
                               continuous_batching_config=batching(), max_new_tokens=4)
    assert [r.generated_tokens for r in out.values()] == [alone(model, p, 4) for p in inputs]


def test_a_request_longer_than_a_kept_managers_slots_says_how_to_replace_it(model):
    """A kept manager is sized by its first call; a later longer request fails with a reason that names the config's
    current keys (page_size, not the deprecated block_size) and how to drop the kept manager first."""
    config = generation_config({})
    model.generate_batch(prompts(2, [3]), generation_config=config, persistent_manager=True, max_new_tokens=4)
    try:
        out = model.generate_batch(prompts(3, [30]), generation_config=config, persistent_manager=True,
                                   max_new_tokens=4)
        (result,) = out.values()
        assert result.status == RequestStatus.FAILED
        assert "page_size=" in result.error and "block_size" not in result.error
        assert "model.destroy_cached_continuous_batching_manager()" in result.error
    finally:
        model.destroy_cached_continuous_batching_manager()


def test_numpy_integers_and_bad_eos_ids(model):
    """numpy integers are integers (ids, max_new_tokens, seed); EOS ids that are not integers fail the request alone
    with a message naming eos_token_id, and `True` is not an id."""
    prompt = prompts(2, [5])[0]
    out = model.generate_batch([[np.int64(t) for t in prompt]], generation_config=generation_config({}),
                               continuous_batching_config=batching(), max_new_tokens=np.int64(4))
    assert [r.generated_tokens for r in out.values()] == [alone(model, prompt, 4)]
    manager = model.init_continuous_batching(generation_config({}), batching())
    manager.start()
    try:
        for eos in ("a", 46.7, [[1]], True):
            request = manager.add_request(prompt, max_new_tokens=3, eos_token_id=eos)
            result = next(manager.request_id_iter(request))
            assert result.status == RequestStatus.FAILED and "eos_token_id=" in result.error, eos
    finally:
        manager.stop(block=True, timeout=30)


@pytest.mark.parametrize("where", ["reading results", "adding requests", "inside add_request"])
def test_an_interrupted_call_leaves_nothing_on_a_kept_manager(model, monkeypatch, where):
    """Ctrl-C in `generate_batch` on a kept manager: its requests went on decoding and their results stayed queued
    on the manager for good, one more set per interrupted call (and an interrupt inside `add_request` left its id
    open for good). They are now cancelled and their results dropped; the next call decodes as plain `generate` and
    leaves the manager holding nothing."""
    inputs, config = prompts(2, [4, 6]), generation_config({})
    kept = dict(generation_config=config, continuous_batching_config=batching(), persistent_manager=True)
    try:
        model.generate_batch(inputs, **kept)
        manager = model._cached_continuous_batching_manager
        calls = []

        def interrupt(real):
            def interrupted(*args, **kwargs):
                calls.append(1)
                if len(calls) == 3:
                    raise KeyboardInterrupt
                return real(*args, **kwargs)
            return interrupted

        owner, name = {"reading results": (manager, "get_result"), "adding requests": (manager, "add_request"),
                       "inside add_request": (manager.input_queue, "put")}[where]  # (before the put: none queued)
        monkeypatch.setattr(owner, name, interrupt(getattr(owner, name)))
        with pytest.raises(KeyboardInterrupt):
            model.generate_batch(prompts(3, [5, 7, 9, 4]), max_new_tokens=30, **kept)
        monkeypatch.undo()
        out = model.generate_batch(inputs, **kept)
        assert [r.generated_tokens for r in out.values()] == [alone(model, p, 8) for p in inputs]
        router = manager.output_router
        assert (router.output_queue.qsize(), router.open_ids) == (0, {})
        assert not router.abandoned  # (the cancellations were delivered: nothing is left to drop)
    finally:
        model.destroy_cached_continuous_batching_manager()


def test_a_call_refused_on_an_id_in_use_leaves_that_request_alone(model):
    """A kept manager holds a request added by hand as "req_1", the id `generate_batch` gives its second request:
    the call raises, and cancelled that other request on its way out (its owner got no result at all)."""
    kept = dict(generation_config=generation_config({}), continuous_batching_config=batching(),
                persistent_manager=True)
    try:
        model.generate_batch(prompts(2, [4]), **kept)  # builds the kept manager (its ids start over below)
        manager = model._cached_continuous_batching_manager
        manager._request_counter = 0
        with model.continuous_batching_context_manager(**kept):
            mine = manager.add_request(prompts(6, [5])[0], request_id="req_1", max_new_tokens=20)
            with pytest.raises(ValueError, match="request_id='req_1' is already waiting or in flight"):
                model.generate_batch(prompts(3, [5, 7, 9]), max_new_tokens=4, **kept)
            result = manager.get_result(mine, timeout=WAIT_S)
        assert result is not None and result.error is None
        assert result.generated_tokens == alone(model, prompts(6, [5])[0], 20)
    finally:
        model.destroy_cached_continuous_batching_manager()
