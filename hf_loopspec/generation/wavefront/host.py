"""The host work of an eager wavefront step: logits processors with no tensor form, and the draft hooks.

Processors. `processing.device_processors` turns each run of consecutive processors that `processing.on_device`
does not know (transformers' row-pure ones such as `NoRepeatNGramLogitsProcessor`, `NoBadWordsLogitsProcessor`,
`SequenceBiasLogitsProcessor`, `prefix_allowed_tokens_fn`) into one `(HOST, start, stop)` plan item, in the list's
order with the device ops. Its op (`HostHooks.process`) reads the state back and runs `logits_processor[start:stop]`
(narrowed to the row: `processors.row_processors`) on each head slot whose scores the cycle may use (a live lane of
an unfinished sequence at depth U, d or d2), with that slot's own prefix as `input_ids`: the padded prompt row, the
committed tokens, then the pending lane tokens on its path up to it (the lane decoder's `_prefix`). Slower than the
device ops (a read-back and one processor call per slot and cycle), and the same scores as the lane decoder's.

Hooks. `draft_hook(seq, position, token) -> token` and `second_draft_hook(seq, position, first_token, token) -> token`
are called for each draft (second proposal) the cycle makes, with the proposal (after `draft_override` /
`second_override`); a returned token that differs is forced, a point mass when sampling (as in `decoder._draft`).

Both need the host inside the cycle, so they run in the eager step only (`compile_problem`).
"""

from __future__ import annotations

import torch

from ..processors import row_processors
from .processing import on_device


def compile_problem(processors, width: int, draft_hook, second_draft_hook) -> str | None:
    """Why a compiled step cannot run these settings (host work inside the cycle), or None."""
    names = [f"logits processor {type(p).__name__}" for p in processors or () if not on_device(p, width)]
    names += [name for name, hook in (("draft_hook", draft_hook), ("second_draft_hook", second_draft_hook)) if hook]
    if not names:
        return None
    return (f"{', '.join(names)} with compile_core (no tensor form: the engine calls it on the host in every cycle, "
            "which a compiled step cannot); drop compile_core to run it on the engine eagerly, or drop it")


class HostHooks:
    """The host work of one run (see the module docstring). `input_ids` `[B, W]` the padded prompt rows; `depths`:
    the depths whose head scores a cycle uses (U, d, d2)."""

    def __init__(self, processors, input_ids: torch.Tensor, depths: tuple[int, ...], draft_hook=None,
                 second_draft_hook=None):
        self.rows = [row_processors(processors, b) for b in range(len(input_ids))] if processors else None
        self.prompt, self.depths = input_ids, depths
        self.draft_hook, self.second_draft_hook = draft_hook, second_draft_hook

    def process(self, start: int, stop: int, s, scores: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """`scores` `[B, R, V]` of the head slots `slots` `[B, R]` after processors `start:stop`."""
        token, position, depth = s.token.tolist(), s.position.tolist(), s.depth.tolist()
        alive, finished, n_out = s.alive.tolist(), s.finished.tolist(), s.n_out.tolist()
        prompt_len = s.prompt_len.tolist()
        result = scores.clone()
        for b, row_slots in enumerate(slots.tolist()):
            if finished[b]:
                continue
            done = prompt_len[b] + n_out[b] - 1  # the position of the last committed (or prompt) token
            committed = torch.cat([self.prompt[b].to(s.out.device), s.out[b, : n_out[b]]])
            made = {}
            for r, slot in enumerate(row_slots):
                if not alive[b][slot] or depth[b][slot] not in self.depths:
                    continue
                if slot not in made:
                    here = position[b][slot]
                    pending = sorted((position[b][x], token[b][x]) for x in range(len(token[b]))
                                     if alive[b][x] and done < position[b][x] <= here)
                    prefix = torch.cat([committed, committed.new_tensor([t for _, t in pending])])
                    row = scores[b, r][None].clone()
                    for processor in self.rows[b][start:stop]:
                        row = processor(prefix[None], row)
                    made[slot] = row[0]
                result[b, r] = made[slot]
        return result

    def draft(self, has: torch.Tensor, position: torch.Tensor, token: torch.Tensor,
              forced: torch.Tensor) -> torch.Tensor:
        """`forced` `[B]` (-1: not forced) with `draft_hook`'s changes to the drafts `token` `[B]` at `position`
        `[B]` of the sequences that draft (`has` `[B]`)."""
        if self.draft_hook is None:
            return forced
        return self._hooked(has, forced, self.draft_hook, position, token)

    def second(self, has: torch.Tensor, position: torch.Tensor, first: torch.Tensor, token: torch.Tensor,
               forced: torch.Tensor) -> torch.Tensor:
        """`forced` `[B]` with `second_draft_hook`'s changes to the second proposals `token` `[B]` (the drafts there:
        `first` `[B]`)."""
        if self.second_draft_hook is None:
            return forced
        return self._hooked(has, forced, self.second_draft_hook, position, first, token)

    @staticmethod
    def _hooked(has, forced, hook, *columns) -> torch.Tensor:
        forced = forced.clone()
        values = [c.tolist() for c in columns]  # the proposal is the last column
        for b in has.nonzero().flatten().tolist():
            proposed = values[-1][b]
            hooked = int(hook(b, *(v[b] for v in values)))
            if hooked != proposed:
                forced[b] = hooked
        return forced
