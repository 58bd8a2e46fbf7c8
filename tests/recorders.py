"""Streamers and stopping criteria that record what `generate` hands them, shared by the test files."""

from __future__ import annotations

import torch
from transformers import StoppingCriteria
from transformers.generation.streamers import BaseStreamer


class RecordingStreamer(BaseStreamer):
    """Records every `put` value (as nested lists: shape and values, so two recordings compare with `==`) and counts
    `end` calls; a `put` after `end` fails."""

    def __init__(self):
        self.puts: list[list] = []
        self.ends = 0

    def put(self, value: torch.Tensor) -> None:
        assert self.ends == 0, "put after end"
        self.puts.append(value.tolist())

    def end(self) -> None:
        self.ends += 1


class StopAtWidth(StoppingCriteria):
    """A length stop that speculation cannot foresee: stops every row once the ids reach `width` columns; counts its
    calls."""

    def __init__(self, width: int):
        self.width, self.calls = width, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        return torch.full((input_ids.shape[0],), input_ids.shape[-1] >= self.width, dtype=torch.bool)
