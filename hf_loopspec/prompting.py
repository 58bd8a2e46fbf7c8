"""What `hf-loopspec generate` and `hf-loopspec batch` share: a prompt's token ids (optionally through the
tokenizer's chat template), the check that the options fit the decoding mode, and the `generate` keyword arguments
that the command-line options stand for."""

from __future__ import annotations

import argparse
import re


class SpeculativeOnly(argparse.Action):
    """Stores an option that only speculative decoding reads, and records it in `namespace.speculative_given`
    (flag -> value) so that `check_mode_options` can name it."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.speculative_given = {**getattr(namespace, "speculative_given", {}), option_string: values}


def encode_prompt(tokenizer, text: str, chat: bool, where: str = "the prompt") -> list[int]:
    """The token ids of `text`, wrapped as one user turn in the chat template when `chat`.

    `ValueError` when `text` is not valid Unicode (bytes that were not UTF-8, as `sys.argv` carries them), when
    `chat` is asked for and the tokenizer has no template, or when `text` tokenizes to nothing (`where` names the
    prompt in the message, e.g. "prompts.jsonl, line 3"). The tokenizer's warning about a text longer than the
    model's positions is not printed: `check_positions` turns that case into an error.
    """
    check_text(text, where)
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"--chat: the tokenizer {tokenizer.name_or_path} has no chat template; drop --chat.")
        try:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                return_dict=True, tokenizer_kwargs={"verbose": False})["input_ids"]
        except Exception as err:  # the template's code failed (jinja2's errors, or a Python one of its expressions)
            raise ValueError(f"--chat: the chat template of {tokenizer.name_or_path} fails on one user message "
                             f"({type(err).__name__}: {err}); fix its template, or drop --chat.") from None
    else:
        ids = tokenizer(text, verbose=False)["input_ids"]
    if not ids:
        raise ValueError(f"{where} is empty after tokenization; give it some text.")
    return list(ids)


def check_text(text: str, where: str, escaped: bool = False) -> None:
    """`ValueError` naming `where` when `text` holds lone surrogates: the bytes of a command-line argument or file
    that were not UTF-8 (Python keeps them as surrogate escapes), which no tokenizer can encode; with `escaped`, text
    read from JSON, where they can only come from an escape such as `\\ud800` without its pair."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        char = ord(text[err.start])
        if escaped:
            raise ValueError(f"{where} holds the escape \\u{char:04x} at character {err.start}, half of a surrogate "
                             "pair (not a character); write the character itself or its whole pair.") from None
        what = f"byte 0x{char - 0xDC00:02x}" if 0xDC80 <= char <= 0xDCFF else f"lone surrogate U+{char:04X}"
        raise ValueError(f"{where} is not UTF-8 text ({what} at character {err.start}); pass it as UTF-8 (check "
                         "the terminal's locale, or convert the text with iconv).") from None


def check_mode_options(args: argparse.Namespace) -> None:
    """`ValueError` when `--mode plain` comes with an option that only speculative decoding reads, or `--mode
    pipeline` with `--num-speculative-tokens` (block mode's drafts per round; auto reads it for its block
    candidates), naming it."""
    given = getattr(args, "speculative_given", {})
    if args.mode == "pipeline" and "--num-speculative-tokens" in given:
        raise ValueError(f"--num-speculative-tokens {given['--num-speculative-tokens']} with --mode pipeline, which "
                         "drafts one token per lane and never reads it (it is block mode's drafts per round); drop "
                         "it, or pass --mode block.")
    if args.mode != "plain":
        return
    given = [f"{flag} {value}" for flag, value in given.items()]
    if given:
        raise ValueError(f"speculative-only options given with --mode plain, which decodes without them: "
                         f"{', '.join(given)}; drop them, or pass --mode block or --mode pipeline.")


SAMPLING_OFF = (("temperature", 1.0), ("top_p", 1.0), ("top_k", 0))  # the value of each option that means "off"
SAMPLING_KEYS = tuple(name for name, _ in SAMPLING_OFF)  # options only sampling reads (refused greedy unless off)


def generate_kwargs(args: argparse.Namespace, model, tokenizer) -> dict:
    """`model.generate` keyword arguments for the options of `hf-loopspec generate` / `batch`.

    `--mode auto` passes `--draft-loops` / `--num-speculative-tokens` only when given (they restrict its choice).
    `--mode plain` passes `speculative_mode=None` explicitly, so a checkpoint whose `generation_config.json` makes a
    speculative mode its default (the embedded model does) still decodes plain. Rows are padded with the generation
    config's pad id, else the tokenizer's pad (or EOS) id, when it is in the model's vocabulary (a pad token added past
    it would be fed to the model for padded and finished rows, which refuses it), else with 0. Greedy decoding without
    `--seed` of a model that draws random initial states (Huginn), unless its generation config names their seed, keys
    them with `init_seed=0`: `--compare`'s two runs and a resumed `batch` then start from the same states (each call
    would draw its own seed).
    """

    from .looped import draws_initial_states
    from .models.layers import is_integer

    kwargs = {"max_new_tokens": args.max_new_tokens, "do_sample": args.do_sample}
    sampling = SAMPLING_KEYS if args.do_sample else ()  # (greedy: each is off, or unset)
    for key in (*sampling, "repetition_penalty"):
        if getattr(args, key) is not None:
            kwargs[key] = getattr(args, key)
    if args.mode == "plain":
        kwargs["speculative_mode"] = None
    elif args.mode == "auto":  # only the settings the user gave restrict auto's candidates
        given = getattr(args, "speculative_given", {})
        kwargs.update(speculative_mode="auto", **{key: getattr(args, key) for key in ("draft_loops",
                      "num_speculative_tokens") if f"--{key.replace('_', '-')}" in given})
    else:
        kwargs.update(speculative_mode=args.mode, draft_loops=args.draft_loops,
                      num_speculative_tokens=args.num_speculative_tokens)
    if draws_initial_states(model) and not args.do_sample and args.seed is None \
            and getattr(model.generation_config, "init_seed", None) is None:
        kwargs["init_seed"] = 0
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    kwargs["pad_token_id"] = pad if is_integer(pad) and 0 <= pad < model.config.vocab_size else 0
    if tokenizer is not None:  # stop strings that a checkpoint's generation config saves are matched with it
        kwargs["tokenizer"] = tokenizer
        saved_stop_criterion(model, tokenizer)
    # a depth this model's loops refuse fails here, before `batch` makes OUT.parts, not in its first batch, whether
    # an option or the checkpoint's generation config gave it (`generate` fills the keys the options leave unset from
    # there); a Huginn checkpoint's generation config may set the recurrence steps `generate` will run (its loops)
    given = getattr(args, "speculative_given", {})  # (refused beside --mode plain: `check_mode_options`)
    check_saved_settings(model, kwargs, lambda named: [
        *(f"--{key.replace('_', '-')}" for key in named if key in ("draft_loops", "num_speculative_tokens")),
        "--mode plain" + (f" without {' and '.join(given)}" if given else "")])
    return kwargs


def check_saved_settings(model, given: dict, overrides=lambda named: ()) -> None:
    """`SavedSettingError` naming the checkpoint's generation_config.json (`model.generation_config`) for a setting of
    it that a `generate` call with the keyword arguments `given` refuses: an exit option, a recurrence setting of
    another family or a hook, which no call overrides (`saved_config.check_family_keys`), a Huginn model's recurrence
    setting that `given` does not override (`recurrence.check_saved`), or a speculative setting (`saved_refusal`),
    which the options `overrides(named)` would (the CLI's; none: serve's)."""
    from .generation.saved_config import check_family_keys
    from .models.huginn.recurrence import check_saved

    try:
        check_family_keys(model)
        if hasattr(model, "recurrence_settings"):  # Huginn: those of its recurrence settings the call reads
            check_saved(model, given)
    except ValueError as error:
        raise SavedSettingError(f"the checkpoint's generation_config.json: {str(error).rstrip('.')}; correct the "
                                "checkpoint's generation_config.json.") from None
    refused = saved_refusal(model, given)
    if refused:
        named, reason = refused[0], refused[1].rstrip(".")
        options = list(overrides(named))
        fix = f"pass {' or '.join(options)}, or correct" if options else "correct"
        raise SavedSettingError(f"the checkpoint's generation_config.json sets "
                                f"{', '.join(f'{key}={value!r}' for key, value in named.items())}, which "
                                f"{'this call' if given else 'its model'} refuses ({reason}): {fix} the checkpoint's "
                                "generation_config.json.", named)


def saved_stop_criterion(model, tokenizer):
    """transformers' `StopStringCriteria` for the `stop_strings` that the checkpoint's generation config saves (None
    when it saves none), matched with `tokenizer` as `generate` matches them: built up front, a value `generate`
    refuses (`[""]`, `[]`, `[5]`) or a tokenizer that cannot match them (one with no byte-level vocabulary, such as a
    word-level one) is a `SavedSettingError` naming the file before anything runs (`batch`: before OUT.parts), not
    `generate`'s or transformers' error from inside the first call. `tokenizer=None`: the value alone is checked."""
    from transformers import StopStringCriteria

    from .generation.inputs import stop_strings_given

    stops = getattr(model.generation_config, "stop_strings", None)
    if stops is None:
        return None
    saved = f"the checkpoint's generation_config.json sets stop_strings={stops!r}, which"
    if not stop_strings_given(stops):
        raise SavedSettingError(f"{saved} is not a non-empty string or a non-empty list of them (an empty string "
                                "would stop at once): correct the checkpoint's generation_config.json.",
                                {"stop_strings": stops})
    if tokenizer is None:
        return None
    try:
        return StopStringCriteria(tokenizer, stops)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as error:
        raise SavedSettingError(f"{saved} its tokenizer ({type(tokenizer).__name__}) cannot match "
                                f"({type(error).__name__}: {error}): drop stop_strings from the checkpoint's "
                                "generation_config.json.", {"stop_strings": stops}) from None


def check_checkpoint(spec: str, given: dict | None = None, overrides=lambda named: (), *,
                     trust_remote_code: bool = False, loaded: dict | None = None, loaded_as: str = "") -> None:
    """`check_saved_settings` on the checkpoint `spec` (a folder or Hub id) before its weights load (serve, lm-eval):
    its model built on the meta device (no memory, no weights), with the generation config it would load with (none:
    nothing to check), in which the family settings among `loaded` (the keyword arguments `from_pretrained` will get:
    exit options, recurrence settings) replace the file's, as `from_pretrained` stores them (one the model refuses:
    a `ValueError` naming `loaded_as`, where they come from); `given`, the call's own settings. A config of no looped
    family is left to the loader."""
    import torch
    from transformers import AutoConfig, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from .generation.config import EXIT_OPTIONS, RECURRENCE_OPTIONS
    from .generation.saved_config import check_family_keys, checkpoint_generation_config

    generation = checkpoint_generation_config(spec)
    if generation is None:
        return
    config = AutoConfig.from_pretrained(spec, trust_remote_code=trust_remote_code)
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if not hasattr(model_class, "exit_rule"):
        return
    family = {key: value for key, value in (loaded or {}).items() if key in (*EXIT_OPTIONS, *RECURRENCE_OPTIONS)}
    with torch.device("meta"):
        model = model_class(config)
    model.generation_config = GenerationConfig(**family)
    try:  # (checked alone: the file's own settings, which these replace, would be blamed for them)
        check_family_keys(model)
        with model.call_block(None, **{key: family.get(key) for key in model.generation_keys}):
            pass
    except ValueError as error:
        raise blamed_on(loaded_as, error) from None
    for key, value in family.items():
        setattr(generation, key, value)
    model.generation_config = generation
    try:  # (as keys of the call: not the file's, which `saved_refusal` names)
        check_saved_settings(model, {**family, **(given or {})}, overrides)
    except SavedSettingError:
        raise
    except ValueError as error:  # a speculative setting these make the model refuse: named as theirs
        if not any(names(str(error), key) for key in family):
            raise
        raise blamed_on(loaded_as, error) from None


def names(text: str, key: str) -> bool:
    """Whether the message `text` names a value of the setting `key` (`key=`, not inside a longer name:
    second_draft_loops= is no draft_loops=)."""
    return re.search(rf"(?<!\w){key}=", text) is not None


def blamed_on(source: str, error: ValueError) -> ValueError:
    """`error`'s message as the fault of the settings `source` (e.g. lm-eval's --model_args), to be corrected there."""
    return ValueError(f"{source}: {str(error).rstrip('.')}; correct {source}.")


def saved_refusal(model, given: dict) -> tuple[dict, str] | None:
    """The speculative settings of `model.generation_config` (the checkpoint's) that a `generate` call with the
    keyword arguments `given` reads and refuses (or the family's settings there, e.g. Huginn's `num_steps`, that make
    it refuse the call's speculative settings), with the reason (`speculative_config`'s message, less its advice on
    clearing a setting in the call or running it on the reference), or None when the call takes them. A key `given`
    holds is the call's own, not the checkpoint's (a refused one raises its `ValueError`); a call decoding plainly
    (`speculative_mode=None` given) reads none of them. The call's loop count is the model's (Huginn: as its
    generation config sets the steps, or `given`'s)."""
    from transformers import GenerationConfig

    from .generation.config import ONE_LOOP_ADVICE, SPECULATIVE_KEYS, UNSET_SAVED, speculative_config

    own = {key: given[key] for key in model.generation_keys if given.get(key) is not None}
    with model.call_block(model.generation_config, **own):
        loops = model.num_loops
    plain = "speculative_mode" in given and given["speculative_mode"] is None
    saved = {} if plain else {key: value for key in SPECULATIVE_KEYS if key not in given
                              and (value := getattr(model.generation_config, key, None)) is not None}
    family = {key: value for key in model.generation_keys  # (Huginn's num_steps=1: no shallower loop to draft from)
              if key not in own and (value := getattr(model.generation_config, key, None)) is not None}
    try:
        speculative_config(GenerationConfig(**saved, **{key: given[key] for key in SPECULATIVE_KEYS if key in given}),
                           loops)
    except ValueError as error:
        named = {key: value for key, value in {**saved, **family}.items() if names(str(error), key)}
        if not named:
            raise
        return named, re.sub(rf" \({re.escape(UNSET_SAVED)}\)| or None(?: \(model\.decode_with_lanes [^)]*\))?(?=\.)"
                             rf"|{re.escape(ONE_LOOP_ADVICE)}", "", str(error))  # (a value's "or None.", not "or
        # None for plain decoding"; a call of one loop's advice, which the caller's fix replaces)
    return None


class SavedSettingError(ValueError):
    """A setting of the checkpoint's generation config refused: its message names the config's `keys`, which the CLI
    does not spell as the options that would set them (the user gave none)."""

    def __init__(self, message: str, keys=()):
        super().__init__(message)
        self.keys = tuple(keys)
