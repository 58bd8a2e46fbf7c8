"""Helpers of the Ouro tests: tiny configs, tiny models with Hub-named weights, the reference, Hub-like folders."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from ouro_reference import ouro_reference
from safetensors.torch import save_file

from hf_loopspec import OuroConfig
from hf_loopspec.bench.shapes import random_model

VOCAB = 101
TINY = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "total_ut_steps": 4,
    "max_position_embeddings": 256,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 0,
}

# The upstream remote-code pointers found in the real checkpoints' config.json.
HUB_AUTO_MAP = {
    "AutoConfig": "configuration_ouro.OuroConfig",
    "AutoModel": "modeling_ouro.OuroModel",
    "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM",
}


def tiny_config(**overrides) -> OuroConfig:
    """A tiny Ouro config (vocab 101, hidden 64, 2 layers, 4 heads, U = 4); keyword arguments override fields."""
    return OuroConfig(**{**TINY, **overrides})


def hub_key_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of an Ouro checkpoint with its shape, from ouro.md's key table (Hub names)."""
    hid, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q_out = cfg["num_attention_heads"] * cfg["head_dim"]
    kv_out = cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes = {"model.embed_tokens.weight": (vocab, hid)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q_out, hid),
            p + "self_attn.k_proj.weight": (kv_out, hid),
            p + "self_attn.v_proj.weight": (kv_out, hid),
            p + "self_attn.o_proj.weight": (hid, q_out),
            p + "mlp.gate_proj.weight": (inter, hid),
            p + "mlp.up_proj.weight": (inter, hid),
            p + "mlp.down_proj.weight": (hid, inter),
            p + "input_layernorm.weight": (hid,),
            p + "input_layernorm_2.weight": (hid,),
            p + "post_attention_layernorm.weight": (hid,),
            p + "post_attention_layernorm_2.weight": (hid,),
        }
    shapes |= {
        "model.norm.weight": (hid,),
        "model.early_exit_gate.weight": (1, hid),
        "model.early_exit_gate.bias": (1,),
        "lm_head.weight": (vocab, hid),
    }
    return shapes


def config_values(config) -> dict:
    """Plain dict of a config's fields (an `OuroConfig` or a dict), with `head_dim` filled in."""
    values = dict(config) if isinstance(config, dict) else config.to_dict()
    if values.get("head_dim") is None:
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
    if values.get("num_key_value_heads") is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    values.setdefault("rope_theta", 1e6)
    values.setdefault("rms_norm_eps", 1e-6)
    return values


def tiny_model(seed: int = 0, gate_scale: float = 1.0, **overrides):
    """(model, state_dict): a tiny fp32 `OuroForCausalLM` in eval mode with the package's seeded random weights
    (`hf_loopspec.bench.shapes`, the one recipe the bench shares: matrices std 1/sqrt(fan_in), so that activations
    and logits are O(1) and argmaxes well separated; norm weights 1 + noise, so that a swapped or skipped norm
    shows; the exit gate `gate_scale` times the matrix recipe), and a copy of them under the Hub key names (checked
    against ouro.md's key table) for the independent reference and Hub-like folders."""
    config = tiny_config(**overrides)
    model = random_model(config, seed=seed, gate_scale=gate_scale)
    sd = {key: value.clone() for key, value in model.state_dict().items()}
    assert {key: tuple(value.shape) for key, value in sd.items()} == hub_key_shapes(config_values(config))
    return model, sd


def reference(sd: dict, input_ids: torch.Tensor, config) -> dict:
    """The independent reference (tests/ouro_reference.py) on Hub-named weights and one unpadded batch."""
    return ouro_reference({k: v.float() for k, v in sd.items()}, input_ids, config_values(config))


def write_hub_folder(folder: Path, config, sd: dict, dtype: torch.dtype = torch.bfloat16,
                     extra_config: dict | None = None) -> Path:
    """Lay out `folder` like the Hub repo of an Ouro checkpoint (config.json with `architectures`, the upstream
    `auto_map` and `torch_dtype`, model.safetensors under the Hub key names, generation_config.json), without
    any Python file."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = config_values(config)
    config_json = {
        "architectures": ["OuroForCausalLM"],
        "auto_map": HUB_AUTO_MAP,
        "model_type": "ouro",
        "torch_dtype": str(dtype).removeprefix("torch."),
        "hidden_act": "silu",
        "rope_scaling": None,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "early_exit_threshold": 1.0,
        "layer_types": ["full_attention"] * cfg["num_hidden_layers"],
        **{k: cfg[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads", "num_key_value_heads", "head_dim", "total_ut_steps",
                               "max_position_embeddings", "rope_theta", "rms_norm_eps", "bos_token_id",
                               "eos_token_id", "pad_token_id")},
        **(extra_config or {}),
    }
    (folder / "config.json").write_text(json.dumps(config_json, indent=2))
    generation = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
                  "pad_token_id": cfg["pad_token_id"], "do_sample": False}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))
    save_file({k: v.to(dtype).contiguous() for k, v in sd.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    return folder
