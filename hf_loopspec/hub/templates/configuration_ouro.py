"""Remote-code entry point for `AutoConfig.from_pretrained(..., trust_remote_code=True)`.

This file was written by `hf_loopspec.hub.export_checkpoint`. The implementation lives in the `hf-loopspec` package
(the README.md beside this file says how to install it); this shim only imports it. `OuroConfig` here is a thin
subclass of `hf_loopspec.OuroConfig`, so that transformers' remote-code bookkeeping (`register_for_auto_class`)
marks this file, not the package's class: saving a model loaded through this file copies this file again.
"""

try:  # inside `try` so that transformers' import check does not treat hf_loopspec as a hard requirement
    import hf_loopspec  # noqa: F401  (registers Ouro with the Auto classes)
    from hf_loopspec.models.ouro.configuration_ouro import OuroConfig as _LoopSpecOuroConfig
except ImportError as err:
    raise ImportError(
        "This checkpoint runs on the hf-loopspec package, which is not importable here "
        f"({type(err).__name__}: {err}). Install it with `pip install hf-loopspec` and load the model again."
    ) from err


class OuroConfig(_LoopSpecOuroConfig):
    """`hf_loopspec.OuroConfig` (see the package for the fields)."""


__all__ = ["OuroConfig"]
