"""Helpers of the Huginn tests: tiny configs of both variants, tiny models with weights under the Hub key names
(checked against `huginn.md`'s key table), the reference, and Hub-like checkpoint folders."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from huginn_reference import huginn_reference
from safetensors.torch import save_file

from hf_loopspec import HuginnConfig
from hf_loopspec.bench.shapes import random_model

PAD = 0
VOCAB = 97
# Huginn-0125's layout in miniature: sandwich blocks, interleaved RoPE, MHA, q/k bias, embedding scale sqrt(E).
TINY = {
    "vocab_size": VOCAB, "n_embd": 32, "n_heads": 4, "intermediate_size": 48, "n_layers_in_prelude": 2,
    "n_layers_in_recurrent_block": 2, "n_layers_in_coda": 2, "mean_recurrence": 4, "block_size": 256,
    "rope_base": 50000.0, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": PAD,
}
# The retrofitted-recurrence switches: pre-norm blocks, rotate-half RoPE, GQA, no q/k bias, embedding scale 1.
RETROFITTED = {
    "block_class_name": "TransformerPreNormBlock", "rope_style": "rotate_half", "num_key_value_heads": 2,
    "qk_bias": False, "init_values": {"embed_scale": 1.0}, "tie_embeddings": False, "n_layers_in_prelude": 1,
    "n_layers_in_coda": 1, "rope_base": 10000.0,
}
VARIANTS = {"huginn": {}, "retrofitted": RETROFITTED}

# The upstream remote-code pointers of tomg-group-umd/huginn-0125's config.json.
HUB_AUTO_MAP = {
    "AutoConfig": "raven_config_minimal.RavenConfig",
    "AutoModelForCausalLM": "raven_modeling_minimal.RavenForCausalLM",
}


def tiny_huginn_config(variant: str = "huginn", **overrides) -> HuginnConfig:
    return HuginnConfig(**{**TINY, **VARIANTS[variant], **overrides})


def reference_config(config: HuginnConfig) -> dict:
    """The fields the reference reads, with defaults resolved from the spec (not from the package)."""
    c = config.to_dict()
    init = c.get("init_values") or {}
    return {
        **c,
        "head_dim": c.get("head_dim") or c["n_embd"] // c["n_heads"],
        "num_key_value_heads": c.get("num_key_value_heads") or c["n_heads"],
        "embed_scale": init.get("embed_scale", math.sqrt(c["n_embd"])),
    }


def hub_key_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Huginn checkpoint with its shape (huginn.md's key table); `lm_head.weight` only when the
    embeddings are untied."""
    emb, inter, vocab = cfg["n_embd"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv, dim = cfg["n_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    norms = 2 if cfg["block_class_name"] == "TransformerPreNormBlock" else 4
    shapes = {"transformer.wte.weight": (vocab, emb)}
    stages = (("prelude", cfg["n_layers_in_prelude"]), ("core_block", cfg["n_layers_in_recurrent_block"]),
              ("coda", cfg["n_layers_in_coda"]))
    for stage, count in stages:
        for i in range(count):
            p = f"transformer.{stage}.{i}."
            shapes |= {p + f"norm_{n}.weight": (emb,) for n in range(1, norms + 1)}
            shapes |= {
                p + "attn.Wqkv.weight": ((heads + 2 * kv) * dim, emb),
                p + "attn.proj.weight": (emb, heads * dim),
                p + "mlp.fc.weight": (2 * inter, emb),
                p + "mlp.proj.weight": (emb, inter),
            }
            if cfg["qk_bias"]:
                shapes[p + "attn.qk_bias"] = (2, 1, heads, dim)
    shapes |= {"transformer.adapter.weight": (emb, 2 * emb), "transformer.ln_f.weight": (emb,)}
    if not cfg["tie_embeddings"]:
        shapes["lm_head.weight"] = (vocab, emb)
    return shapes


def tiny_huginn(variant: str = "huginn", seed: int = 0, damp: float = 1.0, **overrides):
    """(model, state_dict): a tiny fp32 `HuginnForCausalLM` in eval mode with the package's seeded random weights
    (`hf_loopspec.bench.shapes`, the one recipe the bench shares), and a copy of them under the Hub names (checked
    against huginn.md's key table: no `lm_head.weight` when the embeddings are tied).

    `damp` < 1 makes consecutive recurrence steps agree, so drafts get accepted: the adapter keeps most of the state
    (its state half is close to the identity) and the recurrent blocks' attention and MLP outputs are scaled down.
    """
    config = tiny_huginn_config(variant, **overrides)
    model = random_model(config, seed=seed, damp=damp)
    sd = {key: value.clone() for key, value in model.state_dict().items()}
    if config.tie_word_embeddings:
        del sd["lm_head.weight"]
    assert {key: tuple(value.shape) for key, value in sd.items()} == hub_key_shapes(reference_config(config))
    return model, sd


def reference(sd: dict, input_ids: torch.Tensor, config: HuginnConfig, state: torch.Tensor, num_steps: int) -> dict:
    return huginn_reference(sd, input_ids, reference_config(config), state, num_steps)


def write_hub_folder(folder: Path, config: HuginnConfig, sd: dict, *, freqs_cis: bool = True,
                     lm_head_copy: bool = True, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Lay `folder` out like tomg-group-umd/huginn-0125: its config.json keys (upstream `auto_map`,
    `tie_embeddings`, `torch_dtype`, no `tie_word_embeddings`), model.safetensors under the Hub names with the
    persistent `freqs_cis` buffer and, for tied models, a second copy of the embedding as `lm_head.weight`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = reference_config(config)
    config_json = {
        "architectures": ["RavenForCausalLM"], "auto_map": HUB_AUTO_MAP, "model_type": "huginn_raven",
        "torch_dtype": str(dtype).removeprefix("torch."), "padding_multiple": 4096, "bias": False,
        "architecture_class_name": "RecurrentGPT", "mean_backprop_depth": 8, "effective_expected_depth": 132,
        "n_layers": cfg["n_layers_in_prelude"] + cfg["n_layers_in_recurrent_block"] + cfg["n_layers_in_coda"],
        "padded_vocab_size": cfg["vocab_size"], "tie_embeddings": cfg["tie_embeddings"],
        **{k: cfg[k] for k in ("vocab_size", "n_embd", "n_heads", "num_key_value_heads", "intermediate_size",
                               "n_layers_in_prelude", "n_layers_in_recurrent_block", "n_layers_in_coda",
                               "mean_recurrence", "block_size", "rope_base", "qk_bias", "norm_eps",
                               "block_class_name", "rope_style", "init_values", "bos_token_id", "eos_token_id",
                               "pad_token_id")},
    }
    if config_json["rope_style"] == "interleaved":
        del config_json["rope_style"]  # our switch: Huginn-0125's own config.json has no such key
    (folder / "config.json").write_text(json.dumps(config_json, indent=2))
    tensors = {k: v.to(dtype).contiguous() for k, v in sd.items()}
    if lm_head_copy and cfg["tie_embeddings"]:
        tensors["lm_head.weight"] = tensors["transformer.wte.weight"].clone()
    if freqs_cis:
        tensors["freqs_cis"] = torch.randn(cfg["block_size"], cfg["head_dim"] // 2, 2)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
