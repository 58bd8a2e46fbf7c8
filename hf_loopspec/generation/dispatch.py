"""Where a speculative `generate` run goes: one request object (`SpeculativeRequest`) and one engine.

`generate` (`LoopSpecGenerationMixin._sample`) builds a `SpeculativeRequest` and calls `run_speculative`, which runs
the wavefront engine (`generation.wavefront`) on every device, eager or compiled (`speculative_engine` "auto" and
"wavefront" are the same engine). A setting the engine does not support (`unsupported`) raises a `ValueError` that
names it; nothing switches engine or decodes another way without saying so. One explicit exception: a
`PagedLoopCache(debug=True)` asks for the lineage checks of invariant I1, which follow the lane decoder's lanes, so
such a call runs the reference under "auto" (`decoder.LaneDecoder`; `out.speculation.engine == "lanes"`), eager
(`compile_core` with it is refused), and `speculative_engine="wavefront"` refuses it.

The reference takes the same request (`LaneDecoder.from_request`), and `model.decode_with_lanes(...)` runs it
directly: it is the tests' oracle for tokens, counters and KV planes, not an engine users choose for speed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace

import torch
from transformers import MaxLengthCriteria

from ..cache.paged import PagedLoopCache
from .config import SpeculativeConfig
from .decoder import DraftHook, ExitRule, LaneDecoder
from .records import DecodeResult
from .siblings import SecondHook
from .wavefront.engine import WavefrontEngine
from .wavefront.host import compile_problem
from .wavefront.limits import cache_problem
from .wavefront.span import reserved_positions


@dataclass(frozen=True)
class SpeculativeRequest:
    """What one speculative run needs: the resolved settings, the cache, the prompt and every option of the call,
    under the lane decoder's names (the reference takes them as keyword arguments: `options`)."""

    spec: SpeculativeConfig
    cache: PagedLoopCache  # empty, or holding the stored history of a continued call
    input_ids: torch.Tensor  # [B, S] left-padded ids (the columns after a continued cache's stored ones)
    max_length: int  # S + max_new_tokens (columns of the output, the cache's stored ones included)
    attention_mask: torch.Tensor | None = None  # [B, S'] padding mask (S' >= S: a continued call's full mask); None
    logits_processor: object = None  # transformers' LogitsProcessorList, or None
    stopping_criteria: object = None  # transformers' StoppingCriteriaList, or None
    pad_token_id: int | None = None
    streamer: object = None  # a transformers streamer: put(ids [B] or [B, S]), end()
    draft_hook: DraftHook | None = None  # test-only override of draft proposals
    second_draft_hook: SecondHook | None = None  # test-only override of second proposals
    do_sample: bool = False
    output_scores: bool = False
    output_logits: bool = False
    trace: bool | str = False  # True or "hidden": record every cycle
    exit_rule: ExitRule | None = None  # the target logits of exit options (Ouro's exit_at_step, ...); None: head
    complete_cache: bool = False  # leave the cache as plain decoding would (every output column but the last)

    def __post_init__(self):
        if self.input_ids.dtype != torch.long:  # int32 ids, which generate takes, as the int64 the engine indexes with
            object.__setattr__(self, "input_ids", self.input_ids.long())
        # a block round drafts at most the new tokens there are: K + 1 lanes each call, so a K far past them (K=4096
        # for 5 tokens) cost time that grew with K for nothing (the drafts past max_length are never verified)
        new = self.max_length - (self.input_ids if self.attention_mask is None else self.attention_mask).shape[1]
        if self.spec.num_speculative_tokens > max(new, 1):
            object.__setattr__(self, "spec", replace(self.spec, num_speculative_tokens=max(new, 1)))
        if self.spec.second_draft_loops is None:  # (no second proposal calls it: dropped, as plain decoding drops
            object.__setattr__(self, "second_draft_hook", None)  # the hooks; compile_core refused it)

    def options(self) -> dict:
        """Every field but `spec` and `cache`, by name (the lane decoder's keyword arguments)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("spec", "cache")}


def run_speculative(model, request: SpeculativeRequest) -> DecodeResult:
    """One speculative run of `generate` (see the module docstring); raises `ValueError` naming every setting of
    the request the engine does not support."""
    if request.cache.debug and request.spec.engine == "auto":
        if request.spec.compile_backend is not None:  # (it ran the reference eager, the setting unused)
            raise ValueError("compile_core with a PagedLoopCache(debug=True): such a cache runs the reference decoder "
                             "(its lineage checks follow the reference's lanes), which does not compile; drop "
                             "compile_core, or pass a cache made with debug=False.")
        result = LaneDecoder.from_request(model, request).run()
    elif problems := unsupported(model, request):
        raise ValueError(f"speculative decoding (the wavefront engine) does not support {'; '.join(problems)}. "
                         "Otherwise decode plainly (speculative_mode=None).")
    else:
        result = WavefrontEngine.from_request(model, request).run()
    warn_past_positions(request.stopping_criteria, result.sequences, request.input_ids.shape[1])
    return result


def warn_past_positions(stopping_criteria, sequences: torch.Tensor, prompt_len: int) -> None:
    """transformers' warning for decoding past the model's positions, which plain decoding's `MaxLengthCriteria` gives
    at the first step whose length passes them, short of `max_length`: the engines judge `max_length` themselves and
    never call it, so it is called here once on the `sequences` `[B, L]` as long as that step's."""
    for criterion in stopping_criteria or ():
        if type(criterion) is MaxLengthCriteria and criterion.max_position_embeddings is not None:
            first = max(criterion.max_position_embeddings, prompt_len) + 1
            if first <= min(sequences.shape[1], criterion.max_length - 1):
                criterion(sequences[:, :first], None)


def unsupported(model, request: SpeculativeRequest) -> list[str]:
    """The settings of `request` that the wavefront engine does not support, each named (empty: it runs)."""
    cache, ids, max_length = request.cache, request.input_ids, request.max_length
    compiled = request.spec.compile_backend is not None
    problems = [problem] if (problem := cache_problem(cache)) else []
    positions = reserved_positions(max_length, compiled)
    reserved = len(ids) * cache.num_planes * positions * cache.bytes_per_token_per_depth(model.lane_dtype)
    if reserved > free_memory(ids.device) / 2:
        problems.append(f"{len(ids)} sequences of up to {max_length} columns (the prompt and the new tokens; KV "
                        f"pages for {positions} positions of each in {cache.num_planes} planes, reserved up front, "
                        f"need {reserved / 2**30:.1f} GiB: more than half the free memory): lower max_new_tokens (or "
                        "max_length), or pass fewer sequences per call")
    if compiled and (host := compile_problem(request.logits_processor, ids.shape[1], request.draft_hook,
                                             request.second_draft_hook)):
        problems.append(host)
    if compiled and any(p.device.type == "meta" for p in model.parameters()):
        problems.append("compile_core with a model offloaded by accelerate (weights on the meta device, moved in by "
                        "hooks at each call, which torch.compile cannot trace); load the model onto one device to "
                        "compile, or drop compile_core")
    return problems


def free_memory(device: torch.device) -> int:
    """Bytes of memory free on `device` (CUDA: the driver's count plus what torch's allocator holds unused, which it
    hands out again; otherwise the host's available memory)."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
