"""Speculative keys through `save_pretrained` / `from_pretrained`.

transformers drops every non-standard key of a generation config marked `_from_model_config` (as a default config
derived from `config.json` is, and as files saved by older transformers versions are) when it builds the
`GenerationConfig`. The speculative keys are non-standard, and so are a family's own (`extra_keys`: Huginn's
recurrence settings, `num_steps`, `init_scale`, `init_seed`; Ouro's exit options), so:

* `mark_user_generation_config` unmarks a config that carries such keys before it is saved;
* `restore_speculative_keys` puts back the keys that a loaded `generation_config.json` (or a `generation_config`
  passed to `from_pretrained`) carried but transformers dropped, the `RUNTIME_KEYS` (a hook, a trace) included, so
  that `generate` refuses those as it refuses them in any other generation config instead of never seeing them;
* `check_family_keys` refuses what every `generate` would refuse among a checkpoint's non-standard keys other than
  the speculative ones (export and serve check those before they write or serve anything);
* `check_saved_settings` refuses, before `save_pretrained` writes, a generation config that those checks or the
  speculative ones refuse on a call of the saved model that passes no settings of its own;
* `checkpoint_generation_config` reads a checkpoint's generation config as its model loads it, without the model.
"""

from __future__ import annotations

import json

from transformers import GenerationConfig
from transformers.utils import GENERATION_CONFIG_NAME, cached_file

from ..logs import get_logger
from .call import RUNTIME_KEYS, reject_configured_runtime_keys
from .config import EXIT_OPTIONS, SPECULATIVE_KEYS, check_generation_mode, reject_recurrence_options, speculative_config
from .inputs import check_token_settings

logger = get_logger(__name__)


def mark_user_generation_config(generation_config, extra_keys: tuple[str, ...] = ()) -> None:
    """Keep speculative keys (and the family's `extra_keys`) set on a model's default generation config through
    `save_pretrained`: once such keys are set, the config is the user's own, not one derived from `config.json`."""
    if generation_config is not None and any(getattr(generation_config, k, None) is not None
                                             for k in (*SPECULATIVE_KEYS, *extra_keys)):
        generation_config._from_model_config = False


def restore_speculative_keys(target: GenerationConfig, saved: dict, extra_keys: tuple[str, ...] = ()) -> None:
    """Set on `target` the speculative keys (and the family's `extra_keys`) of `saved` (a generation config's dict)
    that it lacks; a config that then carries them is the user's own (`_from_model_config` False), so later saves
    and `generate` keep them."""
    restored = {key: saved[key] for key in (*SPECULATIVE_KEYS, *RUNTIME_KEYS, *extra_keys)
                if saved.get(key) is not None and getattr(target, key, None) is None}
    for key, value in restored.items():
        setattr(target, key, value)
    if restored:
        target._from_model_config = False


def saved_generation_dict(path, **download_kwargs) -> dict:
    """The raw `generation_config.json` of a checkpoint (`{}` when it has none or it cannot be read)."""
    try:
        resolved = cached_file(path, GENERATION_CONFIG_NAME, _raise_exceptions_for_missing_entries=False,
                               _raise_exceptions_for_connection_errors=False, **download_kwargs)
        if resolved is None:
            return {}
        with open(resolved, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as error:
        logger.warning("hf_loopspec could not read %s of %s to restore its speculative keys (%s); decoding uses "
                       "the generation config transformers loaded.", GENERATION_CONFIG_NAME, path, error)
        return {}


def check_family_keys(model) -> None:
    """`ValueError` for a setting of `model.generation_config` that every `generate` of `model` refuses: a hook or
    trace (`RUNTIME_KEYS`), which only a call passes; Huginn's recurrence settings on a family without them; exit
    options the family refuses, or an invalid one (a Huginn model's own recurrence settings are checked as
    `model.call_block` opens them)."""
    config = model.generation_config
    reject_configured_runtime_keys(config)
    if not hasattr(model, "recurrence_settings"):
        reject_recurrence_options(type(model).__name__, vars(config))
    model.exit_rule(**{key: getattr(config, key) for key in EXIT_OPTIONS if getattr(config, key, None) is not None})


def check_saved_settings(model) -> None:
    """`ValueError` for a setting of `model.generation_config` that a `generate` call of the saved model passing
    none of its own would refuse: `check_family_keys`'s, a forced token id outside the vocabulary, and, when the
    config sets a `speculative_mode`, the speculative keys at the loop count the config sets (Huginn: its
    `num_steps`) and the strategies the mode does not combine with (beams, contrastive search, ...). Without it
    `save_pretrained` wrote a checkpoint whose first call failed on its loaded config. A model that does not generate
    (a base model) has nothing to check."""
    config = getattr(model, "generation_config", None)
    if config is None or not model.can_generate():
        return
    try:
        check_family_keys(model)
        check_token_settings(config, 1, model.config.vocab_size)  # (forced ids: one row feeds no pad)
        with model.call_block(config):
            mode = getattr(config, "speculative_mode", None)
            spec = None if mode is None else speculative_config(config, model.num_loops)
        if spec is not None:  # (without a mode a call ignores the other speculative keys: "plain means plain")
            check_generation_mode(spec, config.get_generation_mode(), config, None)
    except ValueError as error:
        raise ValueError(f"model.generation_config: {str(error).rstrip('.')}; the saved model's generate would "
                         "refuse it: set a valid value (or None) on model.generation_config before saving.") from None


def checkpoint_generation_config(spec: str):
    """The generation config a model loads with from the checkpoint `spec` (None without one): with the package's
    keys a file marked `_from_model_config` carries, which transformers drops and the model restores."""
    from .config import EXIT_OPTIONS, RECURRENCE_OPTIONS

    try:
        config = GenerationConfig.from_pretrained(spec)
    except OSError:
        return None
    if getattr(config, "_from_model_config", False):
        restore_speculative_keys(config, saved_generation_dict(spec), (*EXIT_OPTIONS, *RECURRENCE_OPTIONS))
    return config
