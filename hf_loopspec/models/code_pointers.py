"""config.json's `auto_map` when a config of the package's own classes is saved.

A checkpoint loaded natively (an exported repo or a Hub checkpoint, after `import hf_loopspec`) keeps the `auto_map`
of its config.json, whose entries name code files ("module.Class": `module.py` beside config.json). transformers
writes code files only for remote-code classes, so a save would name files that are not there, and the folder would
fail to load for anyone following the pointers (`trust_remote_code=True`). On save, each entry keeps its code: the
file is already in the folder, or it is another Hub repo's ("repo--module.Class"), or the package writes it (a
family's `shim_references`: Ouro's remote-code shims, `hf_loopspec.hub.shims`). Any other entry is left out, with a
warning; the config in memory keeps its `auto_map`.

The shims are written when `config.json` is, inside the model's `save_pretrained`, so `push_to_hub` uploads them. (A
config pushed on its own with `config.save_pretrained(..., push_to_hub=True)` uploads the shims only when they are
new to the folder's timestamps: write into a fresh folder.)
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from ..hub.shims import SHIM_FILES, write_template
from ..logs import get_logger

logger = get_logger(__name__)


class CodePointersMixin:
    """Put before `PreTrainedConfig` in a family config's bases (see the module docstring)."""

    shim_references: ClassVar[frozenset[str]] = frozenset()  # `auto_map` references whose code the package writes

    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs):
        kept = getattr(self, "auto_map", None)
        if not kept or type(self)._auto_class is not None:  # remote code: transformers copies its own files
            return super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)
        folder = Path(save_directory)
        written = {ref for refs in map(_references, kept.values()) for ref in refs
                   if ref in self.shim_references and not _is_beside(ref, folder)}
        present = {key: ref for key, ref in kept.items()
                   if all(_is_beside(r, folder) or r in written for r in _references(ref))}
        if written:
            folder.mkdir(parents=True, exist_ok=True)
            for name in SHIM_FILES:
                write_template(folder, name)
        if present != kept:
            logger.warning(
                "config.json's auto_map leaves out %s: they name code files that are not in %s, and the package's "
                "own %s writes none; the folder loads with `import hf_loopspec`.",
                {key: kept[key] for key in kept if key not in present}, folder, type(self).__name__)
        if present:
            self.auto_map = present
        else:
            del self.auto_map  # no key at all: transformers reads a null auto_map as a mapping
        try:
            return super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)
        finally:
            self.auto_map = kept


def _references(value) -> list:
    """The class references of one `auto_map` entry: a string, or a (slow, fast) tokenizer pair."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _is_beside(reference, folder: Path) -> bool:
    """Whether a class reference resolves without a file in `folder` that is not there: None (an absent half of a
    tokenizer pair), another Hub repo's code ("repo--module.Class"), or `module.py` present in `folder`."""
    if not isinstance(reference, str) or "--" in reference:
        return True
    return (folder / f"{reference.rsplit('.', 1)[0]}.py").is_file()
