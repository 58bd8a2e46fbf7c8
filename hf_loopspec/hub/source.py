"""What an export starts from: `resolve_source(spec)` turns SRC ("default", a checkpoint folder or a Hub id) into a
`Source`: the path to load, whether to load from local files only, and the source's identity for the model card (its
name, its card's metadata and lead paragraphs). `card_metadata` is the metadata of the source's card that the
export's card carries, and `copy_license_files` copies the license files of a local source into the export.

A Hub id is checked before anything loads. In offline mode (`HF_HUB_OFFLINE=1`, `huggingface_hub.is_offline_mode`)
or when the Hub cannot be reached, a repo that is in the local Hub cache loads from it, and any other fails at once
with one `OSError` saying so, instead of after transformers' retries. A repo the Hub does not know fails at once too.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

HUB_TIMEOUT_S = 10.0
SAFETENSORS_FLOATS = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16"}  # header names
# the names of license files an export copies from the top of a local source folder: LICENSE, LICENCE.md,
# LICENSE-MODEL.txt, COPYING, NOTICE, ... (any case)
LICENSE_FILE = re.compile(r"(licen[cs]e|copying|notice)([-_.][\w.-]*)?", re.IGNORECASE)


@dataclass(frozen=True)
class Source:
    spec: str  # as given: "default", a folder or a Hub id
    path: str  # what `from_pretrained` loads
    name: str  # the card's title without --repo-id: the card's model_name, the Hub repo's or the folder's name
    description: str | None  # how the card's prose names weights without a Hub base model (None: generic words)
    hub_id: bool
    local_only: bool  # load with local_files_only (offline, or the Hub out of reach)
    card_data: dict = field(default_factory=dict)  # the front matter of the source's own card
    lead: str | None = None  # the paragraphs between the title and the first section of the source's card


def hub_options(local_only: bool) -> dict:
    """`from_pretrained`'s options to load from the local Hub cache only (`local_only`), its adapter lookup included:
    transformers looks for a peft `adapter_config.json` with its own options, and would retry the Hub for it."""
    return {"local_files_only": local_only, **({"adapter_kwargs": {"local_files_only": True}} if local_only else {})}


def load_dtype(path: str, local_only: bool, dtype: str | None):
    """The dtype an export loads the checkpoint at `path` in: `dtype` when one is given, else the one its weights are
    stored in (`stored_dtype`), else "auto" (config.json's)."""
    import torch

    name = dtype if dtype not in (None, "auto") else stored_dtype(path, local_only)
    return "auto" if name is None else getattr(torch, name)


def stored_dtype(path: str, local_only: bool = False) -> str | None:
    """The dtype ("float32", "bfloat16", ...) that every floating tensor of the checkpoint at `path` (a folder or a
    Hub id) is stored in, read from the headers of its safetensors files (every shard); None when they differ, are of
    another kind (float8), or a file cannot be read: then the checkpoint's config.json decides, as `dtype="auto"`
    does. (A config.json may name another dtype than the stored one: "auto" would then convert the weights.)"""
    from safetensors import safe_open
    from transformers.utils import cached_file

    from ..input_checks import SAFE_INDEX, SAFE_WEIGHTS

    kinds = set()
    try:
        index = cached_file(path, SAFE_INDEX, local_files_only=local_only,
                            _raise_exceptions_for_missing_entries=False)
        names = [SAFE_WEIGHTS] if index is None else sorted(set(json.loads(Path(index).read_text())["weight_map"]
                                                                .values()))
        for name in names:
            with safe_open(cached_file(path, name, local_files_only=local_only), framework="pt") as weights:
                kinds |= {weights.get_slice(key).get_dtype() for key in weights.keys()}  # noqa: SIM118 (no dict)
    except Exception:  # whatever fails here fails again, with its own message, when the weights load
        return None
    found = {SAFETENSORS_FLOATS.get(kind, "other") for kind in kinds if kind.startswith(("F", "BF"))}
    return found.pop() if len(found) == 1 and "other" not in found else None


def resolve_source(spec: str) -> Source:
    """The `Source` for SRC (module docstring); `OSError` for a Hub id that cannot be used now,
    `ValueError` (`hf_loopspec.loading.ModelNotAvailable`) when "default" is missing from this install."""
    if spec == "default":
        from ..loading import default_model_path

        path = str(default_model_path())
        data, lead = _card(Path(path) / "README.md")
        name = data.get("model_name") or "hf-loopspec-default"
        return Source(spec, path, name, f"{name}, the demo model embedded in the hf-loopspec package", False, False,
                      data, lead)
    if Path(spec).expanduser().exists():
        folder = Path(spec).expanduser()
        data, lead = _card(folder / "README.md")
        name = data.get("model_name") or folder.resolve().name
        return Source(spec, str(folder), name, f"the checkpoint {name}", False, False, data, lead)
    from ..input_checks import check_source

    check_source(spec)  # a path-like name that is no folder: "no such folder", before any Hub request
    local_only, data = hub_state(spec)
    lead = None
    try:
        from huggingface_hub import hf_hub_download

        readme = hf_hub_download(spec, "README.md", local_files_only=local_only)
        card_data, lead = _card(Path(readme))
        data = data or card_data
    except Exception:  # no card on the Hub (or not cached): the card says less, the export goes on
        pass
    return Source(spec, spec, spec.rsplit("/", 1)[-1], None, True, local_only, data, lead)


def hub_state(repo_id: str) -> tuple[bool, dict]:
    """(load from local files only, the repo's card metadata) for a Hub id; `OSError` when it cannot be loaded."""
    from huggingface_hub import HfApi, is_offline_mode, try_to_load_from_cache
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    from ..input_checks import check_hub_cache

    if is_offline_mode():
        check_hub_cache(repo_id)  # (not cached: refused)
        return True, {}
    cached = isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    try:
        info = HfApi().model_info(repo_id, timeout=HUB_TIMEOUT_S)
    except RepositoryNotFoundError:
        raise OSError(f"{repo_id} is not a local folder, and the Hub has no model repo of that name (a private one "
                      "needs `hf auth login`); check the folder path or the repo id.") from None
    except HfHubHTTPError:  # the Hub answered; the load reports what it refuses
        return False, {}
    except Exception as err:  # no network, DNS, proxy, timeout: the Hub is out of reach
        if cached:
            return True, {}
        reason = " ".join(str(err).split())[:200]
        raise OSError(f"{repo_id} is not a local folder, the Hub cannot be reached ({type(err).__name__}: {reason}) "
                      "and the repo is not in the local Hub cache; check the folder path, or the connection.") from None
    return False, _metadata(info.card_data) if info.card_data is not None else {}


def _card(readme: Path) -> tuple[dict, str | None]:
    """(front matter, lead paragraphs) of a model card file; ({}, None) when there is none or it does not parse."""
    if not readme.is_file():
        return {}, None
    try:
        from huggingface_hub import ModelCard

        card = ModelCard.load(readme)
    except Exception:  # a malformed source card must not stop the export
        return {}, None
    lines, lead, started = card.text.splitlines(), [], False
    for line in lines:
        if line.startswith("# ") and not started:
            started = True
            continue
        if line.startswith("#"):
            break
        lead.append(line)
    text = "\n".join(lead).strip()
    return _metadata(card.data), text or None


def _metadata(card_data) -> dict:
    """A `ModelCardData`'s front matter as a dict, with its `model_name` (the title) at the top level: a card with
    evaluation results keeps it only as `model-index`'s name."""
    data = card_data.to_dict()
    if getattr(card_data, "model_name", None):
        data["model_name"] = card_data.model_name
    return data


def license_files(source: Source) -> list[Path]:
    """The license files (`LICENSE_FILE`) at the top of a local source folder, sorted; [] for a Hub source."""
    if source.hub_id:
        return []
    return sorted(path for path in Path(source.path).iterdir() if LICENSE_FILE.fullmatch(path.name) and path.is_file())


def copy_license_files(source: Source, folder: Path) -> None:
    """Copy `license_files(source)` into `folder` (their contents: a link is followed)."""
    for path in license_files(source):
        shutil.copyfile(path, folder / path.name)


def card_metadata(source: Source, license: str | None) -> dict:
    """The metadata of the source's card that the export's card carries (`card_checks.carried_metadata`: the license
    unless `license` (--license) is given, with its name and link, the language and the datasets). A relative
    `license_link` must still lead to the license in the exported repo: for a Hub source it becomes the URL of the
    file in the source's repo; for a local folder it is kept when it names a license file the export copies
    (`copy_license_files`), else it is left out with a warning."""
    from ..logs import get_logger
    from .card_checks import carried_metadata

    carried = carried_metadata(source.card_data, license)
    link = carried.get("license_link")
    if link is None or re.match(r"[a-z][a-z0-9+.-]*://", link, flags=re.IGNORECASE):
        return carried
    name = link.removeprefix("./")
    if source.hub_id:
        carried["license_link"] = f"https://huggingface.co/{source.spec}/blob/main/{name}"
    elif name not in [path.name for path in license_files(source)]:
        get_logger(__name__).warning("export: the source card's license_link %r names no license file at the top of "
                                     "%s, which the export copies: left out of the card; give the card a URL or "
                                     "put the license file there.", link, source.path)
        del carried["license_link"]
    return carried


__all__ = ["Source", "card_metadata", "copy_license_files", "license_files", "resolve_source"]
