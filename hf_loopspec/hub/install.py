"""How to install hf-loopspec, as every install instruction the package writes states it (model cards, an export's
`custom_generate/requirements.txt`, the remote-code shims' error message).

The package is not published on PyPI, so the instructions install it from its repository:
`pip install "hf-loopspec @ git+<URL>"`. The URL is defined once, as `Repository` under `[project.urls]` of
pyproject.toml, and read here from the installed package's metadata (`importlib.metadata`); a source tree whose
installed metadata predates that entry (an old editable install) reads the same entry from its pyproject.toml.
"""

from __future__ import annotations

import functools
from importlib import metadata
from pathlib import Path

DISTRIBUTION = "hf-loopspec"
URL_LABEL = "Repository"
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


@functools.cache
def project_url() -> str:
    """The `Repository` URL of `[project.urls]` (module docstring); `LookupError` when neither the installed metadata
    nor the source tree's pyproject.toml has it."""
    try:
        entries = metadata.metadata(DISTRIBUTION).get_all("Project-URL") or []
    except metadata.PackageNotFoundError:
        entries = []
    for entry in entries:
        label, _, url = entry.partition(",")
        if label.strip() == URL_LABEL and url.strip():
            return url.strip()
    try:
        import tomllib  # Python 3.11+
    except ImportError:
        tomllib = None
    if tomllib is not None and PYPROJECT.is_file():
        urls = tomllib.loads(PYPROJECT.read_text(encoding="utf-8")).get("project", {}).get("urls", {})
        if urls.get(URL_LABEL):
            return urls[URL_LABEL]
    raise LookupError(f"{DISTRIBUTION} has no {URL_LABEL} URL in its metadata ([project.urls] of pyproject.toml); "
                      "reinstall the package.")


def requirement(extras: str = "") -> str:
    """The pip requirement that installs this package from its repository, e.g. `hf-loopspec @ git+https://...`;
    `extras` such as `"eval"` select optional dependencies."""
    name = f"{DISTRIBUTION}[{extras}]" if extras else DISTRIBUTION
    return f"{name} @ git+{project_url()}"


def install_command(extras: str = "") -> str:
    """`pip install "<requirement>"` (quoted for a shell)."""
    return f'pip install "{requirement(extras)}"'


__all__ = ["install_command", "project_url", "requirement"]
