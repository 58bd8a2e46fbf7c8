"""What the classes of every model family share: strict loading and saving, and the causal LM's delegation of the
`LoopedModel` protocol and the embedding accessors to its base model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from transformers import GenerationConfig, PretrainedConfig
from transformers.cache_utils import DynamicCache
from transformers.utils import find_adapter_config_file

from ..generation.cache_checks import check_one_cache
from ..generation.config import EXIT_OPTIONS, RECURRENCE_OPTIONS, SPECULATIVE_KEYS, asks
from ..generation.saved_config import (
    check_saved_settings,
    mark_user_generation_config,
    restore_speculative_keys,
    saved_generation_dict,
)
from .layers import check_labels
from .load_report import held_load_report

SIZE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size")  # named by a refused load
DOWNLOAD_KEYS = ("cache_dir", "force_download", "proxies", "local_files_only", "token", "revision", "subfolder")


UNMATCHED_ADVICE = "Check that the checkpoint belongs to this model family and has the shape its config.json says."


def untied_head_advice(model, problems: dict, kwargs: dict, source) -> str | None:
    """The advice for a load whose one missing key is the LM head's weight because the caller built the model untied
    (`tie_word_embeddings=False` given to `from_pretrained`, or in a config passed to it) for a checkpoint saved tied
    (its config.json ties the head, which is then its embedding). None otherwise: a checkpoint whose own config.json
    is untied and lacks the head is broken, and loading it tied would make a head of the embedding without a word."""
    head = model.get_output_embeddings()
    names = [name for name, weight in model.named_parameters() if head is not None and weight is head.weight]
    if model.config.tie_word_embeddings or problems != {"missing_keys": names}:
        return None
    download = {name: kwargs[name] for name in DOWNLOAD_KEYS if name in kwargs}
    try:  # (no source: `from_pretrained(None, config=..., state_dict=...)`)
        saved = None if source is None else type(model.config).from_pretrained(source, **download)
    except (OSError, ValueError):
        return None
    if saved is None or not saved.tie_word_embeddings:
        return None
    named = "tie_word_embeddings=False" + (" (or tie_embeddings=False)" if hasattr(model.config, "tie_embeddings")
                                           else "")
    return (f"The checkpoint was saved with its LM head tied to its input embedding (its config.json), and {named}, "
            "given to from_pretrained or in the config passed to it, built this model untied: load it without that, "
            f"then untie the loaded head if you need it apart: model.{names[0]} = "
            f"torch.nn.Parameter(model.{names[0]}.clone()).")


class StrictLoadingMixin:
    """Put before `PreTrainedModel` in the bases: a checkpoint that does not match the model raises, and speculative
    keys and the family's own generation keys (`generation_keys`) survive `save_pretrained` and `from_pretrained`
    (`generation.saved_config`)."""

    generation_keys: tuple[str, ...] = ()  # generation config keys the family's `generate` reads, besides ours

    def __init__(self, config, *args, **kwargs):
        family = self.config_class.model_type  # (by model type: a remote-code shim's config subclasses ours)
        if getattr(config, "model_type", None) != family:
            raise ValueError(f"config={type(config).__name__} (model_type={getattr(config, 'model_type', None)!r}): "
                             f"{type(self).__name__} needs a config of model_type={family!r} "
                             f"({self.config_class.__name__}): pass one, or load the checkpoint with "
                             "AutoModelForCausalLM.from_pretrained.")
        # The config checked itself when it was made; settings changed since (`from_pretrained`'s keyword overrides
        # are set after that, as are assignments) are checked here, before a layer is built from them.
        config.validate_architecture()
        super().__init__(config, *args, **kwargs)

    def save_pretrained(self, *args, **kwargs):
        """transformers' save, after a `ValueError` for a config edited since the model was built into one that no
        longer describes this model's modules (its `kv_layout`'s `check_built`, first: it names the setting to set
        back) or that no model can be built from (`validate_architecture`): such a save wrote a checkpoint that its own
        `from_pretrained` refuses, or loads as another model; and for a generation config whose settings the saved
        model's `generate` refuses (`check_saved_settings`)."""
        getattr(self, "kv_layout", None)  # (`check_built`)
        self.config.validate_architecture()
        self._check_tied()
        check_saved_settings(self)
        mark_user_generation_config(getattr(self, "generation_config", None),
                                    self.generation_keys)
        return super().save_pretrained(*args, **kwargs)

    def _check_tied(self) -> None:
        """`ValueError` for a head that shares its embedding's weights while `config.tie_word_embeddings` was set to
        False after building: transformers saves the shared tensor once, and the checkpoint (no `lm_head.weight`)
        is then refused by `from_pretrained`. (The reverse, an untied model set to tied, saves both tensors, which
        transformers loads untied.)"""
        head, embedding = self.get_output_embeddings(), self.get_input_embeddings()
        if self.config.tie_word_embeddings or head is None or embedding is None or head.weight is not embedding.weight:
            return
        raise ValueError("config.tie_word_embeddings=False, but this model's LM head shares its embedding's weights "
                         "(it was built tied), so the checkpoint would hold no lm_head.weight for from_pretrained to "
                         "load; set config.tie_word_embeddings back to True, or untie the head first: "
                         "model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.clone()).")

    def adjust_generation_fn(self, generation_config, from_auto_class, from_pipeline, pretrained_model_name_or_path,
                             cache_dir=None, force_download=False, proxies=None, local_files_only=False, token=None,
                             revision=None, subfolder="", trust_remote_code=None, **kwargs):
        """transformers' loading of the generation config, plus the speculative and family keys (of every family) it
        drops from a config marked `_from_model_config` (e.g. a `generation_config.json` saved by an older
        transformers version)."""
        download = {"cache_dir": cache_dir, "force_download": force_download, "proxies": proxies,
                    "local_files_only": local_files_only, "token": token, "revision": revision, "subfolder": subfolder}
        super().adjust_generation_fn(generation_config, from_auto_class, from_pipeline, pretrained_model_name_or_path,
                                     **download, trust_remote_code=trust_remote_code, **kwargs)
        if not self.can_generate() or not getattr(self.generation_config, "_from_model_config", False):
            return
        if generation_config is not None:
            saved = generation_config.to_dict()
        elif pretrained_model_name_or_path is not None:
            saved = saved_generation_dict(pretrained_model_name_or_path, **download)
        else:
            return
        # every family's keys: another family's (Huginn's num_steps in an Ouro file) is refused by `generate` as in a
        # file without the mark, instead of vanishing with it
        restore_speculative_keys(self.generation_config, saved, (*EXIT_OPTIONS, *RECURRENCE_OPTIONS))

    @classmethod
    def _check_family(cls, path, kwargs: dict, adapter: str | None = None) -> None:
        """`ValueError` when `path`'s config.json names another `model_type`, before any weight is read: transformers
        only logs a warning, then builds this family's model (at its default size) from the other family's config. A
        PEFT adapter folder (no config.json) is checked by its base model's (`adapter`: the folder, then). A call that
        passes its own `config`, or a GGUF file, is not checked; a config that cannot be read is left to transformers'
        load, which says what is missing."""
        if path is None or kwargs.get("config") is not None or kwargs.get("gguf_file"):
            return
        download = {key: kwargs[key] for key in DOWNLOAD_KEYS if key in kwargs}
        try:
            saved, _ = PretrainedConfig.get_config_dict(path, **download)
        except (OSError, ValueError):
            saved = {}
        found, expected = saved.get("model_type"), cls.config_class.model_type
        if not found and adapter is None:
            settings = find_adapter_config_file(path, **download)
            base = json.loads(Path(settings).read_text()).get("base_model_name_or_path") if settings else None
            if base:  # (transformers loads the adapter's base model, then the adapter onto it)
                cls._check_family(base, kwargs, adapter=str(path))
        elif found and found != expected:
            where = f" (the base model of the adapter {adapter})" if adapter else ""
            raise ValueError(f"{path}{where} holds a model_type={found!r} checkpoint (its config.json), which "
                             f"{cls.__name__} cannot load (it loads {expected!r}): load it with "
                             "AutoModelForCausalLM.from_pretrained, which picks the class of its family.")

    @classmethod
    def _decoding_refusal(cls, error: TypeError, args: tuple, kwargs: dict) -> ValueError | None:
        """The `ValueError` naming every `from_pretrained` keyword that only `generate` takes (a speculative key, or a
        transformers generation setting that the loaded config does not hold: `temperature`, `max_new_tokens`, ...),
        when transformers handed one to the model's `__init__` (its `error` named the first alone, and neither where
        the setting goes nor that `from_pretrained` is the wrong place); None for another TypeError. The keys the
        config does not take are the config class's own answer (`return_unused_kwargs`), or all of them beside a
        `config` object, which transformers does not update."""
        found = re.search(r"unexpected keyword argument '(\w+)'", str(error))
        settings = GenerationConfig()
        decoding = {key for key in kwargs if key in SPECULATIVE_KEYS or hasattr(settings, key)}
        if not found or found.group(1) not in decoding:
            return None
        unused = decoding
        if not isinstance(kwargs.get("config"), PretrainedConfig):
            path = args[0] if args else kwargs.get("pretrained_model_name_or_path")
            download = {key: kwargs[key] for key in DOWNLOAD_KEYS if key in kwargs}
            _, unused = cls.config_class.from_pretrained(path, return_unused_kwargs=True, **download,
                                                         **{key: kwargs[key] for key in decoding})
        given = ", ".join(f"{key}={value!r}" for key, value in kwargs.items() if key in decoding and key in unused)
        fix = ("pass them to generate(...), or set them on model.generation_config after loading (lm-eval: in "
               "--gen_kwargs, not --model_args)" if hasattr(cls, "call_block") else
               f"{cls.__name__} does not generate: load the causal LM (AutoModelForCausalLM) and pass them to its "
               "generate(...)")
        return ValueError(f"{given}: decoding settings, which generate takes and from_pretrained does not "
                          f"({cls.__name__} takes no such argument): {fix}.")

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """`PreTrainedModel.from_pretrained`, except that a checkpoint whose tensors do not match the model
        (missing, unexpected or mis-shaped keys) raises `ValueError` instead of loading half-random weights.
        `ignore_mismatched_sizes=True` keeps transformers' meaning: mis-shaped tensors are initialized afresh (e.g.
        an embedding loaded with another `vocab_size`), and only missing or unexpected keys raise. A model that
        generates takes the family's generation keys too (Huginn: `num_steps=32`; Ouro: `exit_at_step=2`, ...; e.g.
        from lm-eval's `--model_args`): they go into the loaded model's generation config, checked as `generate`
        checks them; an exit option given replaces the checkpoint's (they are alternatives)."""
        foreign = [f"{key}={kwargs[key]!r}" for key in (*EXIT_OPTIONS, *RECURRENCE_OPTIONS)
                   if key in kwargs and key not in cls.generation_keys]
        if foreign:
            raise ValueError(f"{', '.join(foreign)}: generation settings of another model family (Ouro's exit options, "
                             f"Huginn's recurrence settings); {cls.__name__} takes "
                             f"{', '.join(cls.generation_keys) or 'none'}. Drop them.")
        source = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        cls._check_family(source, kwargs)
        want_info = kwargs.pop("output_loading_info", False)
        family = {key: kwargs.pop(key) for key in cls.generation_keys if key in kwargs}
        if family and not hasattr(cls, "call_block"):
            given = ", ".join(f"{key}={value!r}" for key, value in family.items())
            raise ValueError(f"{given}: generation settings, but {cls.__name__} does not generate; load the causal "
                             "LM (AutoModelForCausalLM) for them, or pass them to its forward call.")
        fresh_mismatched = kwargs.pop("ignore_mismatched_sizes", False)
        # transformers would raise a RuntimeError for mis-shaped tensors that names no key (the details go to a
        # log report only); let it load and raise the ValueError below, which lists the keys and shapes.
        with held_load_report() as report:  # (logged unless refused below: it would call the keys initialized)
            try:
                model, info = super().from_pretrained(*args, output_loading_info=True, ignore_mismatched_sizes=True,
                                                      **kwargs)
            except TypeError as error:
                if (refusal := cls._decoding_refusal(error, args, kwargs)) is None:
                    raise
                raise refusal from None
            checked = ("missing_keys", "unexpected_keys") + (() if fresh_mismatched else ("mismatched_keys",))
            problems = {name: sorted(info.get(name) or ()) for name in checked}
            problems = {name: keys for name, keys in problems.items() if keys}
            if problems:
                report.drop()
        if problems:
            details = "; ".join(
                f"{name}: {keys[:8]}{' ...' if len(keys) > 8 else ''}" for name, keys in problems.items()
            )
            c = model.config  # (its sizes: the whole config made the message a line of over a thousand characters)
            sizes = ", ".join(f"{key}={getattr(c, key)}" for key in SIZE_KEYS if getattr(c, key, None) is not None)
            raise ValueError(
                f"The checkpoint does not match {cls.__name__} of its config ({c.model_type}: {sizes}): {details}. "
                f"{untied_head_advice(model, problems, kwargs, source) or UNMATCHED_ADVICE}"
            )
        if any(asks(family.get(key)) for key in EXIT_OPTIONS):
            for key in EXIT_OPTIONS:
                setattr(model.generation_config, key, None)
        for key, value in family.items():
            setattr(model.generation_config, key, value)
        if family:  # a bad setting raises its ValueError now (torch's generator left as it was: a block may draw)
            model.exit_rule(**{key: getattr(model.generation_config, key, None) for key in EXIT_OPTIONS})
            with torch.random.fork_rng(devices=[]), model.call_block(model.generation_config):
                pass
        return (model, info) if want_info else model


class LoopedCausalLMMixin:
    """Put first in a causal LM's bases: `num_loops`, `kv_layout`, `lane_width`, `lane_dtype`, `embed` and `core`
    are the base model's (`self.base_model`), and the output embeddings are `self.lm_head`. The class itself defines
    `head`."""

    @property
    def num_loops(self) -> int:
        return self.base_model.num_loops

    @property
    def kv_layout(self):
        return self.base_model.kv_layout

    @property
    def lane_width(self) -> int:
        return self.base_model.lane_width

    @property
    def lane_dtype(self):
        return self.base_model.lane_dtype

    def embed(self, input_ids, positions=None, sequences=None, attention=None):
        return self.base_model.embed(input_ids, positions, sequences, attention)

    def core(self, hidden, positions, attention):
        return self.base_model.core(hidden, positions, attention)

    def get_input_embeddings(self):
        return self.base_model.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.base_model.set_input_embeddings(value)

    @property
    def head_width(self) -> int:
        """V: the width of the head's logits. Read from the head module's `out_features` (an `nn.Linear`, or a
        quantized one whose `weight` is a method), else the config's `vocab_size` (a head wrapped by an adapter)."""
        width = getattr(self.lm_head, "out_features", None)
        return width if isinstance(width, int) else self.config.vocab_size

    def language_loss(self, logits, labels, kwargs: dict):
        """transformers' causal LM loss (`loss_function`, with the forward's other `kwargs`) of `logits` `[B, T, V]`
        against `labels` (`check_labels`: checked up front), or None without labels."""
        if labels is None:
            return None
        check_labels(labels, logits.shape[:2], self.config.vocab_size, kwargs.get("ignore_index", -100))
        return self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value


def one_cache(cache, past_key_values, use_cache: bool):
    """The KV cache a forward call writes: the one passed as `cache` (transformers >= 5.24) or `past_key_values`, not
    both, and a transformers `Cache` (`ValueError` naming the argument otherwise); a new `DynamicCache` when none is
    passed and `use_cache` is set, None when it is not. A cache passed with `use_cache=False` (the call's, else the
    model config's) raises `ValueError`, as it does in `generate`: the call would write into it and return none."""
    check_one_cache(cache, past_key_values)
    name, given = ("cache", cache) if cache is not None else ("past_key_values", past_key_values)
    if given is not None and not use_cache:
        raise ValueError(f"{name}: a cache given to a forward call with use_cache=False, which would write into it "
                         f"and return none; drop {name}, or pass use_cache=True.")
    return DynamicCache() if use_cache and given is None else given
