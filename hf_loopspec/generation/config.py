"""The speculative-decoding settings of one `generate` call, and their validation.

The keys live on `GenerationConfig` (so they also load from `generation_config.json`) and are accepted as
`generate` kwargs:

* `speculative_mode`: `"pipeline"`, `"block"` or `None` (plain decoding).
* `draft_loops` (d): draft from the hidden state after d loops; 1 <= d < U; pipeline needs U % d == 0.
* `num_speculative_tokens` (K): drafts per round in block mode; >= 1.
* `compile_core`: `False` (default), `True` (`torch.compile` with inductor) or a `torch.compile` backend name:
  the core and head calls run as static-shape compiled calls over row buckets (`generation.stages`).
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers.generation import GenerationConfig, GenerationMode

SPECULATIVE_KEYS = ("speculative_mode", "draft_loops", "num_speculative_tokens", "compile_core")
MODES = ("pipeline", "block")


@dataclass(frozen=True)
class SpeculativeConfig:
    mode: str  # "pipeline" | "block" (decode_with_lanes also takes "ar", the engine without drafting)
    draft_loops: int
    num_speculative_tokens: int
    compile_backend: str | None = None  # torch.compile backend of the core and head calls; None: eager


def speculative_config(generation_config: GenerationConfig, num_loops: int) -> SpeculativeConfig | None:
    """Read and validate the speculative keys; `None` when `speculative_mode` is unset (plain decoding)."""
    mode = getattr(generation_config, "speculative_mode", None)
    backend = compile_backend(getattr(generation_config, "compile_core", None))
    if mode is None:
        if backend is not None:
            raise ValueError(f"compile_core={generation_config.compile_core!r} applies to the speculative modes' "
                             "lane decoder; set speculative_mode, or for plain decoding use transformers' own "
                             "compilation (cache_implementation='static').")
        return None
    if mode not in MODES:
        raise ValueError(f"speculative_mode={mode!r} is not supported; use one of {MODES} or None for plain "
                         "decoding.")
    draft_loops = getattr(generation_config, "draft_loops", None)
    draft_loops = 1 if draft_loops is None else draft_loops
    k = getattr(generation_config, "num_speculative_tokens", None)
    k = 4 if k is None else k
    if not isinstance(draft_loops, int) or not 1 <= draft_loops <= num_loops - 1:
        raise ValueError(
            f"draft_loops={draft_loops!r} is outside [1, {num_loops - 1}] for a model with {num_loops} loops: "
            "drafts come from a shallower loop than the last one. "
            + ("A 1-loop model cannot self-speculate; use speculative_mode=None." if num_loops < 2
               else f"Pass an integer between 1 and {num_loops - 1}.")
        )
    if mode == "pipeline" and num_loops % draft_loops:
        valid = [d for d in range(1, num_loops) if num_loops % d == 0]
        raise ValueError(
            f"speculative_mode='pipeline' needs the loop count ({num_loops}) to be a multiple of "
            f"draft_loops={draft_loops}; use draft_loops in {valid} or speculative_mode='block'."
        )
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"num_speculative_tokens={k!r} must be an integer >= 1 (drafts per block round).")
    return SpeculativeConfig(mode, draft_loops, k, backend)


def compile_backend(compile_core) -> str | None:
    """The `torch.compile` backend `compile_core` asks for (`True`: inductor), or None for eager calls."""
    if compile_core is None or compile_core is False:
        return None
    if compile_core is True:
        return "inductor"
    import torch

    if not isinstance(compile_core, str) or compile_core not in torch._dynamo.list_backends(exclude_tags=()):
        raise ValueError(f"compile_core={compile_core!r} must be True, False or a torch.compile backend name, "
                         f"e.g. {', '.join(torch._dynamo.list_backends())} or aot_eager.")
    return compile_core


def check_generation_mode(spec: SpeculativeConfig, generation_mode, generation_config, assistant_model) -> None:
    """Reject combinations of a speculative mode with other decoding strategies."""
    if assistant_model is not None or generation_mode == GenerationMode.ASSISTED_GENERATION:
        what = "an assistant model" if assistant_model is not None else (
            f"prompt lookup (prompt_lookup_num_tokens={generation_config.prompt_lookup_num_tokens})"
            if generation_config.prompt_lookup_num_tokens else "assisted generation")
        raise ValueError(f"speculative_mode={spec.mode!r} cannot be combined with {what}: the model drafts for "
                         "itself. Drop one of the two.")
    if generation_config.num_beams > 1 or generation_mode in (GenerationMode.BEAM_SEARCH,):
        raise ValueError(f"speculative_mode={spec.mode!r} cannot be combined with beam search "
                         f"(num_beams={generation_config.num_beams}); pass num_beams=1 or speculative_mode=None.")
    if generation_mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        raise ValueError(f"speculative_mode={spec.mode!r} supports greedy decoding and sampling, not "
                         f"{generation_mode}.")
