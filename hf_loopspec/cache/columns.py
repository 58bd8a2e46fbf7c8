"""The transformers view of a `PagedLoopCache`: the input columns (padding included) each plane has consumed.

transformers counts columns; the cache stores the real tokens of a sequence only. So that columns can be cut off
exactly (`crop`), the record also keeps, per sequence, which consumed columns are padding: a sequence keeps one
token per real column that remains, wherever its padding lies (a first call's left padding, a later turn's padded
suffix, padding in the middle of one call). Writers pass the attention mask of the columns they consume; generated
columns are real. Padding is rare, so the record holds the padded columns only: a decoding loop adds nothing to it.
"""

from __future__ import annotations

import bisect

import torch

__all__ = ["ConsumedColumns"]


class ConsumedColumns:
    """Per plane, the input columns consumed; per sequence, the padded columns among them (sorted)."""

    def __init__(self, num_planes: int):
        self.counts = [0] * num_planes  # [plane] columns consumed
        self.padding: list[list[int]] = []  # [sequence] padded columns, each < `recorded`, ascending

    @property
    def recorded(self) -> int:
        """The columns whose padding `padding` records: the most any plane has consumed."""
        return max(self.counts, default=0)

    def consume(self, count: int, planes, attention_mask: torch.Tensor | None = None) -> None:
        """`planes` have consumed the first `count` columns. `attention_mask` `[B, C]` marks the real tokens of the
        inputs (None, or a column past C: every token real); the padding of columns not yet recorded is read from
        it, and for a sequence new to the record, that of every column."""
        count, recorded = int(count), self.recorded
        if attention_mask is not None and count > 0:
            known, rows, width = len(self.padding), len(attention_mask), min(count, attention_mask.shape[1])
            self.padding.extend([] for _ in range(rows - known))
            history = [(known + s, c) for s, c in (attention_mask[known:, :recorded] == 0).nonzero().tolist()]
            new = [(s, recorded + c) for s, c in (attention_mask[:, recorded:width] == 0).nonzero().tolist()]
            for s, column in history + new:  # (each sequence's in ascending order: history < recorded <= new)
                self.padding[s].append(column)
        for plane in planes:
            self.counts[plane] = count

    def real(self, seq: int, columns: int) -> int:
        """The real tokens of sequence `seq` in the first `columns` columns."""
        padded = self.padding[seq] if seq < len(self.padding) else []
        return columns - bisect.bisect_left(padded, columns)

    def crop(self, keep: int) -> None:
        """Only the first `keep` columns remain consumed, in every plane."""
        self.counts = [min(count, keep) for count in self.counts]
        self.padding = [padded[: bisect.bisect_left(padded, self.recorded)] for padded in self.padding]

    def select(self, order: list[int]) -> None:
        """Sequence i becomes old sequence `order[i]` (`PagedLoopCache._select`)."""
        self.padding = [list(self.padding[s]) if s < len(self.padding) else [] for s in order]

    def fork(self, new: int, source: int) -> None:
        """Sequence `new` (a copy of `source`'s tokens) has `source`'s padding; left unrecorded as `source` is (a
        later mask gives both)."""
        if source < len(self.padding):
            self.padding.extend([] for _ in range(new + 1 - len(self.padding)))
            self.padding[new] = list(self.padding[source])

    def move(self, source: int, into: int) -> None:
        """Sequence `into` holds `source`'s tokens and `source` none (`PagedLoopCache.commit`): the padding too."""
        padded = self.padding[source] if source < len(self.padding) else []
        if into < len(self.padding) or padded:
            self.padding.extend([] for _ in range(into + 1 - len(self.padding)))
            self.padding[into] = list(padded)
        if source < len(self.padding):
            self.padding[source] = []

    def copy(self) -> ConsumedColumns:
        copied = ConsumedColumns(len(self.counts))
        copied.counts, copied.padding = list(self.counts), [list(p) for p in self.padding]
        return copied

    def __repr__(self) -> str:
        return repr(self.counts)
