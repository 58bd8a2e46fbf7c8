"""Hub tooling: `export_checkpoint` (a Hub-ready folder with remote-code shims, `custom_generate/` and a model card),
`build_model_card`, and the `custom_generate` entry point (`hf_loopspec.hub.custom_generate.generate`).

The names are imported lazily, so that `python -m hf_loopspec.hub.export` runs its module only once.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "build_model_card": "card",
    "export_checkpoint": "export",
    "main_export": "export",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:  # the lazy names too, for dir(), help() and tab completion
    return sorted({*globals(), *_EXPORTS})


__all__ = sorted(_EXPORTS)
