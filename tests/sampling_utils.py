"""The statistics of the speculative sampling tests (test_speculative_sampling.py, test_speculative_second.py): random
distributions, Pearson's chi-square p-value, the tiny sampling model, and the exact joint distribution of two sampled
tokens under plain sampling (from full forwards and transformers' own processors) with the sampled counts to test
against it."""

from __future__ import annotations

import torch
from transformers import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from hf_loopspec import OuroConfig, OuroForCausalLM

ALPHA = 1e-3  # a statistical test fails when p < ALPHA (its false-alarm rate)


def random_distribution(vocab, generator, zeros=0):
    probs = torch.rand(vocab, generator=generator, dtype=torch.float64) ** 3
    probs[torch.randperm(vocab, generator=generator)[:zeros]] = 0
    return probs / probs.sum()


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson goodness of fit of `counts` against `probs`, pooling cells with expected count < 5."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    expected = probs * counts.sum()
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a sample fell on a zero-probability cell"
    counts, expected = counts[keep], expected[keep]
    stat = ((counts - expected) ** 2 / expected).sum()
    dof = len(counts) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


VOCAB, PROMPT, SAMPLES = 8, [3, 5, 1], 3000


def tiny_sampling_model():
    """The sampling tests' model (conftest's `sampling_model` fixture): a tiny Ouro over VOCAB = 8 tokens with
    transformers' own initialisation at std 0.2. Not the shared recipe: on `tiny_spec_model(11, vocab=VOCAB)` the
    power test (`test_statistical_test_has_power_against_the_approximate_rule`) does not reject the wrong rule."""
    torch.manual_seed(11)
    config = OuroConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, total_ut_steps=4, eos_token_id=None,
                        pad_token_id=0, initializer_range=0.2)
    return OuroForCausalLM(config).eval()


PROCESSOR_SETTINGS = {
    "none": dict(),
    "warped": dict(temperature=0.7, top_k=5, repetition_penalty=1.5),
}


def processors_for(settings):
    out = LogitsProcessorList()
    if "repetition_penalty" in settings:
        out.append(RepetitionPenaltyLogitsProcessor(settings["repetition_penalty"]))
    if "temperature" in settings:
        out.append(TemperatureLogitsWarper(settings["temperature"]))
    if "top_k" in settings:
        out.append(TopKLogitsWarper(settings["top_k"]))
    return out


def exact_joint(model, settings, procs: LogitsProcessorList | None = None) -> torch.Tensor:
    """p(t1, t2 | prompt) under plain sampling with `settings` (or the processors `procs`): [V, V], from full
    forwards."""
    procs = processors_for(settings) if procs is None else procs
    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    with torch.no_grad():
        prompt = torch.tensor([PROMPT])
        p1 = torch.softmax(procs(prompt, model(prompt).logits[:, -1].float()), -1)[0].double()
        for t1 in range(VOCAB):
            ids = torch.tensor([PROMPT + [t1]])
            p2 = torch.softmax(procs(ids, model(ids).logits[:, -1].float()), -1)[0].double()
            joint[t1] = p1[t1] * p2
    return joint


def sample_pairs(model, settings, seed, **generate_kwargs) -> torch.Tensor:
    """`pair_counts` of SAMPLES plain or speculative samples of two tokens after PROMPT, seeded."""
    torch.manual_seed(seed)
    ids = torch.tensor([PROMPT] * SAMPLES)
    out = model.generate(ids, max_new_tokens=2, do_sample=True, top_p=1.0, **settings, **generate_kwargs)
    return pair_counts(out)


def pair_counts(sequences: torch.Tensor) -> torch.Tensor:
    """How often each pair of last two tokens occurs in `sequences` [N, T]: [VOCAB * VOCAB], pair (a, b) at a * VOCAB
    + b, as `exact_joint(...).flatten()` orders them."""
    counts = torch.zeros(VOCAB * VOCAB)
    counts.index_add_(0, sequences[:, -2] * VOCAB + sequences[:, -1], torch.ones(len(sequences)))
    return counts
