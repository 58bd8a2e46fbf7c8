"""The device side of continuous batching: B sequence slots of one wavefront state whose owners change.

The manager builds one `WavefrontEngine` for its whole life, on B placeholder prompts of C - 1 tokens with room for
C positions per slot, so the state has P = C - 2 prompt rows per slot, the widest prompt a slot takes, and then
vacates every slot (finished, no lane, no prompt row). The KV lives in the manager's page pool (`pool`): a request
takes pages for the positions it can write when it is admitted, written into its slot's rows of the state's page
map, and gives them back when it leaves (finished, cancelled or failed: `release`). A new owner resets its slot's KV
lengths to 0 (stale KV on its pages, another request's, is never read: I1 holds by wavefront order, as on a fresh
cache).

Admission (`admit`) writes a request into its slot in place, as the engine's set-up writes a sequence: its prompt
embedded into the slot's prompt rows at depth 0, its last token a lane at depth 0, its counts, limits (`max_new`
`[B]`) and EOS ids (`eos` `[B, E]`) set. Its prompt rows then run in the next cycles mixed with the running lanes
of the other slots, through the engine's own step (the state's per-sequence prompt rows and depths already do
that). Keeping the prompt rows inside the state rather than running a prefill call of our own keeps one code path
for the tokens (the step that every speculative `generate` call runs, with its exactness tests) and keeps the
running lanes going while a request prefills. The rows cost B * P masked rows per cycle when the step is not
compact, so the state carries them only while some slot prefills (`prefill_until`): the step then has two shapes,
with and without prompt rows, each built once (compiled: two graphs for the manager's life).

Eager, each call reads the positions its rows can reach (`reach`, bounded on the host as `span.SpanBound` bounds
them: a slot's newest lane is at most L - 1 past its last committed token after a read-back, and moves one position
per cycle at most), rounded up to a bucket (`span.bucket`); compiled, every call reads all C positions, so the
step keeps its two graphs whatever the requests' lengths. Either way a table's positions are gathered through the
page map (`ops.attention.slots.table_slot`), so where a request's pages lie changes no shape.

The sampling uniforms are drawn per slot, from a generator seeded when the request is admitted, so a request's
draws (and so its tokens, for a given seed) do not depend on what else is in flight.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..rules import cycle_uniforms
from ..wavefront import stages
from ..wavefront.device import ReadBack
from ..wavefront.options import DEFAULT_READ_EVERY
from ..wavefront.processing import device_processors
from ..wavefront.span import bucket
from . import huginn
from .pool import KVPool, PooledEngine, pool_cache, request_positions
from .settings import MAX_EOS_IDS, ManagerSettings


class SlotBatch:
    """B slots of C positions decoded by one wavefront engine (see the module docstring)."""

    def __init__(self, model, settings: ManagerSettings, read_every: int = DEFAULT_READ_EVERY):
        device = model.device
        batch, width = settings.slots, settings.positions - 1
        placeholder = torch.zeros(batch, width, dtype=torch.long, device=device)
        processors, tensors = device_processors(settings.processors, placeholder, settings.vocab)
        with torch.no_grad(), huginn.manager_block(model, settings.recurrence):  # the manager's planes
            self.engine = PooledEngine(
                model, pool_cache(model.kv_layout, settings.pool),
                mode=settings.mode, draft_loops=settings.draft_loops or 1,
                num_speculative_tokens=settings.num_speculative_tokens, input_ids=placeholder, attention_mask=None,
                pad_token_id=settings.pad_token_id, max_length=settings.positions, eos_token_id=[-1],
                read_every=read_every, compile_backend=settings.compile_backend, processors=processors,
                do_sample=settings.do_sample, second_draft_loops=settings.second_draft_loops,
                exit_rule=settings.exit_rule, **tensors)
        self.model, self.settings = model, settings
        self.pool = KVPool(self.engine, settings.pool)
        s = self.engine.state
        self.prompt_rows = s.prompt_real.shape[1]  # P
        long = dict(dtype=torch.long, device=device)
        s.out = torch.full((batch, self.engine.plan.positions + 1), settings.pad_token_id, **long)
        s.max_new = torch.zeros(batch, **long)
        s.eos = torch.full((batch, MAX_EOS_IDS), -1, **long)
        s.finished.fill_(True)
        s.alive.fill_(False)
        s.prompt_real.fill_(False)
        s.kv_len.zero_()
        self.cycles = 0  # cycles run
        self.prefill_until = 0  # prompt rows ride along until this cycle (the latest admission's prefill)
        self.generators: list[torch.Generator | None] = [None] * batch
        self.reach = [-1] * batch  # per slot, the newest position a live row may hold before the next cycle (-1: free)
        self.cycles_per_call = self.engine.cycles_per_call

    @property
    def state(self):
        return self.engine.state

    def _prompt_rows(self, on: bool) -> None:
        """Carry the P prompt rows (`on`) or none: an admission brings them back, zeros (no slot prefills)."""
        s = self.engine.state
        if on == (s.prompt_real.shape[1] > 0):
            return
        rows = self.prompt_rows if on else 0
        batch, _, hidden = s.prompt_hidden.shape
        self.engine.state = replace(s, prompt_hidden=s.prompt_hidden.new_zeros(batch, rows, hidden),
                                    prompt_real=s.prompt_real.new_zeros(batch, rows))

    @torch.no_grad()
    def admit(self, b: int, prompt: list[int], max_new_tokens: int, eos: list[int], seed: int | None,
              draft_override: list[int] | None = None) -> None:
        """Slot `b` starts decoding `prompt` (validated: `settings.request_problem`) for at most `max_new_tokens`
        tokens, stopping at `eos`; sampling draws from a generator seeded with `seed`; `draft_override` (test-only,
        `settings.override_tokens`) becomes the slot's row of the state's `draft_override` (the slot's positions are
        the request's own). The request takes its KV pages from the pool (`pool.KVPool.take`: the caller checked
        `fits`)."""
        self.pool.give_back(b)  # a previous owner's pages, if the caller did not release it
        self.pool.take(b, request_positions(len(prompt), max_new_tokens))
        self._prompt_rows(True)
        s, model, plan = self.engine.state, self.model, self.engine.plan
        device = s.token.device
        ids = torch.tensor(prompt, dtype=torch.long, device=device)
        n, lanes = len(prompt), s.token.shape[1]
        for name in ("alive", "draft", "sib_alive", "sib_read"):
            getattr(s, name)[b] = False
        for name in ("token", "position", "depth", "hidden", "draft_q", "round_drafts", "counters", "n_out",
                     "kv_len", "prompt_start", "prompt_depth", "loop_states", "sib_states"):
            getattr(s, name)[b] = 0
        if not stages.embeds_by_lookup(model):  # through model.embed (the entry plane's KV: slot b's rows only)
            tokens = torch.zeros(len(s.token), n, dtype=torch.long, device=device)
            tokens[b] = ids
            real = torch.zeros_like(tokens, dtype=torch.bool)
            real[b] = True
            vectors = stages.embed_rows(model, plan, s, tokens, torch.zeros_like(s.n_out), real)[b]
        else:
            vectors = model.get_input_embeddings()(ids)  # [n, H]
        s.prompt_hidden[b, : n - 1] = vectors[:-1]
        s.prompt_real[b] = torch.arange(self.prompt_rows, device=device) < n - 1
        slot = (n - 1) % lanes
        s.token[b, slot], s.position[b, slot], s.alive[b, slot] = ids[-1], n - 1, True
        s.hidden[b, slot] = vectors[-1]
        s.out[b] = self.settings.pad_token_id
        s.finished[b], s.invalid[b], s.prompt_len[b], s.max_new[b] = False, False, n, max_new_tokens
        s.eos[b] = -1
        s.eos[b, : len(eos)] = torch.tensor(eos, dtype=torch.long, device=device)
        s.draft_override[b] = -1
        if draft_override:
            s.draft_override[b, : len(draft_override)] = torch.tensor(draft_override, dtype=torch.long, device=device)
        if plan.penalised:  # the prompt's tokens count for the repetition penalty
            s.seen[b] = False
            s.seen[b, ids] = True
        self.prefill_until = self.cycles + self.engine.prefill_cycles
        self.reach[b] = n - 1
        if self.settings.do_sample:
            self.generators[b] = torch.Generator(device).manual_seed(int(seed))

    def fits(self, prompt_length: int, max_new_tokens: int) -> bool:
        """Whether the pool's free pages hold a request of `prompt_length` + `max_new_tokens` now."""
        return self.pool.fits(request_positions(prompt_length, max_new_tokens))

    def release(self, b: int) -> None:
        """Slot `b`'s request has left (its slot finished): its pages and generator go."""
        self.generators[b] = None
        self.pool.give_back(b)

    def cancel(self, b: int) -> None:
        """Slot `b` stops now (its lanes die at the next cycle; the slot is free for the next admission)."""
        self.engine.state.finished[b] = True
        self.reach[b] = -1
        self.release(b)

    @torch.no_grad()
    def run(self, cycles: int) -> None:
        """`cycles` cycles (a multiple of `cycles_per_call`) of every slot; the prompt rows are dropped once no slot
        prefills."""
        if self.cycles >= self.prefill_until:
            self._prompt_rows(False)
        for _ in range(cycles // self.cycles_per_call):
            self._call()

    def _call(self) -> None:
        """One call of the step function of the state's shape (`cycles_per_call` cycles, reading all C positions)."""
        engine, cycles = self.engine, self.cycles_per_call
        span = engine.plan.positions if engine.compile_backend else bucket(max(self.reach) + cycles + 1, False,
                                                                           engine.plan.positions)
        step = engine._step_function(span, cycles, prefill=engine.state.prompt_real.shape[1] > 0)
        engine.state = step(engine.state, self._noise(cycles))
        self.cycles += cycles
        self.reach = [r + cycles if r >= 0 else r for r in self.reach]

    @torch.no_grad()
    def warmup(self) -> None:
        """Build (compiled: compile) the step of both shapes, with prompt rows and without, on the free slots (a
        finished slot does not change)."""
        for rows in (True, False):
            self._prompt_rows(rows)
            self._call()

    def _noise(self, cycles: int) -> torch.Tensor | None:
        """`[cycles, B, L, 2 or 3]` uniforms, each slot's from its own generator (zeros for a free slot); None when
        greedy."""
        if not self.settings.do_sample:
            return None
        s = self.engine.state
        noise = s.noise.new_zeros(cycles, *s.noise.shape)
        for b, generator in enumerate(self.generators):
            if generator is not None:
                noise[:, b] = torch.stack([cycle_uniforms(generator, s.noise.shape[1:], s.noise.device)
                                           for _ in range(cycles)])
        return noise

    def read_back(self) -> tuple[list[int], list[bool], list[bool], torch.Tensor]:
        """Committed counts, finished flags, invalid flags (sampling met non-finite probabilities) `[B]` each, and
        the committed tokens `[B, T + 1]`, on the host."""
        s = self.engine.state
        counts, finished, tokens = ReadBack(s, tokens=True).values()
        lanes = s.token.shape[1]
        for b, (length, n, done) in enumerate(zip(s.prompt_len.tolist(), counts, finished)):
            self.reach[b] = -1 if done else min(self.reach[b], length + n + lanes - 2)
        return counts, finished, s.invalid.tolist(), tokens
