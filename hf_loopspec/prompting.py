"""What `hf-loopspec generate` and `hf-loopspec batch` share: a prompt's token ids (optionally through the
tokenizer's chat template) and the `generate` keyword arguments that the command-line options stand for."""

from __future__ import annotations

import argparse


def encode_prompt(tokenizer, text: str, chat: bool, where: str = "the prompt") -> list[int]:
    """The token ids of `text`, wrapped as one user turn in the chat template when `chat`.

    `ValueError` when `chat` is asked for and the tokenizer has no template, or when `text` tokenizes to nothing
    (`where` names the prompt in the message, e.g. "prompts.jsonl, line 3").
    """
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"--chat: the tokenizer {tokenizer.name_or_path} has no chat template; drop --chat.")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_dict=True)["input_ids"]
    else:
        ids = tokenizer(text)["input_ids"]
    if not ids:
        raise ValueError(f"{where} is empty after tokenization; give it some text.")
    return list(ids)


def generate_kwargs(args: argparse.Namespace, model, tokenizer) -> dict:
    """`model.generate` keyword arguments for the options of `hf-loopspec generate` / `batch`.

    `--mode plain` passes `speculative_mode=None` explicitly, so a checkpoint whose `generation_config.json` makes a
    speculative mode its default (the embedded model does) still decodes plain. A model without a pad id gets the
    tokenizer's pad (or EOS) id, else 0.
    """
    kwargs = {"max_new_tokens": args.max_new_tokens, "do_sample": args.do_sample}
    for key in ("temperature", "top_k", "top_p", "repetition_penalty"):
        if getattr(args, key) is not None:
            kwargs[key] = getattr(args, key)
    if args.mode == "plain":
        kwargs["speculative_mode"] = None
    else:
        kwargs.update(speculative_mode=args.mode, draft_loops=args.draft_loops,
                      num_speculative_tokens=args.num_speculative_tokens)
    if model.generation_config.pad_token_id is None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        kwargs["pad_token_id"] = pad if pad is not None else 0
    return kwargs
