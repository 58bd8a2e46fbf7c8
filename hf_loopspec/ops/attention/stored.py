"""What a cache stores for a key or value (`stored`): every write of KV, into a page pool or a transformers Cache,
goes through it, so that all decoding paths see the same KV.

A page pool holds the KV of rows that no output may depend on: drafts that verification rejects, lanes past a row's
end, rolled-back positions; a dense cache holds the KV of padding. The fast attention paths mask a position by
giving it a score of -inf, and its weight of 0 times an inf or NaN value is NaN, so a non-finite key or value
anywhere in a table read by a query would reach that query's output (the readable references, which gather only the
positions a row sees, never read it). Stored as 0, it cannot: a rejected draft whose activations overflow (fp16)
leaves the tokens of its row as plain decoding makes them. Finite values are stored unchanged.
"""

from __future__ import annotations

import torch


def stored(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` cast to the pool's `dtype`, with its non-finite entries (inf, NaN, or overflow of the cast) as 0."""
    return torch.nan_to_num(x.to(dtype), nan=0.0, posinf=0.0, neginf=0.0)
