"""`speculative_trace` on the wavefront engine: the lane decoder's records (`records.CycleTrace`, `RowTrace`), one per
cycle, read from the state around each step (eager host reads, so a traced run reads back every cycle: R = 1).

Rows: per unfinished sequence, the prompt rows that ran (their tokens from the prompt), the lane slots that ran
(`step.select_rows`), by position, and its sibling when alive (its branch numbered in the order siblings opened, from
1, as the lane decoder numbers branches). Events, as the lane decoder emits them: per sequence, for each token the
cycle committed at position P, "accept" or "reject" of the draft that sat at P (its token; with a sibling chosen
there, "reject" then "accept_second"), then "commit"; after every sequence's verifications, "second" for each
sibling the cycle opened. With `speculative_trace="hidden"` each record holds the core call's outputs of its rows
(`WavefrontState.core_out`).
"""

from __future__ import annotations

from dataclasses import replace
from itertools import count

import torch

from ..records import CycleTrace, RowTrace
from .state import Plan, WavefrontState
from .step import select_rows

SNAPSHOT = ("token", "position", "depth", "alive", "draft", "n_out", "prompt_real", "prompt_start", "prompt_depth",
            "sib_token", "sib_position", "sib_depth", "sib_alive")  # the fields a record reads, as host lists


def traced(tracer: Tracer | None, plan: Plan, step):
    """`step` recording its cycles into `tracer` (`Tracer.wrap`), or `step` itself without one."""
    return step if tracer is None else tracer.wrap(plan, step)


class Tracer:
    """The records of one run (`cycles`), built by the steps `wrap` returns."""

    def __init__(self, input_ids: torch.Tensor, mask: torch.Tensor, hidden: bool):
        self.prompts = [row[keep].tolist() for row, keep in zip(input_ids, mask)]  # each sequence's real tokens
        self.hidden = hidden
        self.cycles: list[CycleTrace] = []
        self._idents = count(1)
        self.branch: dict[int, int] = {}  # sequence -> the branch number of its live sibling

    def wrap(self, plan: Plan, step):
        """`step` (a function `(state, noise) -> state` of one cycle) recording a `CycleTrace` per call."""

        def traced(state: WavefrontState, noise: torch.Tensor | None) -> WavefrontState:
            before = replace(state)  # the step rebinds the fields it changes
            ran, prompt_ran = (x.tolist() for x in select_rows(plan, before))
            state = step(state, noise)
            self.cycles.append(self._record(before, ran, prompt_ran, state))
            return state

        return traced

    def _record(self, before: WavefrontState, ran, prompt_ran, after: WavefrontState) -> CycleTrace:
        b_ = {name: getattr(before, name).tolist() for name in SNAPSHOT}
        a_ = {name: getattr(after, name).tolist() for name in ("n_out", "sib_alive", "sib_position", "sib_token")}
        batch, lanes = len(b_["token"]), len(b_["token"][0])
        prompts = len(b_["prompt_real"][0]) if batch else 0
        rows, index = [], []  # index: each row's row in the core call (`WavefrontState.core_out`)
        finished = before.finished.tolist()
        for b in range(batch):
            if finished[b]:
                continue
            if prompt_ran[b]:
                for p in range(prompts):
                    if b_["prompt_real"][b][p]:
                        position = b_["prompt_start"][b] + p
                        rows.append(RowTrace(b, position, b_["prompt_depth"][b], self.prompts[b][position], False))
                        index.append(batch * lanes + b * prompts + p)
            for slot in sorted((s for s in range(lanes) if ran[b][s]), key=lambda s: b_["position"][b][s]):
                rows.append(RowTrace(b, b_["position"][b][slot], b_["depth"][b][slot], b_["token"][b][slot],
                                     b_["draft"][b][slot]))
                index.append(b * lanes + slot)
            if b_["sib_alive"][b]:
                rows.append(RowTrace(b, b_["sib_position"][b], b_["sib_depth"][b], b_["sib_token"][b], True,
                                     self.branch.get(b, 0)))
                index.append(batch * (lanes + prompts) + b)
        hidden = after.core_out[torch.tensor(index, dtype=torch.long)].detach().clone() if self.hidden else None
        record = CycleTrace(rows, hidden=hidden)
        out = after.out.tolist()
        for b in range(batch):
            for j in range(b_["n_out"][b], a_["n_out"][b]):
                position, token = len(self.prompts[b]) + j, out[b][j]
                record.events += self._verdicts(b_, b, position, token)
                record.events.append(("commit", b, position, token))
        for b in range(batch):
            if a_["sib_alive"][b] and not (b_["sib_alive"][b] and b_["sib_position"][b] == a_["sib_position"][b]):
                self.branch[b] = next(self._idents)
                record.events.append(("second", b, a_["sib_position"][b], a_["sib_token"][b]))
        return record

    @staticmethod
    def _verdicts(b_: dict, b: int, position: int, token: int) -> list[tuple[str, int, int, int]]:
        """The events of the verification that committed `token` at `position` of sequence `b`: none when no draft
        sat there, else the draft's "accept" or "reject" (and "accept_second" when its sibling was chosen)."""
        slots = [s for s, (alive, p) in enumerate(zip(b_["alive"][b], b_["position"][b])) if alive and p == position]
        if not slots:
            return []
        draft = b_["token"][b][slots[0]]
        if draft == token:
            return [("accept", b, position, draft)]
        events = [("reject", b, position, draft)]
        if b_["sib_alive"][b] and b_["sib_position"][b] == position and b_["sib_token"][b] == token:
            events.append(("accept_second", b, position, token))
        return events
