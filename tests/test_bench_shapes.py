"""The shared random-weight recipe (`hf_loopspec.bench.shapes`): seeded, both families, and its `damp` and
`gate_scale` knobs do what they say."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_config
from huginn_utils import tiny_huginn_config

from hf_loopspec.bench.shapes import SHAPES, random_model, shape_config

# the tests' tiny configs (4 loops / recurrence steps), narrowed to the recipe's subject: 64 tokens, one block a stage
OURO = tiny_config(vocab_size=64, hidden_size=32, intermediate_size=64)
HUGINN = tiny_huginn_config(vocab_size=64, n_layers_in_prelude=1, n_layers_in_recurrent_block=1, n_layers_in_coda=1)


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("config", [OURO, HUGINN], ids=["ouro", "huginn"])
def test_weights_are_seeded(config):
    a, b, c = (_weights(random_model(config, seed=s)) for s in (0, 0, 1))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_every_named_shape_has_a_config():
    for name in SHAPES:
        assert shape_config(name).vocab_size > 3
    with pytest.raises(ValueError, match="unknown random-weight shape 'ouro-7b'"):
        shape_config("ouro-7b")


def test_gate_scale_sets_the_exit_gate():
    assert not random_model(OURO).model.early_exit_gate.weight.any()  # default 0: no gate
    assert random_model(OURO, gate_scale=1.0).model.early_exit_gate.weight.abs().sum() > 0


@pytest.mark.parametrize("config", [OURO, HUGINN], ids=["ouro", "huginn"])
def test_damp_makes_consecutive_loops_agree(config):
    """The relative change of the logits from loop 1 (a draft's) to loop U (the target's) shrinks with `damp`, the
    knob that makes drafts from early loops right."""
    ids = torch.randint(3, 64, (1, 40), generator=torch.Generator().manual_seed(0))

    def draft_change(damp: float) -> float:
        model = random_model(config, seed=0, damp=damp)
        with torch.no_grad():
            logits = [model(ids, **_loops(model, u)).logits[0] for u in (1, model.num_loops)]  # [S, V] each
        return float((logits[1] - logits[0]).norm() / logits[1].norm())

    assert draft_change(0.05) < 0.7 * draft_change(1.0)


def _loops(model, u: int) -> dict:
    """Forward kwargs that decode after loop `u` (Huginn: from zero initial states)."""
    return {"num_steps": u, "init_scale": 0.0} if hasattr(model, "recurrence") else {"exit_at_step": u - 1}


def test_damp_is_checked():
    with pytest.raises(ValueError, match="damp=0"):
        random_model(OURO, damp=0)
