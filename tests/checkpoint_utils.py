"""Tiny checkpoint folders and their word-level tokenizer for the CLI and export tests, and a snapshot of a folder
tree to prove it did not change."""

from __future__ import annotations

import os
from pathlib import Path

from helpers import TINY, tiny_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast


def word_tokenizer(vocab: int = TINY["vocab_size"], chat_template: str | None = None,
                   specials_at: int = 0, letter: str = "w") -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over a tiny model's `vocab` ids: ids `specials_at` + 0..2 are <|endoftext|>
    (eos, pad), <|im_start|> and <|im_end|>, the others words, 'w5 w9' -> [5, 9] (`letter` 'w'); with
    `chat_template` when given."""
    words = [f"{letter}{i}" for i in range(vocab)]
    words[specials_at:specials_at + 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   unk_token="<|endoftext|>")
    fast.chat_template = chat_template
    return fast


def save_checkpoint(folder: Path, seed: int = 0, tokenizer: bool = True, **overrides) -> Path:
    """Write a tiny fp32 Ouro checkpoint (model.safetensors, config, word tokenizer) to `folder`; returns it."""
    model, _ = tiny_model(seed, **overrides)
    model.save_pretrained(folder)
    if tokenizer:
        word_tokenizer().save_pretrained(folder)
    return Path(folder)


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under `root`, symlinks not followed: relative path -> ('dir',) / ('file', bytes) /
    ('link', target)."""
    entries = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            key = str(path.relative_to(root))
            if path.is_symlink():
                entries[key] = ("link", os.readlink(path))
            elif path.is_dir():
                entries[key] = ("dir",)
            else:
                entries[key] = ("file", path.read_bytes())
    return entries
