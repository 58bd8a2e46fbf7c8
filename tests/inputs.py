"""Model inputs shared by the test files: seeded random token ids and prompts, left padding, and a first call's
output extended by suffixes (cache continuation)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def random_ids(shape: int | tuple[int, ...], vocab: int, seed: int = 0, low: int = 3) -> torch.Tensor:
    """Seeded random token ids in [low, vocab), of `shape` (an int: one sequence); the default `low` = 3 keeps
    clear of the tiny models' special ids 0..2 (pad, bos, eos)."""
    size = (shape,) if isinstance(shape, int) else tuple(shape)
    return torch.randint(low, vocab, size, generator=torch.Generator().manual_seed(seed))


def random_prompts(seed: int, lengths: Sequence[int], vocab: int) -> list[torch.Tensor]:
    """One random prompt per length, drawn in turn from one seeded generator, ids in [1, vocab) (never the pad id
    0)."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    return [torch.randint(1, vocab, (n,), generator=gen) for n in lengths]


def left_pad(rows: Sequence[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad 1-D id tensors into `(input_ids [B, T], attention_mask [B, T])`."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = r
        mask[i, width - len(r):] = 1
    return ids, mask


def extend(sequences: torch.Tensor, mask: torch.Tensor, suffixes: Sequence[torch.Tensor], pad_id: int = 0):
    """`(ids, mask)` of the whole sequence after a first `generate` call: its output `sequences` (mask 1 on every
    generated column, as transformers extends it), then each row's suffix right-aligned, so rows get padding in the
    middle and prefixes of different lengths."""
    width = max(len(x) for x in suffixes)
    tail = torch.full((len(suffixes), width), pad_id, dtype=sequences.dtype)
    tail_mask = torch.zeros((len(suffixes), width), dtype=mask.dtype)
    for s, x in enumerate(suffixes):
        tail[s, width - len(x):], tail_mask[s, width - len(x):] = x, 1
    generated = sequences.shape[1] - mask.shape[1]
    full_mask = torch.cat([mask, torch.ones(len(mask), generated, dtype=mask.dtype), tail_mask], dim=1)
    return torch.cat([sequences, tail], dim=1), full_mask
