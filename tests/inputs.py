"""Model inputs shared by the test files: seeded random token ids and prompts, and left padding."""

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
