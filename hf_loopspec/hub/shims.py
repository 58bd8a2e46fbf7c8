"""The remote-code shims of an Ouro repo: `configuration_ouro.py` and `modeling_ouro.py` (package data under
`templates/`), thin subclasses of the package's Ouro classes, so that `from_pretrained(repo, trust_remote_code=True)`
returns them in a process that never imported hf_loopspec. `export_checkpoint` writes them, and so does the save of
an Ouro config whose `auto_map` names them (`hf_loopspec.models.code_pointers`). This module imports no model code.
"""

from __future__ import annotations

from pathlib import Path

from .install import install_command

TEMPLATES = Path(__file__).resolve().parent / "templates"
AUTO_MAP = {
    "AutoConfig": "configuration_ouro.OuroConfig",
    "AutoModel": "modeling_ouro.OuroModel",
    "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM",
}
SHIM_FILES = ("configuration_ouro.py", "modeling_ouro.py")
SHIM_INSTALL = "pip install hf-loopspec"  # the templates' install line, replaced by `install_command()` when written
# in every shim the package has written, whatever its release (the install line and wording changed between them)
SHIM_MARKER = b"This file was written by `hf_loopspec.hub.export_checkpoint`"


def template_text(name: str) -> str:
    """The template `name` (a path under `templates/`) as it is written: with this install's install line."""
    install = install_command().replace('"', '\\"')  # it lands inside a double-quoted string of the shims
    return (TEMPLATES / name).read_text(encoding="utf-8").replace(SHIM_INSTALL, install)


def write_template(folder: Path, name: str) -> None:
    """Write the template `name` into `folder` (`template_text`)."""
    (Path(folder) / name).write_text(template_text(name), encoding="utf-8")


def is_shim(path: Path) -> bool:
    """Whether `path` is a shim the package wrote (this release or an earlier one): a file holding `SHIM_MARKER`.
    Anything else (a user's own `modeling_ouro.py`, in any encoding; a folder; an unreadable file) is not."""
    try:
        return Path(path).is_file() and SHIM_MARKER in Path(path).read_bytes()
    except OSError:
        return False
