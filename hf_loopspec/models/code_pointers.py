"""config.json's `auto_map` when a config of the package's own classes is saved.

A checkpoint loaded natively (an exported repo or a Hub checkpoint, after `import hf_loopspec`) keeps the `auto_map`
of its config.json, whose entries name code files ("module.Class": `module.py` beside config.json). transformers
writes code files only for remote-code classes, so a save would name files that are not there, and the folder would
fail to load for anyone following the pointers (`trust_remote_code=True`). On save, each entry keeps its code: the
file is already in the folder, or it is another Hub repo's ("repo--module.Class"), or the package writes it (a
family's `shim_references`: Ouro's remote-code shims, `hf_loopspec.hub.shims`; never over a file of that name that is
not the package's own, such as a user's `modeling_ouro.py`, which the entry then names). Any other entry is left out,
with a warning; the config in memory keeps its `auto_map`.

The shims are written (again, over the package's own shims of this or an earlier release) when `config.json` is,
inside the model's `save_pretrained`, so `push_to_hub` and `save_pretrained(..., push_to_hub=True)` upload them. A
user's own file that an entry names is theirs: uploaded as transformers uploads any file of the folder (when new or
changed since the save began). A config pushed on its own (`config.save_pretrained(..., push_to_hub=True)`) uploads
config.json alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from ..hub.shims import is_shim, write_template
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
        shims = {_module_file(ref) for refs in map(_references, kept.values()) for ref in refs
                 if ref in self.shim_references}
        written = {name for name in shims if _ours_or_missing(folder / name)}

        def resolves(ref) -> bool:  # in the package's shim only the classes it defines; else a file beside
            name = _module_file(ref)
            return ref in self.shim_references if name in written else name is None or (folder / name).is_file()

        present = {key: ref for key, ref in kept.items() if all(map(resolves, _references(ref)))}
        if written:
            folder.mkdir(parents=True, exist_ok=True)
            for name in sorted(written):  # (ours again too: a save that pushes uploads what it wrote)
                write_template(folder, name)
        if present != kept:
            logger.warning(
                "config.json's auto_map leaves out %s: they name code that is not in %s, and the package's own %s "
                "writes none but its remote-code shims; the folder loads with `import hf_loopspec`.",
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


def _module_file(reference) -> str | None:
    """The file a local class reference "module.Class" names (`module.py`); None for anything else: None (an absent
    half of a tokenizer pair) or another Hub repo's code ("repo--module.Class"), which need no file here."""
    if not isinstance(reference, str) or "--" in reference:
        return None
    return f"{reference.rsplit('.', 1)[0]}.py"


def _ours_or_missing(path: Path) -> bool:
    """Whether the package may write the shim `path`: missing, or a shim it wrote (of this release or an earlier
    one: refreshed); a file of that name that is not (e.g. a user's own `modeling_ouro.py`) is never overwritten."""
    return (not path.exists() and not path.is_symlink()) or is_shim(path)
