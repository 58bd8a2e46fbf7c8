"""Set-up, host loop and tear-down of one wavefront run (see `step` for the cycle).

Set-up reserves, in the run's `PagedLoopCache`, every page a sequence can need (C >= padded prompt width +
max_new_tokens positions in every plane: `span.reserved_positions`), table after table from page 0, so each
(sequence, plane) is one contiguous run of the pool for the whole run (`Plan.table_width`), and embeds the prompt.
The host loop runs the step R cycles at a time and then calls `read_back`, the only place where the host reads the
device state during the run; it stops when every sequence has finished. Compiled, those R cycles (up to
`CYCLES_PER_CALL`) are one call of one compiled function (`step.make_cycles`), with inductor's C++ wrapper on a CPU
in fp32 (`CPU_INDUCTOR_OPTIONS`): on small shapes the fixed cost of a call (dynamo's guards, the wrapper between the
kernels) is most of a cycle's. Each call runs the step of its span (`span.SpanBound`: the positions its attention
reads, bounded from the cycle count and the latest read-back; the span of the call's last cycle). The prompt rows
exist only during the first cycles (a number known in advance: U, plus K*d in block mode), after which they are
dropped from the state (at the first call that starts after them). Compiled, the calls that carry them run a
function of one cycle compiled with the prompt dimension dynamic (`compiled_prefill`: one graph for every prompt
width) and the Python wrapper, one call per cycle. So the compiled functions' shapes depend on the batch size, the
reserved positions C and the span only, and later calls whose prompt width and max_new_tokens fall in the same
bucket of C compile nothing. Tear-down truncates the cache to the device's KV lengths and builds the lane decoder's
`DecodeResult`.

The engine covers Ouro and Huginn (entry and exit stages with KV, seeded initial states drawn at set-up: `stages`;
compiled and with second proposals too), greedy decoding and sampling with the logits processors `processing` runs on
the device, EOS and length stops on the device and every other stopping criterion on the host at read-backs
(`stopping`), `output_scores` / `output_logits` (`outputs`), traces
(`tracing`: the state read around every cycle), caches filled by earlier calls (`resume`: set-up moves their
history into the reserved layout) and exit options (`exits`).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from ...cache.paged import FlatPools, PagedLoopCache
from ...models.layers import check_token_ids
from ..call import checked_hook
from ..decoder import DecodeResult
from ..history import run_planes
from ..rules import cycle_uniforms, lanes_for, non_finite_error, run_generator, uniform_columns
from ..stats import SequenceStats, SpeculationStats
from . import exits, outputs, resume, stages
from .compiling import compiled_cycles, compiled_prefill, one_at_a_time
from .device import ReadBack
from .host import HostHooks, compile_problem
from .limits import cache_problem, second_proposals_problem
from .options import DEFAULT_READ_EVERY, engine_options
from .span import SpanBound, reserved_positions
from .state import COUNTERS, HOST, Plan, WavefrontState
from .step import head_columns, make_cycles, make_step
from .stopping import host_stops
from .tracing import Tracer, traced

WAVEFRONT_MODES = ("ar", "block", "pipeline")
CYCLES_PER_CALL = 4  # compiled: cycles per call of the step function (unrolled: compile time grows with it)


def read_back(state: WavefrontState, tokens: bool = False) -> ReadBack:
    """The host's only look at a running state: committed counts `[B]`, finished flags `[B]` and, when `tokens`
    (a streamer is fed), the committed-token buffer `[B, T + 1]`, copied to the host (`ReadBack.values`; on CUDA
    the copy overlaps the cycles launched before the host asks for them)."""
    return ReadBack(state, tokens)


class WavefrontEngine:
    """One batch decoded to completion by the wavefront step.

    `draft_override` `[B, C]` (test-only): a draft for position p of sequence b becomes `draft_override[b, p]`
    where that is >= 0; `second_override` likewise for second proposals (`second_draft_loops`: d2, see
    `second_proposals_problem`). `logits_processor`, `draft_hook`, `second_draft_hook`: the lane decoder's, run on the
    host in the eager step (`host`). `compile_backend`: a `torch.compile` backend for the step (fullgraph), or None
    (eager). `generate` builds it with `from_request`.
    """

    @classmethod
    def from_request(cls, model, request, **extras) -> WavefrontEngine:
        """The engine of a `dispatch.SpeculativeRequest` (`options.engine_options`); `extras`: test-only keywords
        (`draft_override`, `second_override`, `read_every`)."""
        return cls(model, request.cache, **{**engine_options(model, request), **extras})

    def __init__(self, model, cache: PagedLoopCache, *, mode: str, draft_loops: int, num_speculative_tokens: int,
                 input_ids: torch.Tensor, attention_mask: torch.Tensor | None, pad_token_id: int | None,
                 max_length: int, eos_token_id=None, draft_override: torch.Tensor | None = None,
                 read_every: int = DEFAULT_READ_EVERY, compile_backend: str | None = None,
                 processors: tuple = (), penalty_ignore: torch.Tensor | None = None,
                 eos_hold: torch.Tensor | None = None, settings: torch.Tensor | None = None,
                 do_sample: bool = False, streamer=None,
                 complete_cache: bool = False, second_draft_loops: int | None = None,
                 second_override: torch.Tensor | None = None, exit_rule=None, stopping_criteria=None,
                 output_scores: bool = False, output_logits: bool = False, trace: bool | str = False,
                 logits_processor=None, draft_hook=None, second_draft_hook=None):
        cache.check_layout(model.kv_layout)
        cache.check_pool(model.lane_dtype, input_ids.device)
        if not isinstance(read_every, int) or read_every < 1:
            raise ValueError(f"read_every={read_every!r} must be an integer >= 1 (cycles between read-backs).")
        problem = cache_problem(cache) or second_proposals_problem(mode, model.num_loops, draft_loops,
                                                                   second_draft_loops)
        if problem:
            raise ValueError(f"the wavefront engine does not support {problem}; run the reference "
                             "(model.decode_with_lanes, or --engines reference in the bench).")
        if compile_backend is not None and (host := compile_problem(logits_processor, input_ids.shape[1], draft_hook,
                                                                    second_draft_hook)):
            raise ValueError(f"the wavefront engine does not support {host}.")
        self.model, self.cache, self.read_every, self.complete_cache = model, cache, read_every, complete_cache
        self.vocab = model.head_width  # V: the width of the head's logits
        self.input_ids = input_ids
        self.pad = 0 if pad_token_id is None else pad_token_id
        batch, width = input_ids.shape
        self.stops = host_stops(input_ids, pad_token_id, max_length, stopping_criteria, streamer, output_scores)
        self.streamer, self.streamed = None if self.stops else streamer, 0  # columns fed to the streamer so far
        max_new = max(max_length - width, 0)
        eos = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        draft_loops = draft_loops if mode != "ar" else 0
        self.compile_backend = compile_backend
        self.plan = Plan(mode, model.num_loops, draft_loops, num_speculative_tokens,
                         lanes_for(mode, model.num_loops, draft_loops, num_speculative_tokens), cache.num_planes,
                         cache.page_size, reserved_positions(width + max_new, compile_backend is not None),
                         bool(eos), processors, do_sample,
                         compact=compile_backend is None and input_ids.device.type == "cpu",
                         second_loops=second_draft_loops, exit_rule=exit_rule, output_scores=output_scores,
                         output_logits=output_logits, trace_hidden=trace == "hidden",
                         host=HostHooks(logits_processor, input_ids, (model.num_loops, draft_loops, second_draft_loops),
                                        checked_hook("draft_hook", draft_hook, self.vocab),
                                        checked_hook("second_draft_hook", second_draft_hook, self.vocab))
                         if any(item[0] == HOST for item in processors) or draft_hook or second_draft_hook else None,
                         layout=model.kv_layout, step_settings=stages.step_settings(model))
        self.prefill_cycles = model.num_loops + (num_speculative_tokens * draft_loops if mode == "block" else 0)
        self.stats = SpeculationStats(mode=mode, draft_loops=draft_loops, engine="wavefront")
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        self.mask = mask  # [B, S]: the padding of the prompt columns the cache consumes
        self.tracer = Tracer(input_ids, mask, trace == "hidden") if trace else None
        with torch.no_grad():
            self.state = self._initial_state(input_ids, mask, max_new, eos, draft_override, second_override)
            self.state.seen = self._seen(input_ids, penalty_ignore)
            if eos_hold is not None:
                self.state.eos_hold = eos_hold.to(device=input_ids.device, dtype=torch.long)
            if settings is not None:
                self.state.settings = settings.to(device=input_ids.device, dtype=torch.float32)
        # sampling: the uniforms of every step come from this device generator (`rules`: the lane decoder draws the
        # same); greedy runs draw nothing
        self.generator = self._run_generator(input_ids.device) if do_sample else None
        # cycles per call of the step function: compiled, up to CYCLES_PER_CALL of the R cycles between two
        # read-backs run as one call (its fixed cost, dynamo's guards and the call's wrapper, is paid once for them);
        # eager, one (nothing to save)
        self.cycles_per_call = math.gcd(read_every, CYCLES_PER_CALL) if compile_backend and not trace else 1
        # the step function of `cycles` cycles reading `span` positions (`span.SpanBound`): a plan of its own, so it
        # compiles once per span (`_step_function`)
        self.steps = {}  # (span, cycles, prefill) -> step function
        self.spans = SpanBound(width, self.plan.lanes, self.plan.positions, compile_backend is not None)
        self.cycles = 0

    def _reserve(self, batch: int, like: torch.Tensor) -> torch.Tensor:
        """Pages for C positions of every (sequence, plane), allocated in table order from page 0, the history a
        filled cache holds moved there (`PagedLoopCache.repack_in_order`, `resume`), so that table t holds its
        positions at pool slots t * W .. t * W + C - 1 (`Plan.table_width`); returns the trash slot (position C - 1
        of sequence 0, plane 0: no lane ever sits there, the last token is never fed back)."""
        self.cache.repack_in_order(batch, self.plan.positions, like)
        return torch.tensor(self.plan.positions - 1, device=like.device)

    def _page_map(self, batch: int, device: torch.device) -> torch.Tensor:
        """`WavefrontState.pages`: `[0, 0]`, the tables lie in order (`_reserve`)."""
        return torch.zeros(0, 0, dtype=torch.long, device=device)

    def _initial_state(self, input_ids, mask, max_new: int, eos: list[int], draft_override,
                       second_override) -> WavefrontState:
        plan, device = self.plan, input_ids.device
        batch, lanes = len(input_ids), plan.lanes
        # checks a filled one
        start = resume.start_of(self.cache, self.model, input_ids, mask, plan.draft_loops, plan.second_loops)
        self.held = start.held.clone()  # [B, planes] each table's history before the call (`run` rolls back to it)
        prompts = start.rows
        like = torch.empty(0, dtype=self.model.lane_dtype, device=device)  # the KV and lane dtype
        trash = self._reserve(batch, like)
        pools = self.cache.flat_pools()  # [layers * pages * page_size, Hkv, D] each, in table order
        embed = self.model.get_input_embeddings()
        hidden_size = self.model.lane_width
        prompt_len = start.stored + start.new  # [B] the sequence's positions before its first new token
        records = exits.empty_records(plan, batch, hidden_size, like)  # loop outputs (exit options)
        long, fp32 = dict(dtype=torch.long, device=device), dict(dtype=torch.float32, device=device)
        state = WavefrontState(
            token=torch.zeros(batch, lanes, **long), position=torch.zeros(batch, lanes, **long),
            depth=torch.zeros(batch, lanes, **long), alive=torch.zeros(batch, lanes, dtype=torch.bool, device=device),
            draft=torch.zeros(batch, lanes, dtype=torch.bool, device=device),
            draft_q=torch.zeros(batch, lanes, self.vocab if plan.do_sample else 0, **fp32),
            noise=torch.zeros(batch, lanes, uniform_columns(plan.second_loops is not None) * plan.do_sample, **fp32),
            hidden=torch.zeros(batch, lanes, hidden_size, dtype=like.dtype, device=device),
            prompt_hidden=torch.zeros(batch, prompts, hidden_size, dtype=like.dtype, device=device),
            prompt_real=torch.arange(prompts, device=device) < (start.new - 1)[:, None],
            prompt_start=start.stored, prompt_depth=torch.zeros(batch, **long),
            out=torch.full((batch, self._out_columns(max_new) + 1), self.pad, **long), n_out=torch.zeros(batch, **long),
            finished=(prompt_len == 0) | (max_new == 0), invalid=torch.zeros(batch, dtype=torch.bool, device=device),
            prompt_len=prompt_len,
            max_new=torch.tensor(max_new, **long), eos=torch.tensor(eos or [-1], **long),
            round_drafts=torch.zeros(batch, **long), counters=torch.zeros(batch, len(COUNTERS), **long),
            core_calls=torch.zeros((), **long), core_rows=torch.zeros((), **long),
            head_rows=torch.zeros((), **long),
            draft_override=self._override(draft_override, batch, device),
            second_override=self._override(second_override, batch, device),
            seen=torch.zeros(batch, 0, dtype=torch.bool, device=device), eos_hold=torch.zeros(0, **long),
            settings=torch.zeros(0, **fp32),
            k_pool=pools.k, v_pool=pools.v, trash_slot=trash, pages=self._page_map(batch, device),
            kv_len=start.held.clone(),
            sib_token=torch.zeros(batch, **long), sib_position=torch.zeros(batch, **long),
            sib_depth=torch.zeros(batch, **long), sib_alive=torch.zeros(batch, dtype=torch.bool, device=device),
            sib_read=torch.zeros(batch, dtype=torch.bool, device=device),
            sib_q=torch.zeros(batch, self.vocab if plan.do_sample else 0, **fp32),
            sib_hidden=torch.zeros(batch, hidden_size, dtype=like.dtype, device=device),
            sib_k=self._private_rows(batch, pools), sib_v=self._private_rows(batch, pools),
            loop_states=records[0], sib_states=records[1],
            **outputs.buffers(plan, batch, self._out_columns(max_new) + 1, self.vocab, hidden_size, like),
            init_states=stages.initial_states(self.model, batch, plan.positions, like),
        )
        staged = None if stages.embeds_by_lookup(self.model) else self._embed_staged(state, start)
        for b, prompt in enumerate(start.tokens):  # set-up runs once per batch on the host
            n = len(prompt)
            if n == 0:
                continue
            vectors = embed(prompt) if staged is None else staged[b, :n]  # [n, H]
            self.stats.call_rows["embed"].append(n)
            state.prompt_hidden[b, : n - 1] = vectors[:-1]
            slot = int(prompt_len[b] - 1) % lanes
            state.token[b, slot], state.position[b, slot] = prompt[-1], prompt_len[b] - 1
            state.alive[b, slot] = not bool(state.finished[b])
            state.hidden[b, slot] = vectors[-1]
        return state

    def _embed_staged(self, state: WavefrontState, start) -> torch.Tensor:
        """`[B, F, H]` the loop-0 input of every token a sequence runs (`resume.Start`: its new tokens, from
        position `stored`), left-aligned, by `model.embed` (through the entry stage's KV plane when it has one)."""
        width = max((len(t) for t in start.tokens), default=0)
        tokens = torch.zeros(len(start.tokens), width, dtype=torch.long, device=state.token.device)  # [B, F]
        for b, row in enumerate(start.tokens):
            tokens[b, : len(row)] = row
        real = torch.arange(width, device=tokens.device) < start.new[:, None]
        return stages.embed_rows(self.model, self.plan, state, tokens, start.stored, real)

    def _out_columns(self, max_new: int) -> int:
        """T, the committed-token buffer's columns before its trash column: max_new_tokens eager; compiled, C (not
        the call's own count: the step's shapes depend on C alone)."""
        return max_new if self.compile_backend is None else self.plan.positions

    def _override(self, given: torch.Tensor | None, batch: int, device: torch.device) -> torch.Tensor:
        """`[B, C]` a draft (or second proposal) override: `given` (its columns are positions) padded with -1
        (no override) to the C positions reserved."""
        override = torch.full((batch, self.plan.positions), -1, dtype=torch.long, device=device)
        if given is not None:
            override[:, : given.shape[1]] = given[:, : self.plan.positions]
        return override

    def _private_rows(self, batch: int, pools: FlatPools) -> torch.Tensor:
        """A sibling's private KV rows (`WavefrontState.sib_k`) like the cache's pools: `[layers, B * planes + 1, Hkv,
        D]` with second proposals, else `[layers, 0, Hkv, D]`."""
        rows = batch * self.plan.planes + 1 if self.plan.second_loops is not None else 0
        return pools.k.new_zeros(self.cache.kv_layout.num_layers, rows, *pools.k.shape[1:])

    def _seen(self, input_ids: torch.Tensor, ignore: torch.Tensor | None) -> torch.Tensor:
        """`[B, V]` the tokens of each padded prompt row (the row transformers' processors see) from column
        `ignore[b]` on (all columns when None); `[B, 0]` without a repetition penalty."""
        if not self.plan.penalised:
            return self.state.seen
        seen = torch.zeros(len(input_ids), self.vocab, dtype=torch.long, device=input_ids.device)
        counted = torch.ones_like(input_ids) if ignore is None else \
            (torch.arange(input_ids.shape[1], device=input_ids.device) >= ignore.to(input_ids.device)[:, None]).long()
        return seen.scatter_reduce(1, input_ids, counted, "amax").bool()

    def run(self) -> DecodeResult:
        """Cycles until every sequence has finished. On CUDA the host looks at a read-back only after launching the
        next R cycles (they overlap its copy; a finished state stays unchanged by them); elsewhere at once, and eager
        on a CPU (`Plan.compact`) the cycles stop at the one where the last sequence finished. A run
        that raises (a stopping criterion, streamer or hook that raises; Ctrl-C) leaves the cache holding what it
        held before the call, so the conversation can go on from there."""
        try:
            return self._run()
        except BaseException:  # an interrupted call (a raising criterion, streamer or hook; Ctrl-C): the cache goes
            self._roll_back()  # back to the history it held before the call, which its columns still describe
            raise

    def _roll_back(self) -> None:
        for b, lengths in enumerate(self.held.tolist()):
            for plane, length in enumerate(lengths):
                self.cache.truncate(b, plane, length)

    def _run(self) -> DecodeResult:
        lag = 1 if self.state.n_out.is_cuda else 0
        with torch.no_grad():
            in_flight = []  # (cycles run when it was taken, read-back)
            done = bool(self.state.finished.all())
            while not done:
                for _ in range(self.read_every // self.cycles_per_call):
                    self._advance(self.cycles_per_call)
                    if self.plan.compact and bool(self.state.finished.all()):
                        break  # compacted, the host reads every cycle's rows anyway: no idle cycles to the read-back
                in_flight.append((self.cycles, read_back(self.state, tokens=bool(self.streamer or self.stops))))
                if len(in_flight) > lag:
                    cycle, taken = in_flight.pop(0)
                    counts, finished, tokens = taken.values()
                    self.spans.observe(cycle, counts, finished)
                    self._stream(counts, finished, tokens)
                    done = self.stops.observe(self.state, counts, finished, tokens) if self.stops else all(finished)
            self._check_finite()
            if self.complete_cache:
                self._complete_cache()
        return self._result()

    def _check_finite(self) -> None:
        """The `RuntimeError` plain sampling raises (`torch.multinomial`) when probabilities are not finite."""
        rows = self.state.invalid.nonzero().flatten().tolist()
        if rows:
            raise non_finite_error(rows)

    def _advance(self, cycles: int) -> None:
        """`cycles` cycles in one call of the step function: drop the prompt rows once they have passed all loops (at
        the first call that starts after the prefill: until then they ride along masked), draw each cycle's uniforms
        (sampling), run the step function of the span of the call's last cycle (spans grow with the cycle)."""
        if self.cycles >= self.prefill_cycles and self.state.prompt_real.shape[1]:
            batch, _, hidden = self.state.prompt_hidden.shape  # empty and contiguous: the strides the step returns
            self.state = replace(self.state, prompt_hidden=self.state.prompt_hidden.new_empty(batch, 0, hidden),
                                 prompt_real=self.state.prompt_real.new_empty(batch, 0))
        noise = None
        if self.generator is not None:  # [cycles, B, L, 2 or 3], one draw per cycle
            noise = torch.stack([cycle_uniforms(self.generator, self.state.noise.shape, self.state.noise.device)
                                 for _ in range(cycles)])
        span = self.spans.span(self.cycles + cycles - 1)
        self.state = self._step_function(span, cycles, prefill=self.state.prompt_real.shape[1] > 0)(self.state, noise)
        for _ in range(cycles):
            self.cycles += 1
            self._count_rows()

    def _run_generator(self, device: torch.device) -> torch.Generator | None:
        """A sampled run's generator (`rules.run_generator`: one draw of torch's global generator)."""
        return run_generator(device)

    def _step_function(self, span: int, cycles: int, prefill: bool):
        """`build_step`'s function of `cycles` cycles reading `span` positions, built once per run."""
        key = (span, cycles, prefill)
        if key not in self.steps:
            plan = replace(self.plan, span=span)
            self.steps[key] = traced(self.tracer, plan, self.build_step(plan, cycles, prefill))
        return self.steps[key]

    def build_step(self, plan: Plan, cycles: int, prefill: bool):
        """The function `(state, noise) -> state` of `cycles` cycles of `plan`: eager, `make_cycles`; compiled,
        `compiled_cycles`, or for a call that carries the prompt rows (`prefill`) `cycles` calls of
        `compiled_prefill`."""
        backend = self.compile_backend
        if backend is None:
            return make_cycles(self.model, plan, cycles)
        if prefill:
            return one_at_a_time(compiled_prefill(self.model, plan, backend), cycles)
        return compiled_cycles(self.model, plan, cycles, backend, self.input_ids.device)

    def _complete_cache(self) -> None:
        """Make the cache hold what plain decoding's does (as the lane decoder's `_complete_cache`): every output
        column but the last, so a row that stopped early also stores its stop token and the padding after it. Those
        tokens run their U loops as prompt rows of one more state, through the eager step (other shapes than the
        run's); the calls count as `cache_fill_calls`. The cache then reports the columns it has consumed."""
        state, width = self.state, self.input_ids.shape[1]
        counts = state.n_out.tolist()
        steps = max(counts, default=0)
        if steps == 0:
            return
        fill = [steps - n for n in counts]  # tokens to feed per row: its last token, then pads
        if max(fill):
            device = state.token.device
            tokens = torch.full((len(counts), max(fill)), self.pad, dtype=torch.long, device=device)  # [B, F]
            last = state.out.gather(1, (state.n_out - 1).clamp(min=0)[:, None])[:, 0]  # [B]
            tokens[:, 0] = torch.where(state.n_out > 0, last, self.input_ids[:, -1].to(device))
            fill_t = torch.tensor(fill, device=device)
            real, start = torch.arange(max(fill), device=device) < fill_t[:, None], state.prompt_len + state.n_out - 1
            check_token_ids(tokens[real], self.vocab)  # a pad id outside the vocabulary: plain decoding's error
            filling = replace(
                state, prompt_hidden=self.model.get_input_embeddings()(tokens) if stages.embeds_by_lookup(self.model)
                else stages.embed_rows(self.model, self.plan, state, tokens, start, real),
                prompt_real=real, prompt_start=start, prompt_depth=torch.zeros_like(state.prompt_depth),
                alive=torch.zeros_like(state.alive), finished=fill_t == 0, core_calls=state.core_calls.clone(),
                counters=state.counters.clone())
            step = make_step(self.model, self.plan)
            for _ in range(self.model.num_loops):
                filling = step(filling)
            self.stats.cache_fill_calls = self.model.num_loops
            state.kv_len = filling.kv_len
        self.cache.set_columns(width + steps - 1, run_planes(self.plan.layout, self.model.num_loops,
                                                             self.plan.draft_loops or None, self.plan.second_loops),
                               self.mask)

    def _count_rows(self) -> None:
        """`stats.call_rows` of one step (counted on the host from the shapes): every lane slot, prompt row and
        sibling slot runs the core (masked or not), `step.head_columns` slots per sequence the head (plus one for a
        chosen sibling that drafts at once), and one spawned lane (plus one sibling) per sequence is embedded; with
        `Plan.compact` the core and head rows the step ran, as it counted them on the CPU."""
        batch, lanes = self.state.token.shape
        plan, rows = self.plan, self.stats.call_rows
        second = plan.second_loops is not None
        rows["core"].append(int(self.state.core_rows) if plan.compact
                            else batch * (lanes + self.state.prompt_real.shape[1] + second))
        promoted_drafts = second and plan.num_loops - plan.second_loops == plan.draft_loops
        rows["head"].append(int(self.state.head_rows) if plan.compact
                            else batch * (head_columns(plan) + promoted_drafts))
        rows["embed"].append(batch * (1 + second))

    def _stream(self, counts: list[int], finished: list[bool], tokens: torch.Tensor | None) -> None:
        """Feed the streamer like plain decoding: column i once every unfinished sequence has it (every column
        once all have finished); several columns per read-back."""
        if self.streamer is None:
            return
        ready = min((n for n, f in zip(counts, finished) if not f), default=max(counts, default=0))
        while self.streamed < ready:
            self.streamer.put(tokens[:, self.streamed].to(self.input_ids.dtype))
            self.streamed += 1

    def _result(self) -> DecodeResult:
        state = self.state
        for b, lengths in enumerate(state.kv_len.tolist()):
            for plane, length in enumerate(lengths):
                self.cache.truncate(b, plane, length)
        for row in state.counters.tolist():
            self.stats.per_sequence.append(SequenceStats(**dict(zip(COUNTERS, row))))
        self.stats.core_calls = int(state.core_calls)
        steps = int(state.n_out.max()) if len(state.n_out) else 0
        sequences = torch.cat([self.input_ids.long(), state.out[:, :steps]], 1)  # int64, as plain decoding's
        return DecodeResult(sequences=sequences, stats=self.stats, trace=self.tracer and self.tracer.cycles,
                            **outputs.steps(state, steps))
