"""Random-weight models: the named benchmark shapes (`SHAPES`) and the one seeded weight recipe (`random_model`,
`randomize_weights`) that the benchmark and the tests share, for both families (Ouro and Huginn).

The recipe, per parameter in `named_parameters()` order, drawn from one seeded generator on the model's device:

* token embeddings: normal(0, 1 / embed_scale), so that they are O(1) after the family's embedding scale
  (Ouro: 1; Huginn: `config.embed_scale`);
* norm weights: 1 + 0.3 * normal (so that a swapped or skipped norm changes the output);
* Huginn's q/k bias: 0.3 * normal;
* Ouro's exit gate: `gate_scale` times the matrix recipe (weight) or a normal (bias); 0, the default, zeroes it;
* every other matrix: normal(0, 1 / sqrt(fan_in)), so that activations and logits are O(1) and greedy choices are
  well separated (unlike `post_init`'s tiny-std init, which makes near-uniform logits).

`damp` < 1 makes consecutive loops agree, so that drafts get accepted:

* Ouro's layers are sandwiches whose branch outputs pass an RMSNorm (`*_layernorm_2`) before they join the
  residual stream, so those norm weights are scaled by `damp`, and the shared final norm (applied after every
  loop) gets weight 1, so that re-normalising an almost unchanged state is almost the identity;
* Huginn's adapter keeps most of the state (its state half becomes identity + damp * W), the recurrent
  blocks' attention and MLP output projections are scaled by `damp`, and so is their norm weights' noise
  (Huginn-0125's sandwich blocks normalise the residual stream itself, so a noisy norm would turn the state a
  little at every step however small the branches are).
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from ..models.huginn import HuginnConfig, HuginnForCausalLM
from ..models.ouro import OuroConfig, OuroForCausalLM
from .shape_table import SHAPES

FAMILIES = {"ouro": (OuroConfig, OuroForCausalLM), "huginn": (HuginnConfig, HuginnForCausalLM)}
_MODEL_TYPES = {OuroConfig.model_type: "ouro", HuginnConfig.model_type: "huginn"}

_POSITIONS = {"ouro": {"max_position_embeddings": 65536}, "huginn": {"block_size": 65536}}


def shape_config(shape: str) -> PretrainedConfig:
    """The config of a named shape (token ids 0 = bos = eos = pad)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown random-weight shape {shape!r}; choose one of {', '.join(SHAPES)}.")
    family, fields = SHAPES[shape]
    config_class = FAMILIES[family][0]
    return config_class(**fields, **_POSITIONS[family], bos_token_id=0, eos_token_id=0, pad_token_id=0)


def random_model(shape: str | PretrainedConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", seed: int = 0, *, damp: float = 1.0,
                 gate_scale: float = 0.0):
    """A model of a named shape (`SHAPES`) or of an Ouro / Huginn config, with the module's seeded random weights
    (see the module docstring for `damp` and `gate_scale`), built directly on `device` in `dtype`, in eval mode.

    The same arguments give the same weights on the same device type.
    """
    config = shape_config(shape) if isinstance(shape, str) else shape
    family = _family(config)
    with torch.device("meta"):
        model = FAMILIES[family][1](config)
    model = model.to(dtype).to_empty(device=torch.device(device))
    model.tie_weights()
    randomize_weights(model, seed, damp=damp, gate_scale=gate_scale)
    model.eval()
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = config.pad_token_id if config.pad_token_id is not None else 0
    return model


def randomize_weights(model, seed: int = 0, *, damp: float = 1.0, gate_scale: float = 0.0) -> None:
    """Overwrite every parameter of an Ouro or Huginn model in place with the module's recipe."""
    if not 0.0 < damp <= 1.0:
        raise ValueError(f"damp={damp!r} must be in (0, 1]; 1 leaves the loops undamped.")
    family = _family(model.config)
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    embed_scale = getattr(model.config, "embed_scale", 1.0) if family == "huginn" else 1.0

    def normal(param: torch.Tensor, mean: float, std: float) -> None:
        # Drawn in fp32 and cast, so that a bf16 model gets the rounded fp32 weights.
        param.copy_(torch.randn(param.shape, generator=gen, device=device).mul_(std).add_(mean))

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("embed_tokens.weight", "wte.weight")):
                normal(param, 0.0, 1.0 / embed_scale)
            elif "norm" in name or name.endswith("ln_f.weight"):  # Huginn's final norm is `ln_f`
                normal(param, 1.0, 0.3)
            elif name.endswith("qk_bias"):
                normal(param, 0.0, 0.3)
            elif "early_exit_gate" in name:
                normal(param, 0.0, gate_scale * (param.shape[-1] ** -0.5 if param.dim() == 2 else 1.0))
            else:
                normal(param, 0.0, param.shape[-1] ** -0.5)
        if damp < 1.0:
            _damp(model, family, damp)


def _damp(model, family: str, damp: float) -> None:
    params = dict(model.named_parameters())
    if family == "ouro":
        for name, param in params.items():
            if name.endswith("layernorm_2.weight"):
                param.mul_(damp)
        params["model.norm.weight"].fill_(1.0)
        return
    width = model.config.n_embd
    adapter = params["transformer.adapter.weight"]  # [E, 2E]: state half | prelude half
    adapter[:, :width] = torch.eye(width, device=adapter.device, dtype=adapter.dtype) + damp * adapter[:, :width]
    for name, param in params.items():
        if not name.startswith("transformer.core_block."):
            continue
        if name.endswith(("attn.proj.weight", "mlp.proj.weight")):
            param.mul_(damp)
        elif "norm" in name:  # sandwich blocks normalise the residual stream itself: noise 0.3 -> damp * 0.3
            param.sub_(1.0).mul_(damp).add_(1.0)


def _family(config) -> str:
    family = _MODEL_TYPES.get(getattr(config, "model_type", None))
    if family is None:
        raise ValueError(f"random weights are defined for Ouro and Huginn configs, not {type(config).__name__}.")
    return family
