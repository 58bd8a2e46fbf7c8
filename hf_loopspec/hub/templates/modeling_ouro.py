"""Remote-code entry point for `AutoModel(ForCausalLM).from_pretrained(..., trust_remote_code=True)`.

This file was written by `hf_loopspec.hub.export_checkpoint`. The implementation lives in the `hf-loopspec` package
(the README.md beside this file says how to install it); the classes here are thin subclasses of the package's, so
`generate` takes `speculative_mode="pipeline" | "block"`, `draft_loops` and `num_speculative_tokens`.
"""

try:  # inside `try` so that transformers' import check does not treat hf_loopspec as a hard requirement
    import hf_loopspec  # noqa: F401  (registers Ouro with the Auto classes)
    from hf_loopspec.models.ouro.modeling_ouro import OuroForCausalLM as _LoopSpecOuroForCausalLM
    from hf_loopspec.models.ouro.modeling_ouro import OuroModel as _LoopSpecOuroModel
except ImportError as err:
    raise ImportError(
        "This checkpoint runs on the hf-loopspec package, which is not importable here "
        f"({type(err).__name__}: {err}). Install it with `pip install hf-loopspec` and load the model again."
    ) from err

from .configuration_ouro import OuroConfig


class OuroModel(_LoopSpecOuroModel):
    """`hf_loopspec.OuroModel`: the shared looped stack."""

    config_class = OuroConfig


class OuroForCausalLM(_LoopSpecOuroForCausalLM):
    """`hf_loopspec.OuroForCausalLM`: Ouro with its LM head and self-speculative `generate`."""

    config_class = OuroConfig


__all__ = ["OuroConfig", "OuroForCausalLM", "OuroModel"]
