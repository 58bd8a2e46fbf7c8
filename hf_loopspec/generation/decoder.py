"""The lane decoder: the readable reference of AR, block and pipeline decoding over one per-depth paged cache.

It plays the role a naive implementation plays beside a fused kernel: written to be read, one Python `Lane` per
(sequence, position) in flight, every rule stated on host objects. The tests use it as the oracle of the wavefront
engine (`generation.wavefront`, the engine `generate` runs) for tokens, counters and KV planes, and it runs the
lineage checks of a `PagedLoopCache(debug=True)`. Reach it with `model.decode_with_lanes(...)` (or through
`dispatch.SpeculativeRequest`: `LaneDecoder.from_request`); it is not an engine to choose for speed (several ms of
host work per cycle).

One cycle = one core call over the lanes the policy selects, across every sequence of the batch (rows of
mixed sequence, position and depth). After the call, in this order, per sequence:

1. Verification. A lane that reaches depth U yields the target for the next position (its logits, or those of
   the exit a call's exit options select (`ExitRule`), pass the logits processors with the committed prefix).
   If the next lane's draft passes the acceptance rule (`rules`: equal to the argmax when greedy, lossless
   speculative sampling otherwise) it is accepted and keeps running; otherwise it and its descendants
   are killed, every KV plane of the sequence is truncated to the verified prefix (I4), and a new lane starts at
   depth 0 with the target token. The target is committed: stopping criteria run, the streamer is fed, and a
   finished sequence drops all its lanes.
2. Drafting. The frontier lane that has just reached depth d proposes the next token (argmax of, or a sample
   from, the processed depth-d logits; or `draft_hook`) as a new lane at depth 0, if the policy allows it and
   the position can still matter. With second proposals (`generation.siblings`), the lanes of sibling branches
   draft too, and a main-path lane that has just reached depth d2 re-reads its draft, which may start a sibling.

The prompt enters as lanes too (one per real prompt token, all at depth 0), so prefill is U calls of P rows
and the pipeline starts drafting as soon as the last prompt token reaches depth d.

Lanes spawned in a cycle are embedded together by one `embed` call at its end. When the model's head has KV
(exit planes in `KVLayout`), every lane that reaches an exit depth in use (d when drafting, d2 with second
proposals, and U) runs the head, so the exit plane of that depth holds every position; the entry stage's plane is
written by `embed`. Rollbacks truncate every plane.

Every lane has a lineage id linked to its parent; a `PagedLoopCache(debug=True)` checks every read against it.

Sampling draws its uniforms as the wavefront engine does (`rules`: one `[B, L, 2 or 3]` draw per cycle, the lane at
position p using row p % L), so with the same seed both engines sample the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import count

import torch

from ..cache.paged import PagedLoopCache
from .call import checked_hook
from .columns import OutputColumns, stack_step
from .history import run_planes, start_rows
from .lane_rules import LaneRules
from .lanes import Lane, SequenceState
from .policies import ARPolicy, policy_for
from .processors import row_processors
from .records import CycleTrace, DecodeResult, RowTrace
from .rules import ends_row, lanes_for
from .siblings import SecondHook, SecondProposals, close_branches, path_of, promote
from .stats import SpeculationStats

DraftHook = Callable[[int, int, int], int]
"""`draft_hook(sequence, position, proposed_token) -> token`: test-only override of draft proposals."""
ExitRule = Callable[[list[torch.Tensor]], torch.Tensor]
"""`exit_rule(states) -> logits [N, V]`: the target logits of N lanes from their outputs `[N, H]` after every loop
(`states[k]`: after loop k + 1), for a call whose exit options select another exit than the last loop's head
(e.g. Ouro's `exit_at_step`); see `LoopSpecGenerationMixin.exit_rule`."""


class LaneDecoder:
    """Runs one batch to completion. See the module docstring for the cycle."""

    @classmethod
    def from_request(cls, model, request) -> LaneDecoder:
        """The reference run of a `dispatch.SpeculativeRequest`: its settings and every option it holds."""
        spec = request.spec
        return cls(model, request.cache, policy_for(spec, model.num_loops), mode=spec.mode,
                   second_draft_loops=spec.second_draft_loops, **request.options())

    def __init__(
        self,
        model,
        cache: PagedLoopCache,
        policy: ARPolicy,
        *,
        mode: str,
        input_ids: torch.Tensor,  # [B, S] left-padded
        attention_mask: torch.Tensor | None,  # [B, S] or None
        logits_processor,
        stopping_criteria,
        pad_token_id: int | None,
        max_length: int,
        streamer=None,
        draft_hook: DraftHook | None = None,
        do_sample: bool = False,
        output_scores: bool = False,
        output_logits: bool = False,
        trace: bool | str = False,
        exit_rule: ExitRule | None = None,
        complete_cache: bool = False,
        second_draft_loops: int | None = None,
        second_draft_hook: SecondHook | None = None,
    ):
        self.model, self.cache, self.policy = model, cache, policy
        self.exit_rule = exit_rule  # targets are still judged at depth U, from the exit the rule selects
        if exit_rule is not None and model.kv_layout.first_exit_plane is not None:
            raise ValueError("exit options need a head without KV of its own (the lane decoder keeps no exit plane "
                             "for the exits they select); decode with speculative_mode=None.")
        self.num_loops = model.num_loops
        self.seconds = None if second_draft_loops is None else SecondProposals(
            cache, second_draft_loops, checked_hook("second_draft_hook", second_draft_hook, model.head_width))
        has_processors = logits_processor is not None and len(logits_processor)
        self.processors = [row_processors(logits_processor, s) for s in range(len(input_ids))] \
            if has_processors else None
        self.draft_hook = checked_hook("draft_hook", draft_hook, model.head_width)
        self.do_sample = do_sample
        self.output_scores, self.output_logits = output_scores, output_logits
        self.complete_cache = complete_cache
        self.trace = [] if trace else None
        self.trace_hidden = trace == "hidden"
        self.stats = SpeculationStats(mode=mode, draft_loops=policy.draft_loops or 0)
        self._ids = count()
        self.filling = False  # completing the cache after the run (`_complete_cache`)

        self.columns = OutputColumns(input_ids, pad_token_id, max_length, stopping_criteria, streamer, output_scores)
        self.mask = attention_mask  # [B, S] or None: the padding of the prompt columns the cache consumes
        self.max_new = self.columns.max_new
        self.layout = model.kv_layout
        cache.check_pool(model.lane_dtype, input_ids.device)
        starts = start_rows(cache, self.layout, self.num_loops, policy.draft_depths,
                            input_ids, attention_mask)
        self.like = torch.empty(0, dtype=model.lane_dtype, device=input_ids.device)  # the KV dtype and device
        self.seqs = []
        for s, start in enumerate(starts):
            state = SequenceState(index=s, prompt_len=start.stored + len(start.tokens), max_new=self.max_new)
            self.stats.per_sequence.append(state.stats)
            state.lanes = self._known_lanes(s, start.stored, start.tokens, last_known=False)
            if self.max_new == 0:
                state.lanes.clear()
                state.finished = True
            self.seqs.append(state)
        self._embed_new_lanes()
        lanes = lanes_for(mode, self.num_loops, policy.draft_loops or 0, getattr(policy, "k", 0))
        self.rules = LaneRules(do_sample, len(input_ids), lanes, self.seconds is not None, input_ids.device)

    def _known_lanes(self, seq: int, stored: int, tokens: list[int], last_known: bool) -> list[Lane]:
        """Lanes for given `tokens` at positions `stored, stored + 1, ...` of `seq`, after its stored history (the
        next token of each is known, except after the last one unless `last_known`)."""
        parent = -1
        if stored:
            history = [next(self._ids) for _ in range(stored)]
            self.cache.adopt_history(seq, history)
            parent = history[-1]
        lanes = []
        for i, token in enumerate(tokens):
            lane = Lane(seq, stored + i, token, 0, None, next(self._ids),
                        next_known=last_known or i < len(tokens) - 1)
            self.cache.link_lineage(lane.lineage, parent)
            parent = lane.lineage
            lanes.append(lane)
        return lanes

    # --- the loop -----------------------------------------------------------------------------------------------
    def run(self) -> DecodeResult:
        while any(not s.finished for s in self.seqs):
            self.cycle()
            self.columns.settle(self.seqs, self._end_at)
        self.columns.settle(self.seqs, self._end_at)
        if self.complete_cache:
            self._complete_cache()
        return self._result()

    def cycle(self) -> None:
        lanes = [lane for seq in self.seqs if not seq.finished for lane in self.policy.select(seq)]
        if not self.filling:
            self.rules.new_cycle()
        hidden = torch.stack([lane.hidden for lane in lanes])  # [N, H]
        positions = [lane.position for lane in lanes]
        rows = self._rows(lanes, [lane.depth for lane in lanes])
        out = self.model.core(hidden, torch.tensor(positions, device=hidden.device), self.cache.attention(rows))
        if self.filling:
            self.stats.cache_fill_calls += 1
        else:
            self.stats.core_calls += 1
            self.stats.call_rows["core"].append(len(lanes))
        if self.trace is not None and not self.filling:
            self.trace.append(CycleTrace(
                [RowTrace(lane.seq, lane.position, lane.depth, lane.token, lane.is_draft,
                          0 if lane.branch is None else lane.branch.ident) for lane in lanes],
                hidden=out.detach().clone() if self.trace_hidden else None,
            ))
        for lane, h in zip(lanes, out):
            lane.hidden = h
            lane.depth += 1
            if self.exit_rule is not None:
                lane.states.append(h)

        targets = [lane for lane in lanes if lane.depth == self.num_loops and not lane.next_known]
        drafters = [lane for lane in lanes if self._wants_draft(lane)]
        rereaders = [] if self.seconds is None else \
            [lane for lane in lanes if self.seconds.candidate(self.seqs[lane.seq], lane)]
        if self.layout.first_exit_plane is None:
            heads = ([] if self.exit_rule is not None else targets) + drafters + rereaders
        else:  # the head writes KV: every lane reaching an exit depth in use runs it, logits needed or not
            heads = [lane for lane in lanes if lane.depth in self.policy.exit_depths]
        logits = tops = None
        if heads:
            exit_rows = None if self.layout.first_exit_plane is None else \
                self._rows(heads, [self.layout.exit_plane(lane.depth) for lane in heads])
            positions = torch.tensor([lane.position for lane in heads], device=self.like.device)
            logits = self.model.head(torch.stack([lane.hidden for lane in heads]), positions,
                                     None if exit_rows is None else self.cache.attention(exit_rows))  # fp32 [M, V]
            self.stats.call_rows["head"].append(len(heads))
            if not self.do_sample and self.processors is None:  # greedy: one compact readback per cycle
                tops = logits.argmax(-1).tolist()  # [M]
        row_of = {id(lane): i for i, lane in enumerate(heads)}  # logits: [M, V]
        for lane, (raw, top) in zip(targets, self._target_logits(targets, logits, tops, row_of)):
            self._verify(lane, raw, top)
        for lane in drafters:
            seq = self.seqs[lane.seq]
            if not seq.finished and path_of(seq, lane)[-1:] == [lane]:
                i = row_of[id(lane)]
                self._draft(lane, logits[i], None if tops is None else tops[i])
        for lane in rereaders:
            seq = self.seqs[lane.seq]
            if self.seconds.wants(seq, lane):  # alive and on the main path after this cycle's verifications
                i = row_of[id(lane)]
                self._second(seq, lane, logits[i], None if tops is None else tops[i])
        for seq in self.seqs:  # retire lanes that completed all loops
            seq.lanes = [lane for lane in seq.lanes if lane.depth < self.num_loops]
        self._embed_new_lanes()

    def _target_logits(self, targets: list[Lane], logits, tops, row_of) -> list[tuple[torch.Tensor, int | None]]:
        """Per target lane its logits `[V]` and, when read back, their argmax: from the cycle's head call, or, with an
        exit rule, from the rule over the lanes' per-loop outputs."""
        if self.exit_rule is None:
            return [(logits[row_of[id(lane)]], None if tops is None else tops[row_of[id(lane)]]) for lane in targets]
        if not targets:
            return []
        states = [torch.stack([lane.states[k] for lane in targets]) for k in range(self.num_loops)]  # U x [T, H]
        exit_logits = self.exit_rule(states).float()  # [T, V]
        exit_tops = exit_logits.argmax(-1).tolist() if not self.do_sample and self.processors is None else None
        return [(exit_logits[i], None if exit_tops is None else exit_tops[i]) for i in range(len(targets))]

    def _embed_new_lanes(self) -> None:
        """One `embed` call for every lane spawned since the last one (all sequences), through the entry plane
        when the model's entry stage has KV."""
        new = [lane for seq in self.seqs for lane in seq.live_lanes if lane.hidden is None]
        if not new:
            return
        device = self.like.device
        attention = None
        if self.layout.entry_plane is not None:
            attention = self.cache.attention(self._rows(new, [self.layout.entry_plane] * len(new)))
        hidden = self.model.embed(
            torch.tensor([lane.token for lane in new], device=device),
            torch.tensor([lane.position for lane in new], device=device),
            torch.tensor([lane.seq for lane in new], device=device),
            attention,
        )  # [n, H]
        self.stats.call_rows["embed"].append(len(new))
        for lane, h in zip(new, hidden):
            lane.hidden = h

    def _rows(self, lanes: list[Lane], planes: list[int]):
        """The rows of one call (core, entry or exit stage): lane i writes and reads plane `planes[i]`."""
        return self.cache.plan_rows([lane.slot for lane in lanes], planes, [lane.position for lane in lanes],
                                    like=self.like, lineage=[lane.lineage for lane in lanes])

    def _wants_draft(self, lane: Lane) -> bool:
        seq = self.seqs[lane.seq]
        return (not lane.next_known and path_of(seq, lane)[-1] is lane and lane.position + 1 <= seq.last_draft_position
                and self.policy.wants_draft(seq, lane))

    # --- verification and commits -------------------------------------------------------------------------------
    def _verify(self, lane: Lane, raw: torch.Tensor, top: int | None) -> None:
        """`top`: the argmax of `raw`, when greedy without processors (read back with the cycle's others)."""
        seq = self.seqs[lane.seq]
        if seq.finished or lane not in seq.lanes:
            return  # killed earlier in this cycle (block mode: after a rejection of an earlier position)
        scores = self._process(seq.index, self.columns.prefix(seq.index, len(seq.generated)), raw)
        index = seq.lanes.index(lane)
        nxt = seq.lanes[index + 1] if index + 1 < len(seq.lanes) else None
        if nxt is None:
            target = self.rules.choose(lane, scores)[0] if top is None else top
        else:
            seq.stats.verified += 1
            sibling = seq.branches.get(nxt.position)
            kept, target = self.rules.judge(lane, nxt, None if sibling is None else sibling.lanes[0], scores, top)
            nxt.is_draft = False  # verified: not counted as discarded
            self._event("accept" if kept == 1 else "reject", nxt.seq, nxt.position, nxt.token)
            if kept == 1:
                seq.stats.accepted += 1
                seq.stats.discarded += close_branches(self.cache, seq, nxt.position, nxt.position + 1)
            elif kept == 2:
                seq.stats.accepted += 1
                seq.stats.second_accepted += 1
                self._event("accept_second", nxt.seq, nxt.position, target)
                seq.stats.discarded += self._kill_from(seq, index + 1, keep_sibling=True)
                promote(self.cache, seq, sibling)
                seq.lanes[index + 1].is_draft = False
            else:
                seq.stats.rejected += 1
                seq.stats.discarded += self._kill_from(seq, index + 1)
                self._truncate(seq, lane.position + 1)
                nxt = None
        self._commit(seq, target, scores, raw)
        if not seq.finished and nxt is None:
            seq.lanes.append(self._spawn(seq, lane, target, is_draft=False))
            self.policy.restarted(seq)

    def _commit(self, seq: SequenceState, token: int, scores: torch.Tensor, raw: torch.Tensor) -> None:
        self.columns.write(seq.index, len(seq.generated), token)
        seq.generated.append(token)
        seq.stats.committed += 1
        if self.output_scores:
            seq.scores.append(scores)
        if self.output_logits:
            seq.raw_logits.append(raw)
        self._event("commit", seq.index, seq.prompt_len + len(seq.generated) - 1, token)
        # An EOS token stops its row at this column whatever the other criteria say: no need to decode on.
        if ends_row(torch.tensor(token), len(seq.generated), seq.max_new, self.columns.eos):
            self._finish(seq)

    def _end_at(self, seq: SequenceState, steps: int) -> None:
        """End `seq` with (at most) `steps` generated tokens: a row that ran ahead is cut back."""
        extra = len(seq.generated) - steps
        if extra > 0:
            seq.stats.committed -= extra
            del seq.generated[steps:], seq.scores[steps:], seq.raw_logits[steps:]
            self.columns.cut_back(seq.index, steps)
        if extra > 0 or not seq.finished:
            self._finish(seq)

    def _kill_from(self, seq: SequenceState, index: int, keep_sibling: bool = False) -> int:
        """Kill the main-path lanes `index..` of `seq` and the branches at their positions, except, with
        `keep_sibling`, the sibling of the first of them (it is being promoted); returns how many unverified
        first-proposal drafts died."""
        start = seq.lanes[index - 1].position + 1 if index else 0  # the first killed position
        killed = seq.kill_from(index)
        return killed + close_branches(self.cache, seq, start + 1 if keep_sibling else start)

    def _finish(self, seq: SequenceState) -> None:
        """Stop a sequence: drop its lanes and leave its planes as serial AR would (all but the last token)."""
        seq.stats.discarded += self._kill_from(seq, 0)
        seq.finished = True
        self._truncate(seq, seq.prompt_len + len(seq.generated) - 1)

    def _complete_cache(self) -> None:
        """Make the cache hold what plain decoding's does: every output column but the last, so a row that
        stopped early also stores its stop token and the padding after it (plain decoding feeds them); then the
        cache reports the columns it has consumed. Its calls count as `cache_fill_calls`, not `core_calls`."""
        steps = max(len(s.generated) for s in self.seqs)
        if steps == 0:
            return
        self.filling = True
        width = self.columns.prompt_width
        for seq in self.seqs:
            done = width + len(seq.generated) - 1  # the first column the row has not fed
            tokens = self.columns.ids[seq.index, done: width + steps - 1].tolist()
            if tokens:
                seq.lanes = self._known_lanes(seq.index, seq.prompt_len + len(seq.generated) - 1, tokens,
                                              last_known=True)
                seq.finished = False
        self._embed_new_lanes()
        while any(not s.finished for s in self.seqs):
            self.cycle()
            for seq in self.seqs:
                seq.finished = not seq.lanes
        self.filling = False
        self.cache.set_columns(width + steps - 1,
                               run_planes(self.layout, self.num_loops, *self.policy.draft_depths), self.mask)

    def _truncate(self, seq: SequenceState, length: int) -> None:
        """Roll every KV plane of `seq` back to at most `length` positions (I4)."""
        for plane in range(self.cache.num_planes):
            self.cache.truncate(seq.index, plane, min(length, self.cache.length(seq.index, plane)))

    # --- drafts -------------------------------------------------------------------------------------------------
    def _draft(self, lane: Lane, raw: torch.Tensor, top: int | None) -> None:
        seq = self.seqs[lane.seq]
        if self.processors is not None:
            raw = self._process(seq.index, self._prefix(seq, lane), raw)
        token, q = self.rules.choose(lane, raw, propose=True) if top is None else (top, None)
        if self.draft_hook is not None:
            hooked = int(self.draft_hook(seq.index, lane.position + 1, token))
            if q is not None and hooked != token:  # a forced proposal is a point mass: still lossless
                q = torch.nn.functional.one_hot(torch.tensor(hooked), raw.shape[-1]).to(raw)
            token = hooked
        seq.stats.drafted += 1
        self.policy.drafted(seq)
        drafted = self._spawn(seq, lane, token, is_draft=True)
        drafted.draft_q = q
        path_of(seq, lane).append(drafted)

    def _second(self, seq: SequenceState, lane: Lane, raw: torch.Tensor, top: int | None) -> None:
        """Re-read main-path `lane`'s draft from its depth-d2 logits `raw` `[V]`: their argmax (`top`, when read back
        with the cycle's others), or a sample from the processed distribution."""
        q = None
        if top is None:
            scores = self._process(seq.index, self._prefix(seq, lane), raw)
            top, q = self.rules.choose(lane, scores, propose=True)
        sibling = self.seconds.propose(seq, lane, top, q, self._spawn)
        if sibling is not None:
            self._event("second", seq.index, sibling.position, sibling.token)

    def _prefix(self, seq: SequenceState, lane: Lane) -> torch.Tensor:
        """The ids `[n]` before the token `lane` is the last of: the committed ones, then the pending tokens of the
        lanes on `lane`'s path up to it."""
        done = seq.prompt_len + len(seq.generated) - 1  # the position of the last committed token
        path = [x for x in seq.lanes if x.position <= lane.position and
                (lane.branch is None or x.position < lane.branch.position)]
        if lane.branch is not None:
            path += [x for x in lane.branch.lanes if x.position <= lane.position]
        pending = [x.token for x in path if x.position > done]
        committed = self.columns.prefix(seq.index, len(seq.generated))
        return torch.cat([committed, committed.new_tensor(pending)])

    def _spawn(self, seq: SequenceState, parent: Lane, token: int, is_draft: bool) -> Lane:
        """A new lane for `token` after `parent`, on its path; it is embedded with the other new lanes at the end of
        the cycle."""
        lane = Lane(seq.index, parent.position + 1, token, 0, None, next(self._ids), is_draft=is_draft,
                    branch=parent.branch)
        self.cache.link_lineage(lane.lineage, parent.lineage)
        return lane

    def _process(self, seq: int, prefix: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
        if self.processors is None:
            return raw
        return self.processors[seq](prefix[None], raw[None].clone())[0]

    def _event(self, kind: str, seq: int, position: int, token: int) -> None:
        if self.trace is not None:
            self.trace[-1].events.append((kind, seq, position, token))

    # --- results ----------------------------------------------------------------------------------------------
    def _result(self) -> DecodeResult:
        steps = max((len(s.generated) for s in self.seqs), default=0)
        return DecodeResult(
            sequences=self.columns.ids[:, : self.columns.prompt_width + steps],  # [B, S + steps]
            scores=tuple(self.columns.score_steps) if self.output_scores else None,
            logits=tuple(stack_step(self.seqs, "raw_logits", i) for i in range(steps)) if self.output_logits else None,
            stats=self.stats,
            trace=self.trace,
        )
