"""Lossless speculative sampling: the joint distribution of sampled tokens under pipeline and block modes against
the exact distribution of plain sampling (the rules themselves are checked against hand computations in
test_rules.py).

The distribution tests run the wavefront engine, the engine `generate` runs; the power test patches the reference's
rule (`lane_rules.speculative`, which a debug cache's reference run uses).

Statistics: Pearson's chi-square goodness of fit against the exact probabilities, computed here with an
independent full forward of the model and transformers' own processors. The p-value comes from the
regularised upper incomplete gamma function; a test fails when p < 1e-3 (its false-alarm rate). Cells with an
expected count below 5 are pooled. The power of the same test is shown against a deliberately wrong rule
("accept when the draft equals the target's argmax, else sample the target"), which it must reject.
"""

from __future__ import annotations

import pytest
import torch
from sampling_utils import ALPHA, PROCESSOR_SETTINGS, PROMPT, chi_square_p_value, exact_joint, sample_pairs
from speculative_utils import MODES, mode_id, mode_kwargs, mode_params

from hf_loopspec import PagedLoopCache
from hf_loopspec.generation import lane_rules, rules

# every setting of the matrix once, with the processor settings in turn
JOINT = [pytest.param(m, processors, id=f"{mode_id(*m)}-{processors}")
         for m, processors in zip(MODES, ["none", "warped", "warped", "none"])]


@pytest.mark.parametrize(("mode", "settings"), JOINT)
def test_joint_distribution_of_two_tokens_equals_plain_sampling(sampling_model, mode, settings):
    joint = exact_joint(sampling_model, PROCESSOR_SETTINGS[settings])
    counts = sample_pairs(sampling_model, PROCESSOR_SETTINGS[settings], seed=1, speculative_engine="wavefront",
                          **mode_kwargs(*mode))
    assert chi_square_p_value(counts, joint) > ALPHA


def test_plain_sampling_passes_the_same_test(sampling_model):
    """The exact joint really is plain sampling's distribution (guards the reference itself)."""
    settings = PROCESSOR_SETTINGS["warped"]
    assert chi_square_p_value(sample_pairs(sampling_model, settings, seed=2), exact_joint(sampling_model, settings)) \
        > ALPHA


def test_statistical_test_has_power_against_the_approximate_rule(sampling_model, monkeypatch):
    def greedy_match(p, q, x, judged, u):  # keep the draft only when it is p's argmax, else draw from p
        accept = x == p.argmax(-1)
        return torch.where(judged & accept, x, rules.draw(p, u[..., rules.DRAW])), accept, p

    monkeypatch.setattr(lane_rules, "speculative", greedy_match)
    counts = sample_pairs(sampling_model, {}, seed=3, speculative_mode="pipeline", draft_loops=1,
                          cache=PagedLoopCache(sampling_model.kv_layout, debug=True))  # the reference's rule
    assert chi_square_p_value(counts, exact_joint(sampling_model, {})) < ALPHA


@pytest.mark.parametrize("mode,d,k", mode_params(keep=lambda mode, d, k: d == 1))
def test_same_seed_same_output_and_top_k_1_is_greedy(sampling_model, mode, d, k):
    engine = "wavefront"
    ids = torch.tensor([PROMPT, [2, 2, 7]])
    spec = mode_kwargs(mode, d, k)
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        runs.append(sampling_model.generate(ids, max_new_tokens=12, do_sample=True, speculative_engine=engine, **spec))
    assert torch.equal(*runs)
    torch.manual_seed(124)
    assert not torch.equal(runs[0], sampling_model.generate(ids, max_new_tokens=12, do_sample=True,
                                                            speculative_engine=engine, **spec))
    greedy = sampling_model.generate(ids, max_new_tokens=12, do_sample=False)
    top1 = sampling_model.generate(ids, max_new_tokens=12, do_sample=True, top_k=1, speculative_engine=engine, **spec)
    assert torch.equal(top1, greedy)


def test_greedy_path_does_not_consume_random_numbers(sampling_model):
    ids = torch.tensor([PROMPT])
    torch.manual_seed(5)
    sampling_model.generate(ids, max_new_tokens=8, do_sample=False, speculative_mode="pipeline")
    after = torch.rand(1)
    torch.manual_seed(5)
    assert torch.equal(torch.rand(1), after)


def test_every_pair_is_reachable_under_the_exact_distribution(sampling_model):
    """Sanity of the fixture: the model's joint is spread out enough for the test to mean something."""
    joint = exact_joint(sampling_model, {})
    assert (joint > 1e-3).sum() >= 20
    assert abs(float(joint.sum()) - 1) < 1e-5  # fp32 softmaxes, summed in fp64


@pytest.mark.parametrize("default", [torch.bfloat16, torch.float64])
@pytest.mark.parametrize("outputs", [False, True])
def test_torch_default_dtype_changes_no_token_and_no_score(sampling_model, default, outputs):
    """torch's default dtype is the user's to set: the engine's uniforms and float buffers followed it. Under
    bfloat16 the uniforms took a few hundred values (tokens between them were never drawn), and with output_scores
    or output_logits the step raised a scatter RuntimeError. The same seed now gives the same tokens, scores and
    logits (float32) as under the float32 default."""
    ids = torch.tensor([PROMPT, [2, 2, 7]])

    def run():
        torch.manual_seed(7)
        return sampling_model.generate(ids, max_new_tokens=40, do_sample=True, speculative_mode="pipeline",
                                       return_dict_in_generate=True, output_scores=outputs, output_logits=outputs)

    expected = run()
    torch.set_default_dtype(default)
    try:
        got = run()
        uniforms = rules.cycle_uniforms(torch.Generator().manual_seed(0), (2, 3, 2), torch.device("cpu"))
    finally:
        torch.set_default_dtype(torch.float32)
    assert torch.equal(got.sequences, expected.sequences) and uniforms.dtype == torch.float32
    for got_step, expected_step in zip((got.scores or ()) + (got.logits or ()),
                                       (expected.scores or ()) + (expected.logits or ()), strict=True):
        assert got_step.dtype == torch.float32 and torch.equal(got_step, expected_step)
