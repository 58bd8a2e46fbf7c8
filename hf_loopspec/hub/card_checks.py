"""The checks of the arguments of an export (`export.export_checkpoint` and its command) and of a model card
(`card.build_model_card`): each raises a `ValueError` that names the argument (the command's flag for the metadata),
its value and the fix, before anything is loaded, built or written. A string where a list is due (`tags="abc"`) would
otherwise be read letter by letter, a string where a bool is due (`overwrite="False"`) read as true, and settings
that `generate` refuses written into the card's example code."""

from __future__ import annotations

import math
import numbers
import re
from decimal import Decimal

from ..defaults import DTYPE_NAMES

LICENSE_ID = re.compile(r"[a-z0-9][a-z0-9.+\-]*")  # the form of the Hub's license ids (apache-2.0, openrail++, other)
LICENSE_FIX = "give one such as apache-2.0, mit or cc-by-4.0 (or 'other')"
# the form of a card's `language` as the Hub takes it: an ISO 639 code of two or three lowercase letters (en, zho), or
# "code" or "multilingual" (a BCP-47 tag such as zh-Hans belongs in `language_bcp47`)
LANGUAGE_CODE = re.compile(r"[a-z]{2,3}|code|multilingual")
SAMPLING_RANGES = {  # a card's sampling setting -> (low, high, low included): what `generate` samples with
    "temperature": (0.0, math.inf, False), "top_p": (0.0, 1.0, False), "top_k": (0, math.inf, True),
    "min_p": (0.0, 1.0, True), "repetition_penalty": (0.0, math.inf, False),
}
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")  # the ChatML tokens a chat card names with their ids
SHARD_UNITS = " KMGT"  # a shard size's decimal unit prefixes, as `save_pretrained` reads them (none: bytes)


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


def is_count(value, low: int = 1) -> bool:
    """Whether `value` is an integer >= `low` (a Python or numpy integer; a bool is no count)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= low


def check_flags(**flags) -> None:
    """`ValueError` naming the first of `flags` (name=value) that is no bool: `overwrite="False"` would read as true."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"{name}={value!r} must be True or False (a bool: a string such as 'False' would read "
                             "as true).")


def shard_size(value: str | int) -> int:
    """Bytes for a shard size: a byte count (an integer) or a text of a whole number of bytes with or without a decimal
    unit ("40KB", "2.5GB", "500MB", "1TB", as `save_pretrained` reads them); `ValueError` naming the fix otherwise
    (a bool, a float such as 2.5, a fraction of a byte)."""
    text = str(value).strip() if isinstance(value, str) or is_count(value, 0) else ""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)B?", text, flags=re.IGNORECASE)
    size = Decimal(match[1]) * 1000 ** SHARD_UNITS.index(match[2].upper() or " ") if match else Decimal(0)
    if size < 1 or size != size.to_integral_value():
        raise ValueError(f"max shard size {value!r} is not a size; pass --max-shard-size (max_shard_size) as e.g. "
                         "500MB, 2GB or a byte count (an integer).")
    return int(size)


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
        raise ValueError(f"--license {license!r} is not a Hub license id: {LICENSE_FIX}.")


def carried_metadata(data: dict, license: str | None) -> dict:
    """The metadata an export's card takes from the source card `data`, as `build_model_card` keywords: `license`
    (--license, else the source's, else apache-2.0), the source's `license_name` and `license_link` when its license
    is the one carried (not with --license), its `language` and its `datasets`. A `ValueError` when the source's
    license is used and is no Hub license id (what `--license` is checked for); a name or link that is no string, a
    language that is no language code or list of them, and datasets that are no list of strings are left out with a
    warning (the Hub refuses such a card)."""
    from ..logs import get_logger

    sources_license = license is None
    if sources_license and not is_license_id(license := data.get("license") or "apache-2.0"):
        raise ValueError(f"the source's model card has license: {license!r}, which is not a Hub license id; pass "
                         f"--license: {LICENSE_FIX}.")
    carried = {"license": license}
    for key, usable, form in (("license_name", _text, "text"), ("license_link", _text, "text"),
                              ("language", is_language, "language code (en, zho, code, multilingual) or list of them"),
                              ("datasets", _texts, "list of dataset ids (strings)")):
        value = data.get(key)
        if value is None or key.startswith("license_") and not sources_license:
            continue
        if usable(value):
            carried[key] = value
        else:
            get_logger(__name__).warning("export: the source card's %s %r is no %s: left out of the card (the Hub "
                                         "refuses it).", key, value, form)
    return carried


def _text(value) -> bool:
    """Whether `value` is a non-empty string."""
    return isinstance(value, str) and bool(value)


def _texts(value) -> bool:
    """Whether `value` is a non-empty list of non-empty strings (a card's `datasets`, as the Hub takes them)."""
    return isinstance(value, list) and bool(value) and all(map(_text, value))


def _or_none(accepts):
    """The test `accepts` that also passes None."""
    return lambda value: value is None or accepts(value)


def _token_ids(value) -> bool:
    """A token id or a non-empty list of them."""
    ids = [value] if is_count(value, 0) else value if isinstance(value, (list, tuple)) and value else [None]
    return all(is_count(id_, 0) for id_ in ids)


def _stop_strings_given(value) -> bool:
    """`generate`'s rule for `stop_strings` (`generation.inputs.stop_strings_given`), imported when a card names
    some (the export command's parser loads no torch)."""
    from ..generation.inputs import stop_strings_given

    return stop_strings_given(value)


def _chat_tokens(value) -> bool:
    """Whether `value` maps ChatML tokens (`CHATML_TOKENS`) to token ids."""
    return isinstance(value, dict) and all(token in CHATML_TOKENS and is_count(id_, 0) for token, id_ in value.items())


# a `build_model_card` argument -> (whether the card can use a value, what the message says of it after the value);
# `family`, `sampling` and `exit_options` are checked on their own, `benchmarks` by `card_speed.bench_results`, and
# what depends on the loop count by `check_loop_settings`
CARD_ARGUMENT_RULES = {
    "repo_id": (_text, ": the card needs the repo it is for (its title and code); give namespace/name"),
    "prompt": (_text, " must be a non-empty string (the prompt of the card's example code)"),
    "sampling_source": (_text, " must be a non-empty string (where the sampling settings come from)"),
    **{name: (_or_none(_text), " must be a non-empty string or None") for name in ("title", "summary", "what_it_is",
                                                                                  "source")},
    "base_model": (_or_none(_text), " must be a string or None (from export: the source card's base_model; pass "
                                    "--base-model)"),
    "license": (_or_none(is_license_id), f" is not a Hub license id: {LICENSE_FIX}, or None"),
    "language": (_or_none(is_language), " must be a language code (en, zho, code, multilingual), a non-empty list of "
                                        "them, or None"),
    "license_name": (_or_none(_text), " must be a non-empty string or None (the name of an 'other' license)"),
    "license_link": (_or_none(_text), " must be a non-empty string or None (a URL or a file of the repo)"),
    "datasets": (_or_none(_texts), " must be a non-empty list of dataset ids (strings), or None"),
    "tags": (lambda value: isinstance(value, (list, tuple)) and all(isinstance(tag, str) for tag in value),
             " must be a list of strings (e.g. ['code'])"),
    "tokenizer": (lambda value: isinstance(value, bool), " must be True or False (whether the repo ships a tokenizer)"),
    "chat": (lambda value: isinstance(value, bool), " must be True or False (whether the tokenizer has a chat "
                                                    "template)"),
    "chat_tokens": (_or_none(_chat_tokens), f" must map the ChatML tokens ({', '.join(CHATML_TOKENS)}) the tokenizer "
                                            "knows to their ids (integers >= 0); give {} for a chat template that is "
                                            "not ChatML, or None for the family's"),
    "eos_token_ids": (_or_none(_token_ids), " must be a token id (an integer >= 0), a non-empty list of them, or None"),
    "stop_strings": (_or_none(lambda value: isinstance(value, (list, tuple)) and _stop_strings_given(value)),
                     " must be a non-empty list of non-empty strings, or None"),
    "weights_dtype": (_or_none(DTYPE_NAMES.__contains__), f" must be one of {', '.join(DTYPE_NAMES)}, or None (the "
                                                          "weights as the source stores them)"),
    "max_new_tokens": (is_count, " must be an integer >= 1, as generate takes it"),
    "num_loops": (is_count, " must be an integer >= 1"),
    "kv_bytes_per_token": (_or_none(is_count), " must be an integer >= 1, or None (the family's example)"),
}


def check_card_keywords(arguments: dict, families) -> None:
    """`ValueError` for the first of `arguments` (`build_model_card` arguments by name, any subset of them) whose value
    the card cannot use, each checked on its own: a `family` that is none of `families` (the card texts), any value
    `CARD_ARGUMENT_RULES` refuses, `sampling` (credited to `sampling_source`) that is no dict of `generate`'s sampling
    settings in their ranges (`SAMPLING_RANGES`; None values are left out of the card), `exit_options` that are no
    dict of exit options choosing an exit. What depends on the loop count is `check_loop_settings`'s."""
    from ..generation.config import EXIT_OPTIONS, asks  # (here: the export command's parser loads no torch)

    family = arguments.get("family")
    if "family" in arguments and (not isinstance(family, str) or family not in families):
        raise ValueError(f"family={family!r} has no card text; choose one of {', '.join(families)}.")
    for name, value in arguments.items():
        accepts, fix = CARD_ARGUMENT_RULES.get(name, (None, None))
        if accepts is not None and not accepts(value):
            raise ValueError(f"{name}={value!r}{fix}.")
    _check_sampling(arguments.get("sampling"), arguments.get("sampling_source", "as given"))
    exit_options = arguments.get("exit_options")
    if exit_options is not None and (not isinstance(exit_options, dict) or not set(exit_options) <= set(EXIT_OPTIONS)
                                     or not all(map(asks, exit_options.values()))):
        raise ValueError(f"exit_options={exit_options!r} must be a dict of Ouro's exit options "
                         f"({', '.join(EXIT_OPTIONS)}) that choose an exit (None and False choose none: leave "
                         "them out), or None.")


def check_loop_settings(num_loops: int, exit_options: dict | None, speculative_mode, draft_loops,
                        num_speculative_tokens) -> None:
    """`ValueError` for exit options (a dict `check_card_keywords` accepts, or None) or speculative defaults that
    `generate` would refuse on a model of `num_loops` loops: the defaults are checked with plain decoding too, as the
    later `speculative_mode="auto"` call that reads them would (a 1-loop model, which cannot speculate, has none)."""
    from ..generation.config import EXIT_OPTIONS, resolve_speculative
    from ..models.ouro.modeling_ouro import check_exit_options

    if exit_options:
        check_exit_options(num_loops, *(exit_options.get(key) for key in EXIT_OPTIONS))
    if speculative_mode is not None and num_loops < 2:
        raise ValueError(f"speculative_mode={speculative_mode!r}: a model of {num_loops} loop has no shallower loop to "
                         "draft from, so generate refuses every speculative mode; pass speculative_mode=None "
                         "(hf-loopspec export: --speculative-mode none) to write plain decoding.")
    if speculative_mode is not None or num_loops > 1:  # (a falsy mode is checked as itself, not as the default)
        resolve_speculative("auto" if speculative_mode is None else speculative_mode, draft_loops,
                            num_speculative_tokens, num_loops=num_loops)


def check_card_arguments(families, **arguments) -> dict | None:
    """`sampling` as the card writes it (None values left out, numpy numbers as Python's; None for none), after a
    `ValueError` for any `build_model_card` argument (every one, by name, as its `locals()`) it cannot use:
    `check_card_keywords`, then `check_loop_settings` on the card's loop count."""
    check_card_keywords(arguments, families)
    check_loop_settings(*(arguments[name] for name in ("num_loops", "exit_options", "speculative_mode", "draft_loops",
                                                      "num_speculative_tokens")))
    written = {key: value.item() if hasattr(value, "item") else value
               for key, value in (arguments["sampling"] or {}).items() if value is not None}
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
