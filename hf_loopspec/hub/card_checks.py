"""The checks of a model card's arguments (`card.build_model_card`, `export.export_checkpoint` and its command): each
raises a `ValueError` that names the argument (the command's flag for the metadata), its value and the fix, before
anything is built or written. A string where a list is due (`tags="abc"`) would otherwise be read letter by letter,
and sampling settings that `generate` refuses would be written into the card's example code."""

from __future__ import annotations

import math
import numbers
import re

LICENSE_ID = re.compile(r"[a-z0-9][a-z0-9.+\-]*")  # the form of the Hub's license ids (apache-2.0, openrail++, other)
# the form of a card's `language` as the Hub takes it: an ISO 639 code of two or three lowercase letters (en, zho), or
# "code" or "multilingual" (a BCP-47 tag such as zh-Hans belongs in `language_bcp47`)
LANGUAGE_CODE = re.compile(r"[a-z]{2,3}|code|multilingual")
SAMPLING_RANGES = {  # a card's sampling setting -> (low, high, low included): what `generate` samples with
    "temperature": (0.0, math.inf, False), "top_p": (0.0, 1.0, False), "top_k": (0, math.inf, True),
    "min_p": (0.0, 1.0, True), "repetition_penalty": (0.0, math.inf, False),
}


def is_hub_repo_id(value: str) -> bool:
    """Whether `value` has the form of a Hub repo id (`huggingface_hub.utils.validate_repo_id`: `gpt2`, `org/name`),
    which a path (`./model`, `/abs/path`) has not."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


def is_license_id(value) -> bool:
    """Whether `value` has the form of a Hub license id (apache-2.0, cc-by-4.0, other)."""
    return isinstance(value, str) and LICENSE_ID.fullmatch(value) is not None


def is_language(value) -> bool:
    """Whether `value` has the form of a card's `language`: a language code (`LANGUAGE_CODE`) or a non-empty list of
    them."""
    codes = [value] if isinstance(value, str) else value if isinstance(value, list) and value else [None]
    return all(isinstance(code, str) and LANGUAGE_CODE.fullmatch(code) for code in codes)


def check_card_metadata(repo_id: str | None, base_model: str | None, license: str | None) -> None:
    """`ValueError` naming `--repo-id`, `--base-model` or `--license` when it is not what the Hub accepts there: repo
    ids as `huggingface_hub.utils.validate_repo_id` checks them (no `..`, at most one slash; the repo to create with
    its namespace), and a license id of lowercase letters, digits, dots, dashes and plus signs (openrail++)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    for flag, value in (("--repo-id", repo_id), ("--base-model", base_model)):
        if value is None:
            continue
        try:
            validate_repo_id(value)
        except HFValidationError as error:
            raise ValueError(f"{flag} {value!r} is not a Hub repo id ({error}); give namespace/name, e.g. "
                             "my-org/Ouro-1.4B-loopspec.") from None
        if flag == "--repo-id" and value.count("/") != 1:  # a repo to create needs its namespace
            raise ValueError(f"{flag} {value!r} is not a Hub repo id: give namespace/name, e.g. "
                             "my-org/Ouro-1.4B-loopspec.")
    if license is not None and not is_license_id(license):
        raise ValueError(f"--license {license!r} is not a Hub license id: give one such as apache-2.0, mit or "
                         "cc-by-4.0 (or 'other').")


def check_card_arguments(families, *, family, repo_id, base_model, license, tags, sampling, sampling_source,
                         exit_options, num_loops, speculative_mode, draft_loops, num_speculative_tokens,
                         kv_bytes_per_token, **_) -> dict | None:
    """`sampling` as the card writes it (None values left out, numpy numbers as Python's; None for none), after a
    `ValueError` for `build_model_card` arguments (passed by name, as its `locals()`) it cannot use: a `family`
    that is none of `families` (the card texts), a `repo_id` that is no text, a `base_model` or `license` that is no
    text (their Hub form is `export`'s check: `check_card_metadata` for its flags, and its own for a source card's),
    `tags` that are no list of strings, `sampling` (from `sampling_source`) that is no dict of `generate`'s
    sampling settings in their ranges (`SAMPLING_RANGES`; None values are left out of the card), exit options or
    speculative defaults that `generate` would refuse, a loop count or KV size that is no positive integer."""
    # (imported here: the export command's parser loads neither torch nor transformers)
    from ..generation.config import EXIT_OPTIONS, asks, resolve_speculative
    from ..models.ouro.modeling_ouro import check_exit_options

    if not isinstance(family, str) or family not in families:
        raise ValueError(f"family={family!r} has no card text; choose one of {', '.join(families)}.")
    if not isinstance(repo_id, str) or not repo_id:
        raise ValueError(f"repo_id={repo_id!r}: the card needs the repo it is for (its title and code); give "
                         "namespace/name.")
    for name, value in (("base_model", base_model), ("license", license)):
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{name}={value!r} must be a string or None (from export: the source card's {name}; "
                             f"pass --{name.replace('_', '-')}).")
    if isinstance(tags, str) or not isinstance(tags, (list, tuple)) or not all(isinstance(t, str) for t in tags):
        raise ValueError(f"tags={tags!r} must be a list of strings (e.g. ['code']).")
    _check_sampling(sampling, sampling_source)
    for name, value in (("num_loops", num_loops), ("kv_bytes_per_token", kv_bytes_per_token)):
        if (value is not None or name == "num_loops") and (not isinstance(value, numbers.Integral)
                                                           or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name}={value!r} must be an integer >= 1.")
    if exit_options is not None:
        if not isinstance(exit_options, dict) or not set(exit_options) <= set(EXIT_OPTIONS) \
                or not all(map(asks, exit_options.values())):
            raise ValueError(f"exit_options={exit_options!r} must be a dict of Ouro's exit options "
                             f"({', '.join(EXIT_OPTIONS)}) that choose an exit (None and False choose none: leave "
                             "them out), or None.")
        check_exit_options(num_loops, *(exit_options.get(key) for key in EXIT_OPTIONS))
    if speculative_mode is not None or num_loops > 1:  # (the checks `export` runs on the defaults it writes)
        resolve_speculative(speculative_mode or "auto", draft_loops, num_speculative_tokens, num_loops=num_loops)
    written = {key: value.item() if hasattr(value, "item") else value for key, value in (sampling or {}).items()
               if value is not None}
    return written or None


def _check_sampling(sampling, source: str) -> None:
    if sampling is None:
        return
    if not isinstance(sampling, dict):
        raise ValueError(f"sampling={sampling!r} must be a dict of sampling settings (e.g. {{'temperature': 0.7, "
                         "'top_p': 0.9}) or None.")
    for key, value in sampling.items():
        if key not in SAMPLING_RANGES:
            raise ValueError(f"sampling ({source}): {key!r} is not one of the card's sampling settings "
                             f"({', '.join(SAMPLING_RANGES)}).")
        low, high, closed = SAMPLING_RANGES[key]
        number = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
        if value is not None and (not number or not (low <= value if closed else low < value) or value > high
                                  or key == "top_k" and not isinstance(value, numbers.Integral)):
            where = (f">= {low:g}" if closed else f"> {low:g}") if high == math.inf else \
                (f"in [{low:g}, {high:g}]" if closed else f"in ({low:g}, {high:g}]")
            raise ValueError(f"sampling ({source}): {key}={value!r} must be "
                             f"{'an integer' if key == 'top_k' else 'a number'} {where}, as generate takes it.")
