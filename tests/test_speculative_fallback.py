"""Logits processors that the lane decoder cannot run losslessly: `generate` decodes plainly, warns once naming the
processor (through transformers' logging, so its verbosity applies), and reports the fallback in
`out.speculation.fallback`; the output is plain decoding's.

The cases are a stateful processor that runs the model on its own context (classifier-free guidance through
`guidance_scale`), watermarking (`SynthIDTextWatermarkingConfig`, under seeded sampling), a penalty on each row's prompt
tokens (`encoder_repetition_penalty`), a ban of each row's prompt n-grams (`encoder_no_repeat_ngram_size`) and a user's
processor that treats batch rows differently. Each is first shown to change plain decoding's output, so equality is not
vacuous; the expectation is plain decoding with the same settings.
"""

from __future__ import annotations

import logging

import accelerate
import pytest
import torch
from helpers import tiny_model
from huginn_utils import tiny_huginn
from inputs import left_pad, random_prompts
from speculative_utils import generate_dict, paged_cache, tiny_spec_model
from transformers import LogitsProcessor, LogitsProcessorList, SynthIDTextWatermarkingConfig
from transformers.cache_utils import DynamicCache
from transformers.utils import logging as transformers_logging

from hf_loopspec import PagedLoopCache
from hf_loopspec.generation import auto, auto_policy

VOCAB = 64
NEW = 10


class RowBias(LogitsProcessor):
    """Favours token 10 + batch row: called one row at a time, every row would favour token 10."""

    def __call__(self, input_ids, scores):
        rows = torch.arange(len(scores))
        scores = scores.clone()
        scores[rows, 10 + rows] += 50.0
        return scores


CASES = {
    "guidance_scale": ({"guidance_scale": 1.5}, "UnbatchedClassifierFreeGuidanceLogitsProcessor"),
    "synthid": ({"do_sample": True, "watermarking_config": SynthIDTextWatermarkingConfig(
        keys=[654, 400, 836, 123, 340], ngram_len=3)}, "SynthIDTextWatermarkLogitsProcessor"),
    "row_bias": ({"logits_processor": LogitsProcessorList([RowBias()])}, "RowBias"),
    "encoder_penalty": ({"encoder_repetition_penalty": 3.0}, "EncoderRepetitionPenaltyLogitsProcessor"),
    "encoder_no_repeat": ({"encoder_no_repeat_ngram_size": 1}, "EncoderNoRepeatNGramLogitsProcessor"),
}


@pytest.fixture(scope="module")
def setup():
    model = tiny_spec_model(81, 4, vocab=VOCAB, damp=0.15)
    return model, *left_pad(random_prompts(81, [6, 3], VOCAB))


def run(model, ids, mask, seed=0, **kwargs):
    """A seeded greedy (or, with do_sample, sampled) call; returns the dict output."""
    torch.manual_seed(seed)
    return generate_dict(model, ids, mask, NEW, **kwargs)


def fallback_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "plain decoding instead" in r.getMessage()]


@pytest.mark.parametrize("mode", ["pipeline", "block"])
@pytest.mark.parametrize("case", list(CASES))
def test_unsupported_processor_falls_back_to_plain_with_one_warning(setup, case, mode, caplog):
    model, ids, mask = setup
    settings, name = CASES[case]
    ref = run(model, ids, mask, **settings)
    without = {k: v for k, v in settings.items() if k == "do_sample"}
    assert ref.sequences.tolist() != run(model, ids, mask, **without).sequences.tolist()
    transformers_logging.warning_once.cache_clear()  # "once per process": forget the other cases' warnings
    with caplog.at_level(logging.WARNING, logger="hf_loopspec"):
        outs = [run(model, ids, mask, speculative_mode=mode, cache=paged_cache(model), **settings) for _ in range(2)]
    warnings = fallback_warnings(caplog)
    assert len(warnings) == 1 and name in warnings[0]
    for out in outs:
        assert out.sequences.tolist() == ref.sequences.tolist()
        assert name in out.speculation.fallback and out.speculation.mode == mode
        assert out.speculation.core_calls == out.speculation.committed_tokens == 0


@pytest.mark.parametrize("case", list(CASES))
def test_auto_reports_the_fallback_whatever_it_would_choose(setup, case, caplog, monkeypatch):
    """Auto mode decodes such a call plainly in one stretch, warns once and says why in `out.speculation.fallback`
    before choosing anything (before, a model whose remembered acceptance made auto choose plain decoding reported
    no fallback for `guidance_scale` or watermarking: only a speculative stretch that fell back found them)."""
    model, ids, mask = setup
    settings, name = CASES[case]  # (named as the fixed modes name it: auto builds the call's processors up front)
    low = auto_policy.Acceptance({1: 0.0, 2: 0.0}, {1: 500.0, 2: 500.0})  # auto would choose plain decoding
    monkeypatch.setattr(auto_policy, "remembered", lambda model, settings: low.copy())
    monkeypatch.setattr(auto, "remembered", lambda model, settings: low.copy())
    transformers_logging.warning_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="hf_loopspec"):
        out = run(model, ids, mask, speculative_mode="auto", **settings)
    assert len(fallback_warnings(caplog)) == 1 and name in fallback_warnings(caplog)[0]
    assert name in out.speculation.fallback
    assert [(c.mode, c.reason) for c in out.speculation.choices] == [("plain", "fallback")]
    assert out.sequences.tolist() == run(model, ids, mask, **settings).sequences.tolist()


def test_the_fallback_warning_is_logged_once_whichever_mode_finds_it(setup, caplog):
    """docs/generation.md: once per process. The fixed modes and auto logged it on loggers of their own, so a
    pipeline call then an auto call with the same processor warned twice."""
    model, ids, mask = setup
    for case in ("row_bias", "guidance_scale", "encoder_penalty"):  # (auto named the last two by their setting)
        settings, name = CASES[case]
        transformers_logging.warning_once.cache_clear()
        with caplog.at_level(logging.WARNING, logger="hf_loopspec"):
            for mode in ("pipeline", "auto", "block", "auto"):
                assert name in run(model, ids, mask, speculative_mode=mode, **settings).speculation.fallback
        assert len(fallback_warnings(caplog)) == 1, fallback_warnings(caplog)
        caplog.clear()


def test_settings_that_add_no_processor_are_no_fallback(setup):
    """transformers builds no processor for an `encoder_no_repeat_ngram_size` of 0 or below (nor a guidance scale or
    encoder penalty of 1): auto decoded such a call plainly, saying the processor was added."""
    model, ids, mask = setup
    for settings in ({"encoder_no_repeat_ngram_size": -1}, {"encoder_no_repeat_ngram_size": 0},
                     {"guidance_scale": 1.0}, {"encoder_repetition_penalty": 1.0}):
        assert run(model, ids, mask, speculative_mode="auto", **settings).speculation.fallback is None, settings


def test_transformers_verbosity_silences_the_fallback_warning(setup, caplog):
    """`transformers.logging.set_verbosity_error()` silences hf_loopspec's warning as it silences transformers'
    own; back at transformers' default verbosity the same warning is logged."""
    model, ids, mask = setup
    settings = CASES["row_bias"][0]
    before = transformers_logging.get_verbosity()
    try:
        transformers_logging.set_verbosity_error()
        transformers_logging.warning_once.cache_clear()
        with caplog.at_level(logging.WARNING, logger="hf_loopspec"):
            out = run(model, ids, mask, speculative_mode="pipeline", **settings)
        assert out.speculation.fallback is not None and fallback_warnings(caplog) == []
        transformers_logging.set_verbosity_warning()
        transformers_logging.warning_once.cache_clear()
        with caplog.at_level(logging.WARNING, logger="hf_loopspec"):
            run(model, ids, mask, speculative_mode="pipeline", **settings)
        assert len(fallback_warnings(caplog)) == 1
    finally:
        transformers_logging.set_verbosity(before)


def test_row_pure_processors_still_run_speculatively(setup):
    model, ids, mask = setup
    settings = {"repetition_penalty": 1.3, "no_repeat_ngram_size": 2, "suppress_tokens": [3, 4]}
    out = run(model, ids, mask, speculative_mode="pipeline", **settings)
    assert out.speculation.fallback is None and out.speculation.committed_tokens > 0
    assert out.sequences.tolist() == run(model, ids, mask, **settings).sequences.tolist()


@pytest.mark.parametrize("mode", ["pipeline", "block", "auto"])
def test_a_dynamically_quantized_model_decodes_plainly(setup, mode):
    """torch.ao's dynamic quantization takes one activation scale per call, so a row's output depends on the rows
    beside it (shown first: the reason is real); every speculative mode decodes such a model plainly and says so,
    with plain decoding's tokens (auto included: it reads the head's width from the quantized head), on a padded
    batch too: the fallback decodes on a `DynamicCache`, whose calls hold the padding as plain decoding's do (it
    decoded on the `PagedLoopCache`, which leaves padding out, and so other tokens). Such a cache is refused."""
    model, ids, mask = setup
    assert not bool(mask.all())
    quantized = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    layer = quantized.model.layers[0].mlp.up_proj
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0))
    x[1] *= 9.0  # a row of larger values sets the call's scale
    assert not torch.equal(layer(x[:1]), layer(x)[:1])
    ref = run(quantized, ids, mask, speculative_mode=None)
    out = run(quantized, ids, mask, speculative_mode=mode)
    assert out.sequences.tolist() == ref.sequences.tolist()
    if mode != "auto":  # (auto's stretches are generate calls of these modes)
        assert "dynamically quantized layers (Linear)" in out.speculation.fallback
        assert out.speculation.engine == "plain" and out.speculation.committed_tokens == 0
    with pytest.raises(ValueError, match="dynamically quantized layers .* pass a DynamicCache or no cache"):
        run(quantized, ids, mask, speculative_mode=mode, cache=PagedLoopCache(quantized.kv_layout))


@pytest.mark.parametrize("mode", ["pipeline", "auto"])
def test_a_dynamically_quantized_model_without_a_cache_decodes_as_plain_without_one(mode):
    """Without a cache each step is one call over the whole sequence: other activation scales than with one, so
    other tokens (shown first). A call with `use_cache=False` gets plain decoding's own tokens without a cache (auto
    decoded its one plain stretch with a cache)."""
    quantized = torch.ao.quantization.quantize_dynamic(tiny_model()[0], {torch.nn.Linear}, dtype=torch.qint8)
    ids = torch.randint(1, quantized.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(3))
    settings = dict(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    uncached = quantized.generate(ids, speculative_mode=None, use_cache=False, **settings)
    assert not torch.equal(uncached, quantized.generate(ids, speculative_mode=None, **settings))
    assert torch.equal(quantized.generate(ids, speculative_mode=mode, use_cache=False, **settings), uncached)


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_an_embedding_of_another_dtype_than_the_model_decodes_plainly(family):
    """An input embedding cast alone (`embed_tokens.half()` on an fp32 model): plain decoding runs (the layers take
    its output), and every speculative mode decodes plainly, names both dtypes and the fix, with plain decoding's
    tokens (the engine, which keeps its lanes in the embedding's dtype, raised a RuntimeError from a copy or a
    matmul)."""
    model = tiny_spec_model(82, 4, vocab=VOCAB, damp=0.15) if family == "ouro" else \
        tiny_huginn("retrofitted", seed=82)[0]  # (an untied head: the tied one in float16 stops plain decoding too)
    ids, mask = left_pad(random_prompts(82, [5, 3], VOCAB))
    model.get_input_embeddings().half()
    settings = {} if family == "ouro" else {"init_scale": 0.0}
    ref = run(model, ids, mask, speculative_mode=None, **settings)
    for mode in ("pipeline", "block", "auto"):
        out = run(model, ids, mask, speculative_mode=mode, **settings)
        assert out.sequences.tolist() == ref.sequences.tolist(), mode
        if mode != "auto":
            assert "the input embedding is float16 and the other weights float32" in out.speculation.fallback
            assert "model.to(torch.bfloat16)" in out.speculation.fallback
    with pytest.raises(ValueError, match="input embedding is float16, not the dtype of its other weights, and a "
                                         "PagedLoopCache keeps the KV in the embedding's dtype; pass a DynamicCache"):
        run(model, ids, mask, speculative_mode=None, cache=PagedLoopCache(model.kv_layout), **settings)


class Int8Weight(torch.Tensor):
    """A weight that says it quantizes the activations it meets, as torchao's do (`act_quant_kwargs`: per row, for
    int8 dynamic activation; `activation_quantization` on its Intx weights); it computes as a plain tensor, so plain
    decoding of the model is the reference."""

    act_quant_kwargs = activation_quantization = None


@pytest.mark.parametrize("marker", ["act_quant_kwargs", "activation_quantization"])
def test_a_model_whose_weights_quantize_activations_decodes_plainly(setup, marker):
    """torchao's activation quantization rounds activations to a coarse grid, so the engine's last-bit differences
    became other tokens, without a word; such a model decodes plainly and says so. Weight-only quantization (no
    `act_quant_kwargs`) keeps speculative decoding."""
    model, ids, mask = setup
    layer = model.model.layers[0].mlp.up_proj
    plain = layer.weight
    layer.weight = torch.nn.Parameter(plain.detach().as_subclass(Int8Weight), requires_grad=False)
    try:
        setattr(Int8Weight, marker, "int8 per row")
        ref = run(model, ids, mask, speculative_mode=None)
        out = run(model, ids, mask, speculative_mode="pipeline")
        assert out.sequences.tolist() == ref.sequences.tolist()
        assert "weights (Int8Weight) quantize the activations" in out.speculation.fallback
        # on a DynamicCache, as plain decoding (the paged cache's calls, without padding, gave other tokens)
        assert isinstance(out.cache, DynamicCache) and not bool(mask.all())
        with pytest.raises(ValueError, match="weights quantize their inputs, .* pass a DynamicCache or no cache"):
            run(model, ids, mask, speculative_mode="pipeline", cache=PagedLoopCache(model.kv_layout))
        setattr(Int8Weight, marker, None)  # weight-only
        assert run(model, ids, mask, speculative_mode="pipeline").speculation.fallback is None
    finally:
        layer.weight = plain
        setattr(Int8Weight, marker, None)


@pytest.mark.parametrize("where", ["model", "base model", "every module"])
def test_a_forward_hook_on_the_model_or_its_base_model_decodes_plainly(setup, where, caplog):
    """The engine calls the model's stages, not the causal LM's or its base model's `forward`, so a hook there would
    not run: such a call decodes plainly, the hook runs as in plain decoding (here it steers the output, so equality
    is not vacuous), and the warning names the hooked module; without the hook the call speculates again. A global
    module hook (`register_module_forward_hook`, on every module: here it steers the causal LM's output) too."""
    model, ids, mask = setup
    calls = []

    def steer(module, args, output):
        if where != "base model" and module is not model:
            return output
        calls.append(1)
        if where == "base model":
            output.last_hidden_state.mul_(-1.0)
        else:
            output.logits[..., 7] += 100.0
        return output

    before = run(model, ids, mask).sequences.tolist()
    handle = (torch.nn.modules.module.register_module_forward_hook(steer) if where == "every module"
              else (model if where == "model" else model.model).register_forward_hook(steer))
    try:
        ref = run(model, ids, mask)
        assert ref.sequences.tolist() != before and calls
        calls.clear()
        transformers_logging.warning_once.cache_clear()
        with caplog.at_level(logging.WARNING, logger="hf_loopspec"):
            out = run(model, ids, mask, speculative_mode="pipeline")
    finally:
        handle.remove()
    assert out.sequences.tolist() == ref.sequences.tolist() and len(calls) == NEW
    named = {"model": "the model", "base model": "its base model",
             "every module": "every module (global module hooks)"}[where]
    assert f"forward hooks on {named} run when the model itself is called" in out.speculation.fallback
    assert len(fallback_warnings(caplog)) == 1
    again = run(model, ids, mask, speculative_mode="pipeline")
    assert again.speculation.fallback is None and again.sequences.tolist() == before


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_a_model_offloaded_by_accelerate_decodes_in_every_mode(family):
    """accelerate's `cpu_offload` leaves the weights on the meta device and moves them in at each module call: every
    mode decodes plain decoding's tokens of the model before offloading (auto timed its costs on the meta device and
    raised; Huginn's forward placed its positions there and raised in every mode)."""
    if family == "ouro":
        model, settings = tiny_spec_model(82, 4, vocab=VOCAB, damp=0.15), {}
    else:
        model, settings = tiny_huginn(seed=4, damp=0.3)[0], {"num_steps": 4, "init_scale": 1.0, "init_seed": 9}
    ids, mask = left_pad(random_prompts(82, [5, 3], model.config.vocab_size))
    expected = run(model, ids, mask, speculative_mode=None, **settings).sequences
    first = run(model, ids[:1, -3:], mask[:1, -3:], speculative_mode=None, **settings)  # a chat's plain first turn
    turn = torch.cat([first.sequences, torch.tensor([[5]])], 1)
    continued = run(model, turn, torch.ones_like(turn), speculative_mode=None, **settings).sequences
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    assert model.device.type == "meta"
    for mode in (None, "pipeline", "block", "auto"):
        assert torch.equal(run(model, ids, mask, speculative_mode=mode, **settings).sequences, expected), mode
        # its DynamicCache continued speculatively (refused as a cache on another device: meta, the weights' place)
        cache = run(model, ids[:1, -3:], mask[:1, -3:], speculative_mode=None, **settings).past_key_values
        out = run(model, turn, torch.ones_like(turn), speculative_mode=mode, cache=cache, **settings)
        assert torch.equal(out.sequences, continued), mode
    for mode in ("pipeline", "block"):  # compiled: refused by name (dynamo raised on accelerate's hooks)
        with pytest.raises(ValueError, match="compile_core with a model offloaded by accelerate .* drop compile_core"):
            run(model, ids, mask, speculative_mode=mode, compile_core="eager", **settings)


def layer_inputs(model, **kwargs) -> tuple[list, list]:
    """The output of a greedy call on a one-row prompt, and how many tokens each call of the first layer took (a
    dense `[1, T, H]` input or a flat `[T, H]` one, as a `PagedLoopCache` lays it out)."""
    shapes = []
    hook = model.model.layers[0].register_forward_hook(lambda _, args, out: shapes.append(args[0].shape[-2]))
    try:
        ids = torch.tensor([list(range(3, 15))])
        out = generate_dict(model, ids, torch.ones_like(ids), NEW, **kwargs)
    finally:
        hook.remove()
    return out, shapes


@pytest.mark.parametrize("mode", ["pipeline", "block", "auto"])
def test_a_chunked_prefill_decodes_plainly(setup, mode):
    """`prefill_chunk_size` (the prompt prefilled in chunks of that many tokens, to bound memory) was ignored by the
    speculative modes, which prefilled the whole prompt in one call: such a call decodes plainly, says so, and calls
    the model as plain decoding does (the same number of tokens in each call, chunks first)."""
    model = setup[0]
    ref, want = layer_inputs(model, prefill_chunk_size=4)
    assert want[0] == 4 and layer_inputs(model)[1][0] == 12  # (the chunking is real)
    out, shapes = layer_inputs(model, prefill_chunk_size=4, speculative_mode=mode)
    assert out.sequences.tolist() == ref.sequences.tolist()
    assert shapes == want
    assert "prefill_chunk_size=4" in out.speculation.fallback


def test_synced_gpus_decodes_plainly(setup, tmp_path):
    """`synced_gpus=True` (DeepSpeed ZeRO-3 / FSDP: a process whose rows have stopped keeps calling the model until
    every process's have) was ignored by the speculative modes, so a process that finished first stopped calling and
    the others would wait on it for ever: such a call decodes plainly (in a one-process group here, where plain
    decoding's synchronisation runs), with plain decoding's calls."""
    model = setup[0]
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    try:
        ref, want = layer_inputs(model, synced_gpus=True)
        for mode in ("pipeline", "block", "auto"):
            out, shapes = layer_inputs(model, synced_gpus=True, speculative_mode=mode)
            assert out.sequences.tolist() == ref.sequences.tolist() and shapes == want, mode
            assert "synced_gpus=True" in out.speculation.fallback, mode
    finally:
        torch.distributed.destroy_process_group()
