"""What an export writes to `generation_config.json` (`generation_defaults`): the source's EOS, pad and sampling
settings, the export's speculative defaults in place of the source's, and the end of a ChatML turn as an EOS id
(`chatml_tokens`). Imported by `export` once transformers is loaded (the command's parser is built without it)."""

from __future__ import annotations

from ..generation.config import SPECULATIVE_KEYS
from ..generation.saved_config import check_family_keys
from ..logs import get_logger
from ..prompting import saved_stop_criterion
from .card import settle_pad
from .card_checks import CHATML_TOKENS

logger = get_logger(__name__)


def generation_defaults(model, tokenizer, speculative_mode, draft_loops, num_speculative_tokens):
    """Set on `model.generation_config` (and return it) the speculative defaults (checked before the model loaded:
    `check_loop_settings`; the source's own saved settings, its stop strings matched with `tokenizer` included, are
    checked here: `ValueError`), eos ids that end a chat turn and a pad id (`card.settle_pad`: the tokenizer's too). The
    export's defaults replace the source's speculative settings: those it has no argument for (`second_draft_loops`,
    `compile_core`, `speculative_engine`: a source saved by this package) are left out, with a warning naming them
    (kept, they could contradict the export's mode, and the card would not describe them). A 1-loop model gets only
    `speculative_mode` (None): it has no depth to draft from, so `draft_loops` and `num_speculative_tokens` are left
    out as well."""
    gen = model.generation_config
    # stop strings `generate` refuses, or the tokenizer cannot match, would fail every generate() given it (the card's
    # code); with no tokenizer shipped (the card's code loads the base model's) the value alone is checked
    try:
        saved_stop_criterion(model, tokenizer)
    except ValueError as error:
        raise ValueError(f"{str(error).replace('the checkpoint', 'the source').rstrip('.')} (for a Hub id: in a "
                         "local copy of the source).") from None
    try:  # the source's own settings that every generate() of the export would raise on
        check_family_keys(model)
    except ValueError as error:
        raise ValueError(f"the source's generation_config.json: {str(error).rstrip('.')}; correct it (for a Hub id: "
                         "in a local copy of the source).") from None
    # A config derived from config.json is saved with `_from_model_config: true`, and such a file's extra keys are
    # dropped when it is loaded: mark it as a real generation config so the speculative defaults survive.
    gen._from_model_config = False
    # a 1-loop model cannot speculate (`check_loop_settings`): it gets plain decoding and no draft settings
    written = {"speculative_mode": speculative_mode}
    if model.num_loops >= 2:
        written |= {"draft_loops": draft_loops, "num_speculative_tokens": num_speculative_tokens}
    leftover = [key for key in SPECULATIVE_KEYS if key not in written and key in vars(gen)]
    dropped = {key: getattr(gen, key) for key in leftover if getattr(gen, key) is not None}
    for key in leftover:  # (one set to None changes nothing: left out without a word)
        delattr(gen, key)
    if dropped:
        logger.warning(
            "export: the source's generation_config.json sets %s, which the export leaves out: its speculative "
            "defaults are the export's own (%s); a call on the export can still pass them to generate.",
            ", ".join(f"{key}={value!r}" for key, value in dropped.items()),
            ", ".join(f"{key}={value!r}" for key, value in written.items()))
    for key, value in written.items():
        setattr(gen, key, value)
    if gen.eos_token_id is None:
        gen.eos_token_id = model.config.eos_token_id
    end_of_turn = chatml_tokens(tokenizer).get("<|im_end|>")
    if end_of_turn is not None:  # chat models: stop at the end of the turn as well as at the end of text
        eos = [] if gen.eos_token_id is None else [gen.eos_token_id] if isinstance(gen.eos_token_id, int) \
            else list(gen.eos_token_id)
        gen.eos_token_id = eos + [end_of_turn] if end_of_turn not in eos else gen.eos_token_id
    settle_pad(gen, tokenizer, model.config.vocab_size)
    return gen


def chatml_tokens(tokenizer) -> dict[str, int]:
    """`{token: id}` of the ChatML tokens (`<|im_start|>`, `<|im_end|>`, `<|endoftext|>`) the tokenizer knows, when
    its chat template is ChatML (it writes `<|im_end|>`); else {}."""
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if not template or "<|im_end|>" not in str(template):
        return {}
    vocab = tokenizer.get_vocab()
    return {token: vocab[token] for token in CHATML_TOKENS if token in vocab}
