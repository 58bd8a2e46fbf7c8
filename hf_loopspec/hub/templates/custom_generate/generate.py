"""`custom_generate` entry point: hf-loopspec's self-speculative decoding for Ouro (looped) models.

    model.generate(**inputs, custom_generate="<this repo or folder>", trust_remote_code=True,
                   speculative_mode="pipeline", draft_loops=1, max_new_tokens=128)

works on any model whose weights are an Ouro checkpoint's, whichever class loaded it: a model that is not an
`hf_loopspec` model is wrapped in an `hf_loopspec.OuroForCausalLM` that shares its parameters (no copy). All
`generate` arguments keep their meaning (streamer, stopping criteria, logits processors, ...). This file was
written by `hf_loopspec.hub.export_checkpoint`; the logic is `hf_loopspec.hub.custom_generate.generate`.
"""

try:  # inside `try` so that transformers' import check does not treat hf_loopspec as a hard requirement
    from hf_loopspec.hub.custom_generate import generate as _loopspec_generate
except ImportError as err:
    raise ImportError(
        "This custom_generate strategy runs on the hf-loopspec package, which is not importable here "
        f"({type(err).__name__}: {err}). Install it with `pip install hf-loopspec`."
    ) from err


def generate(*args, model, **kwargs):
    """`model.generate(*args, **kwargs)` through hf-loopspec (see the module docstring)."""
    return _loopspec_generate(model, *args, **kwargs)
