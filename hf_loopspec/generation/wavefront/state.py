"""The wavefront engine's state: one flat dataclass of fixed-shape tensors on the model's device.

Shapes: B sequences, L lane slots per sequence, P prompt rows per sequence (0 once the prompt has passed all
loops), H hidden size, C positions reserved per sequence (at least the padded prompt width + max_new_tokens:
`span.reserved_positions`), T output columns (max_new_tokens; C when the step is compiled, so that its shapes do not
depend on the call's lengths), planes = the KV planes of the model.

Lane slots. A sequence's live lanes hold consecutive positions, so lane position p lives in slot p % L. A lane
is a token on its way through the loops: `depth` loops done, `hidden` the input of its next loop. `draft` marks
a lane proposed at depth d and not verified yet.

Prompt rows. Every real prompt token but the last runs its U loops as a prompt row (all of a sequence's rows
share one depth; their next token is known, so they neither draft nor verify). The last prompt token is a lane.
After the run, the same rows carry the tokens that complete the cache (`WavefrontEngine._complete_cache`).

Sibling slot (second proposals, `Plan.second_loops` = d2; pipeline only, with U - d2 <= d). Each sequence has one
extra lane slot, `sib_*`, for a sibling: when a main-path lane X at position p reaches depth d2 and its depth-d2
proposal C (argmax, or a draw when sampling) differs from its draft B at p + 1, C starts there at depth 0.

Invariant (branch-private KV): while it is a sibling, C writes its KV only into its sequence's private rows
`sib_k` / `sib_v` (position p + 1, one row per plane: its core planes and, with an entry stage that has KV, the
entry plane its embedding writes: `stages.sibling_embedder`) and reads the main tables at positions 0..p (the common
history, complete in every plane C reaches: X and the lanes before it are deeper) plus its own private rows;
main-path rows never read the private rows, and C never writes a main table. X's target decides C's fate U - d2
cycles after C starts, when C is U - d2 <= d loops deep: C never drafts as a sibling (chosen at depth d, it drafts
at once, as its sequence's frontier), and no second sibling opens before the first is decided (the next main lane
reaches d2 d cycles after X): one slot per sequence suffices. If the target chooses C, C takes B's lane slot (B and
its descendants die), the main tables roll back to p + 1 positions, and C's private rows are copied into position
p + 1 of the planes C wrote (a device copy of at most U - d2 + 1 rows per sequence and layer: `sibling.promote`), so
the main tables hold exactly C's history, as if C had been the main lane all along (I4). Otherwise the private rows
are simply left behind (the next sibling overwrites them). An exit stage with KV needs no private rows: C reaches no
exit depth as a sibling (U - d2 <= d < d2 < U; chosen at depth d, it runs the head as a main lane).

Counters are per sequence, in the column order of `COUNTERS` (the fields of `SequenceStats`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...looped import KVLayout

COUNTERS = ("committed", "drafted", "verified", "accepted", "rejected", "discarded", "second_drafts", "second_accepted")
# the kinds of `Plan.processors` items (`processing.device_processors`): (PENALTY,), (HOLD,), (TEMPERATURE,),
# (TOP_K, filter_value), (TOP_P, filter_value, min_tokens_to_keep), (MIN_P, filter_value, min_tokens_to_keep),
# (HOST, start, stop): processors start..stop-1 of the call's list, run on the host (`host`)
PENALTY, HOLD, TEMPERATURE, TOP_K, TOP_P, MIN_P = "repetition_penalty", "eos_hold", "temperature", "top_k", "top_p", \
    "min_p"
HOST = "host"


@dataclass(frozen=True)
class Plan:
    """The static settings of one run (Python values: constants of the compiled step)."""

    mode: str  # "ar", "block" or "pipeline"
    num_loops: int  # U
    draft_loops: int  # d; 0 in mode "ar"
    num_speculative_tokens: int  # K (block)
    lanes: int  # L
    planes: int  # KV planes per sequence
    page_size: int
    positions: int  # C: positions reserved per sequence
    has_eos: bool
    processors: tuple = ()  # the call's logits processors, in order, as `processing.device_processors` gives them
    # (their kinds and structural settings; their values are `WavefrontState.settings`)
    do_sample: bool = False  # sampling (lossless speculative sampling) instead of greedy decoding
    span: int | None = None  # S: rows read positions 0..S-1 only (no live row sits at S or beyond); None: all C
    compact: bool = False  # the core runs the active rows only (eager on a CPU: `step`, step 2)
    second_loops: int | None = None  # d2: second proposals (pipeline, U - d2 <= d); None: off
    exit_rule: Callable | None = None  # the call's exit options (`decoder.ExitRule`, compared by value: `exits`)
    output_scores: bool = False  # record each committed column's processed scores (`outputs`)
    output_logits: bool = False  # record each committed column's raw logits (`outputs`)
    trace_hidden: bool = False  # keep the core call's outputs (`WavefrontState.core_out`, for `tracing`)
    host: object = None  # `host.HostHooks`: host processors and draft hooks (eager step only); None: none
    layout: KVLayout | None = None  # the model's KV layout under the call's settings (Huginn's depends on num_steps):
    # the step reads it here, never from the model (a compiled step cannot read per-call settings)
    step_settings: object = None  # the model's `step_settings()` (`looped`; Huginn: num_steps, init_scale) or None:
    # part of the compile key, so calls with other settings never share a compiled step

    @property
    def table_width(self) -> int:
        """W: pool slots per (sequence, plane) table (C rounded up to whole pages); table t holds its positions at
        pool slots t * W .. t * W + C - 1 (`WavefrontEngine._reserve`)."""
        return -(-self.positions // self.page_size) * self.page_size

    @property
    def read_span(self) -> int:
        """S, the positions a step reads: `span`, or all C reserved positions."""
        return self.positions if self.span is None else self.span

    @property
    def penalised(self) -> bool:
        """Whether the call has a repetition penalty (`WavefrontState.seen`)."""
        return (PENALTY,) in self.processors


@dataclass(eq=False)
class WavefrontState:
    # lane slots
    token: torch.Tensor  # [B, L] int64
    position: torch.Tensor  # [B, L] int64
    depth: torch.Tensor  # [B, L] int64  loops completed
    alive: torch.Tensor  # [B, L] bool
    draft: torch.Tensor  # [B, L] bool   proposed at depth d, not verified yet
    draft_q: torch.Tensor  # [B, L, V] float32 sampling: the distribution a draft was drawn from; [B, L, 0] greedy
    noise: torch.Tensor  # [B, L, 2] float32 sampling: this cycle's uniforms (drawn before the step); [B, L, 0] greedy;
    # [B, L, 3] sampling with second proposals
    hidden: torch.Tensor  # [B, L, H]
    # prompt rows
    prompt_hidden: torch.Tensor  # [B, P, H]
    prompt_real: torch.Tensor  # [B, P] bool  row p holds the known token at position prompt_start + p
    prompt_start: torch.Tensor  # [B] int64  0 (the prompt), or where the tokens completing the cache begin
    prompt_depth: torch.Tensor  # [B] int64
    # committed tokens and stopping
    out: torch.Tensor  # [B, T + 1] int64: committed tokens, pad after them; column T absorbs masked writes
    n_out: torch.Tensor  # [B] int64
    finished: torch.Tensor  # [B] bool
    invalid: torch.Tensor  # [B] bool  sampling met non-finite probabilities (the sequence is finished, the run raises)
    prompt_len: torch.Tensor  # [B] int64  real prompt tokens
    max_new: torch.Tensor  # [] int64, or [B] (continuous batching: each slot's own)
    eos: torch.Tensor  # [E] int64 (E >= 1; unused when the plan has no EOS), or [B, E] -1 padded (each slot's own)
    round_drafts: torch.Tensor  # [B] int64  block: drafts since the sequence's round began
    counters: torch.Tensor  # [B, len(COUNTERS)] int64
    core_calls: torch.Tensor  # [] int64
    core_rows: torch.Tensor  # [] int64: rows the latest core call ran (set with `Plan.compact` only)
    head_rows: torch.Tensor  # [] int64: rows the latest cycle's head calls ran (set with `Plan.compact` only)
    draft_override: torch.Tensor  # [B, C] int64: a draft for position p becomes draft_override[b, p] when >= 0
    second_override: torch.Tensor  # [B, C] int64: a second proposal for position p becomes this when >= 0
    seen: torch.Tensor  # [B, V] bool: the prompt row's tokens the penalty counts, and the committed tokens
    eos_hold: torch.Tensor  # [V] int64: id v cannot be the i-th generated token (0-based) while i < eos_hold[v]
    settings: torch.Tensor  # [len(Plan.processors)] float32: the value of each processor (`processing`)
    # KV: the pools of the run's PagedLoopCache as flat views (`PagedLoopCache.flat_pools`; layer l's table t at
    # slots l * pages * page_size + t * W ..: `Plan.table_width`), and the valid lengths. The step writes these
    # tensors themselves in place: compiled, writes through views made inside the step would copy the pool out and
    # back every call (inductor)
    k_pool: torch.Tensor  # [layers * pages * page_size, Hkv, D]
    v_pool: torch.Tensor  # [layers * pages * page_size, Hkv, D]
    trash_slot: torch.Tensor  # [] int64: a reserved slot no real row uses; masked rows write there
    pages: torch.Tensor  # [B * planes, W / page_size] int64 page map (continuous batching: `ops.attention.slots`
    # `table_slot`), or [0, 0]: the tables lie in order
    kv_len: torch.Tensor  # [B, planes] int64
    # sibling slot (second proposals; see the module docstring): one per sequence
    sib_token: torch.Tensor  # [B] int64
    sib_position: torch.Tensor  # [B] int64
    sib_depth: torch.Tensor  # [B] int64
    sib_alive: torch.Tensor  # [B] bool
    sib_read: torch.Tensor  # [B] bool: a second candidate sib_token was drawn for sib_position (a sibling, or equal to
    # the draft there), not judged yet
    sib_q: torch.Tensor  # [B, V] float32 sampling: the distribution the second candidate was drawn from; [B, 0] greedy
    sib_hidden: torch.Tensor  # [B, H]
    sib_k: torch.Tensor  # [layers, B * planes + 1, Hkv, D]: row b * planes + k holds (b, plane k, sib_position); the
    sib_v: torch.Tensor  # last row absorbs masked writes. [layers, 0, Hkv, D] without second proposals
    # exit options (`exits`): each slot's output after every loop it ran (U = 0 without an exit rule)
    loop_states: torch.Tensor  # [B, L, U, H]: entry k after loop k + 1
    sib_states: torch.Tensor  # [B, U, H]: the sibling's
    # requested outputs (`outputs`), written in place: per committed column the committing slot's values
    scores_out: torch.Tensor  # [B, T + 1, V] float32 processed scores with output_scores, else [B, 0, 0]
    logits_out: torch.Tensor  # [B, T + 1, V] float32 raw logits with output_logits, else [B, 0, 0]
    core_out: torch.Tensor  # [N, H] the latest core call's outputs with `Plan.trace_hidden`, else [0, H]
    # random loop-0 inputs (`looped`: Huginn's initial states), drawn at set-up so that the step draws nothing
    init_states: torch.Tensor  # [B, C, W] lane dtype: those of position p of sequence b; [B, 0, 0] without them


def counts(s: WavefrontState, **columns: torch.Tensor) -> torch.Tensor:
    """`[B, len(COUNTERS)]` int64 to add to `s.counters`: the named columns (each `[B]`, int64 or bool), zeros
    elsewhere."""
    if not columns.keys() <= set(COUNTERS):
        raise KeyError(f"not counters: {sorted(columns.keys() - set(COUNTERS))}")
    zero = torch.zeros_like(s.n_out)
    return torch.stack([zero if (x := columns.get(name)) is None else x if x.dtype == torch.long else x.long()
                        for name in COUNTERS], 1)  # no-op casts skipped: each is a dispatched op, eager
