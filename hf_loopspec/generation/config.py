"""The speculative-decoding settings of one `generate` call, their defaults, and their validation.

The keys live on `GenerationConfig` (so they also load from `generation_config.json`) and are accepted as
`generate` kwargs:

* `speculative_mode`: `"pipeline"`, `"block"`, `"auto"` (`generation.auto`: plain, block or pipeline chosen per
  segment from measured call costs and the observed acceptance; `draft_loops` / `num_speculative_tokens`, when
  given, restrict its candidates) or `None` (plain decoding).
* `draft_loops` (d): draft from the hidden state after d loops; 1 <= d < U; pipeline needs U % d == 0.
* `num_speculative_tokens` (K): drafts per round in block mode; >= 1.
* `compile_core`: `False` (default), `True` (`torch.compile` with inductor) or a `torch.compile` backend name:
  the wavefront engine's whole step is compiled (fullgraph).
* `speculative_engine`: `"auto"` (default) or `"wavefront"`, the same engine (`generation.dispatch`). The old value
  `"lanes"` is refused with a message: the lane decoder is the readable reference, `model.decode_with_lanes(...)`.
* `second_draft_loops` (d2): pipeline only, max(d + 1, U - d) <= d2 < U: a lane re-reads its draft at depth d2 and a
  different proposal starts a sibling (the engine keeps one per sequence: `wavefront.limits`); `None` (default): off.
  The reference (`decode_with_lanes`) also runs d < d2 < U - d (`generation.siblings`).

`resolve_speculative` is the one validation of these settings: `generate` resolves them once per call (from the
generation config, `speculative_config`) and passes the `SpeculativeConfig` down; `decode_with_lanes`, the bench
and the export validate through the same function.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
from transformers.generation import GenerationConfig, GenerationMixin, GenerationMode

from ..defaults import DEFAULT_DRAFT_LOOPS, DEFAULT_NUM_SPECULATIVE_TOKENS
from .inputs import as_integer, count_settings_as_ints

SPECULATIVE_KEYS = ("speculative_mode", "draft_loops", "num_speculative_tokens", "compile_core", "speculative_engine",
                    "second_draft_loops")
MODES = ("pipeline", "block")
EXIT_OPTIONS = ("exit_at_step", "exit_threshold", "use_weighted_exit")  # Ouro's exit selection (forward, generate)
RECURRENCE_OPTIONS = ("num_steps", "init_scale", "init_seed")  # Huginn's recurrence settings (forward, generate)

COMMON_BACKENDS = ("inductor", "aot_eager", "eager", "cudagraphs")  # registered by torch, no package needed
BACKEND_PACKAGES = {"tvm": "tvm", "openxla": "torch_xla", "openxla_eval": "torch_xla"}  # (registered either way)
AUTO_MODE = "auto"  # chosen per segment by `generation.auto`; never reaches an engine
SETTABLE_MODES = (*MODES, AUTO_MODE)  # what `speculative_mode` accepts besides None
LANE_MODES = ("ar", *MODES)  # `decode_with_lanes` also runs "ar": the reference without drafting
ENGINES = ("auto", "wavefront")
RETIRED_ENGINES = ("lanes",)  # values of earlier versions (a saved generation_config.json may hold one)


def asks(value) -> bool:
    """Whether an option's value asks for something: None and False do not (0, as `exit_at_step=0`, does)."""
    return value is not None and value is not False


@dataclass(frozen=True)
class SpeculativeConfig:
    """Validated settings of one speculative run (build it with `resolve_speculative`)."""

    mode: str  # one of LANE_MODES
    draft_loops: int = DEFAULT_DRAFT_LOOPS
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    compile_backend: str | None = None  # torch.compile backend of the core and head calls; None: eager
    engine: str = "auto"  # one of ENGINES
    second_draft_loops: int | None = None  # d2: depth of second proposals (pipeline); None: off


def resolve_speculative(mode, draft_loops=None, num_speculative_tokens=None, compile_core=None, engine=None, *,
                        num_loops: int, modes: tuple[str, ...] = SETTABLE_MODES, second_draft_loops=None,
                        reference: bool = False) -> SpeculativeConfig:
    """Validate one run's settings for a model of `num_loops` loops; `None` takes the default. Raises `ValueError`
    naming the argument, its value and the fix. `reference`: settings of the reference (`decode_with_lanes`),
    which also runs second proposals the engine cannot."""
    if mode not in modes:
        raise ValueError(f"speculative_mode={mode!r} is not supported; use one of {modes} or None for plain "
                         "decoding.")
    draft_loops = DEFAULT_DRAFT_LOOPS if draft_loops is None else as_integer(draft_loops, "draft_loops")
    k = (DEFAULT_NUM_SPECULATIVE_TOKENS if num_speculative_tokens is None
         else as_integer(num_speculative_tokens, "num_speculative_tokens"))
    if mode != "ar":  # auto: the depth must suit block mode (pipeline candidates are filtered by `generation.auto`)
        _check_draft_loops("block" if mode == AUTO_MODE else mode, draft_loops, num_loops)
    if k < 1:
        raise ValueError(f"num_speculative_tokens={k!r} must be an integer >= 1 (drafts per block round).")
    engine = "auto" if engine is None else engine
    if engine in RETIRED_ENGINES:
        raise ValueError(f"speculative_engine={engine!r} is no longer an engine: the lane decoder is now the readable "
                         "test reference, reachable as model.decode_with_lanes(...). Pass speculative_engine='auto' "
                         "(the wavefront engine), or remove speculative_engine from the generation config (e.g. the "
                         "checkpoint's generation_config.json).")
    if engine not in ENGINES:
        raise ValueError(f"speculative_engine={engine!r} is not an engine; use one of {ENGINES} (both run the "
                         "wavefront engine).")
    backend = compile_backend(compile_core)
    least = draft_loops + 1 if reference else max(draft_loops + 1, num_loops - draft_loops)  # (the engine's rule)
    second = _check_second_draft_loops(mode, draft_loops, second_draft_loops, num_loops, least)
    from .wavefront.limits import second_proposals_problem  # here: the engine's package imports this module

    problem = None if reference else second_proposals_problem(mode, num_loops, draft_loops, second)
    if problem:
        allowed = list(range(max(draft_loops + 1, num_loops - draft_loops), num_loops))
        raise ValueError(f"{problem}; pass second_draft_loops in {allowed} or None (model.decode_with_lanes runs "
                         "the others on the reference).")
    return SpeculativeConfig(mode, draft_loops, k, backend, engine, second)


ONE_LOOP_ADVICE = ": decode plainly (speculative_mode=None), or give a Huginn model's generate num_steps >= 2"


def _check_draft_loops(mode: str, draft_loops, num_loops: int) -> None:
    if num_loops < 2:
        raise ValueError("speculative decoding drafts from a shallower loop than the last, but this call runs "
                         f"{num_loops} loop (a Huginn model with num_steps={num_loops}, or a 1-loop model)"
                         f"{ONE_LOOP_ADVICE}.")
    if not 1 <= draft_loops <= num_loops - 1:
        raise ValueError(
            f"draft_loops={draft_loops!r} is outside [1, {num_loops - 1}] for a model with {num_loops} loops: "
            f"drafts come from a shallower loop than the last one. Pass an integer between 1 and {num_loops - 1}."
        )
    if mode == "pipeline" and num_loops % draft_loops:
        valid = [d for d in range(1, num_loops) if num_loops % d == 0]
        raise ValueError(
            f"speculative_mode='pipeline' needs the loop count ({num_loops}) to be a multiple of "
            f"draft_loops={draft_loops}; use draft_loops in {valid} or speculative_mode='block'."
        )


UNSET_SAVED = "second_draft_loops=None in the call, where it comes from the model's generation_config.json"


def _check_second_draft_loops(mode: str, draft_loops: int, second, num_loops: int, least: int) -> int | None:
    """`second_draft_loops` validated (None: off); an out-of-range one is told the values from `least` up, those
    the decoder that will run accepts."""
    if second is None:
        return None
    second = as_integer(second, "second_draft_loops")
    if mode == AUTO_MODE:
        takes = num_loops % draft_loops == 0 and least <= second < num_loops  # (pipeline mode would take it)
        pipeline = ", or pass speculative_mode='pipeline'" if takes else ""
        raise ValueError(f"second_draft_loops={second} cannot be combined with speculative_mode='auto' (it chooses "
                         "among plain, block and pipeline without second proposals); drop second_draft_loops "
                         f"({UNSET_SAVED}){pipeline}.")
    if mode != "pipeline":
        raise ValueError(f"second_draft_loops={second} needs speculative_mode='pipeline' (got {mode!r}): second "
                         "proposals re-read a pipeline lane's draft; drop second_draft_loops for other modes "
                         f"({UNSET_SAVED}).")
    if not draft_loops < second < num_loops:
        raise ValueError(f"second_draft_loops={second} must lie strictly between draft_loops={draft_loops} and the "
                         f"loop count {num_loops} (a deeper draft than the first, shallower than the target); "
                         f"{_second_draft_fix(draft_loops, num_loops, least)}.")
    return second


def _second_draft_fix(draft_loops: int, num_loops: int, least: int) -> str:
    """What to pass instead of a `second_draft_loops` outside `[least, num_loops)`: a value of that range, or None
    where the range is empty (pipeline mode: only a call of 2 loops, whose draft_loops=1 leaves no loop above it; a
    Huginn call's `num_steps` sets its loop count)."""
    if least < num_loops:
        return f"pass one of {list(range(least, num_loops))} or None"
    return (f"this call runs {num_loops} loops, with no loop between draft_loops={draft_loops} and the target: pass "
            f"second_draft_loops=None, or give a Huginn model's generate num_steps >= {num_loops + 1}")


def speculative_config(generation_config: GenerationConfig, num_loops: int) -> SpeculativeConfig | None:
    """The speculative keys of a generation config, resolved; `None` when `speculative_mode` is unset (plain)."""
    mode = getattr(generation_config, "speculative_mode", None)
    compile_core = getattr(generation_config, "compile_core", None)
    engine = getattr(generation_config, "speculative_engine", None)
    if mode is None:
        second = getattr(generation_config, "second_draft_loops", None)
        if second is not None:
            raise ValueError(f"second_draft_loops={second!r} is a setting of speculative_mode='pipeline'; set that "
                             "too, or drop second_draft_loops for plain decoding.")
        if engine not in (None, "auto"):
            raise ValueError(f"speculative_engine={engine!r} chooses the engine of a speculative mode; set "
                             "speculative_mode too, or drop speculative_engine for plain decoding.")
        if compile_backend(compile_core) is not None:
            raise ValueError(f"compile_core={compile_core!r} compiles the speculative modes' engine; set "
                             "speculative_mode, or for plain decoding use transformers' own compilation "
                             "(cache_implementation='static').")
        return None
    return resolve_speculative(mode, getattr(generation_config, "draft_loops", None),
                               getattr(generation_config, "num_speculative_tokens", None), compile_core, engine,
                               num_loops=num_loops,
                               second_draft_loops=getattr(generation_config, "second_draft_loops", None))


def compile_backend(compile_core) -> str | None:
    """The `torch.compile` backend `compile_core` asks for (`True`: inductor), or None for eager calls; `ValueError`
    for a name that is not one of `usable_backends()`."""
    if compile_core is None or compile_core is False:
        return None
    if compile_core is True:
        return "inductor"
    if not isinstance(compile_core, str) or compile_core not in usable_backends():
        raise ValueError(f"compile_core={compile_core!r} must be True, False or a torch.compile backend name usable "
                         "here (one of torch._dynamo.list_backends(exclude_tags=()), but torch's *_TESTING_ONLY ones "
                         f"and those whose package is missing), e.g. {', '.join(COMMON_BACKENDS)}.")
    return compile_core


def usable_backends() -> list[str]:
    """The `torch.compile` backends a compiled step can take here: every one torch has registered (its debugging
    ones and installed packages' included) but its test backends (made to fail) and those whose package is not
    installed (`BACKEND_PACKAGES`: torch registers them anyway, and they failed inside dynamo at the first call)."""
    return [name for name in torch._dynamo.list_backends(exclude_tags=()) if "TESTING_ONLY" not in name
            and (name not in BACKEND_PACKAGES or importlib.util.find_spec(BACKEND_PACKAGES[name]))]


def requested_mode(model, kwargs: dict):
    """The `speculative_mode` a `generate` call with `kwargs` asks for: its own, else its generation config's, else
    (that one unset, as transformers merges a passed config over the model's) the model's."""
    if "speculative_mode" in kwargs:
        return kwargs["speculative_mode"]
    mode = getattr(kwargs.get("generation_config"), "speculative_mode", None)
    return mode if mode is not None else getattr(model.generation_config, "speculative_mode", None)


def custom_loop_settings(mode, trace=None) -> dict:
    """The speculative settings that replace a call's when its `custom_generate` is a callable, a decoding loop that
    replaces generate's own (and so the speculative one), and it asks for `mode` and `speculative_trace=trace`
    (checked first: `call.trace_setting`): auto, free to decode plainly, does so (every speculative key None: its engine
    settings go with it); plain keeps its own (none); pipeline or block, or a trace asked for, raise a `ValueError`
    (their loop would not run, without a word)."""
    if mode not in (None, AUTO_MODE):
        raise ValueError(f"speculative_mode={mode!r} cannot be combined with a callable custom_generate: a decoding "
                         "loop of your own replaces the speculative one; pass speculative_mode=None.")
    from .call import trace_setting  # (here: call imports this module)

    if trace_setting(trace):
        raise ValueError(f"speculative_trace={trace!r} records a speculative mode's cycles, but a callable "
                         "custom_generate replaces generate's loop, so none runs (speculative_mode='auto' decodes "
                         "plainly then): there are no cycles. Drop speculative_trace, or custom_generate.")
    return dict.fromkeys(SPECULATIVE_KEYS) if mode == AUTO_MODE else {}


STRATEGY_SETTINGS = {  # the settings that select a decoding strategy the speculative modes do not run
    GenerationMode.CONTRASTIVE_SEARCH: ("penalty_alpha",), GenerationMode.DOLA_GENERATION: ("dola_layers",),
    GenerationMode.GROUP_BEAM_SEARCH: ("num_beam_groups",),
    GenerationMode.CONSTRAINED_BEAM_SEARCH: ("constraints", "force_words_ids"),
}


def reject_assistant_early_exit(generation_config) -> None:
    """`ValueError` for transformers' self-speculation from a pass's first layers, in every mode (before any work:
    transformers edits the model's config for it)."""
    if generation_config.assistant_early_exit is not None:
        raise ValueError(f"assistant_early_exit={generation_config.assistant_early_exit!r} drafts from the first "
                         "layers of one pass, which a looped model does not have: every loop runs all its layers. "
                         "Drop it; speculative_mode='pipeline' drafts from a shallower loop.")


def check_generation_mode(spec: SpeculativeConfig, generation_mode, generation_config, assistant_model) -> None:
    """Reject combinations of a speculative mode with other decoding strategies, naming the setting that asks for
    one."""
    reject_assistant_early_exit(generation_config)
    if assistant_model is not None or generation_mode == GenerationMode.ASSISTED_GENERATION:
        what = "an assistant model" if assistant_model is not None else (
            f"prompt lookup (prompt_lookup_num_tokens={generation_config.prompt_lookup_num_tokens})"
            if generation_config.prompt_lookup_num_tokens is not None else "assisted generation")
        drop = "the assistant" if assistant_model is not None else "prompt_lookup_num_tokens"
        raise ValueError(f"speculative_mode={spec.mode!r} cannot be combined with {what}: the model drafts for "
                         "itself. Pass speculative_mode=None for assisted decoding (the mode may come from the "
                         f"model's generation_config.json), or drop {drop}.")
    if (generation_config.num_beams or 1) > 1 or generation_mode in (GenerationMode.BEAM_SEARCH,):  # (None: unset)
        raise ValueError(f"speculative_mode={spec.mode!r} cannot be combined with beam search "
                         f"(num_beams={generation_config.num_beams}); pass num_beams=1 or speculative_mode=None.")
    if getattr(generation_config, "output_attentions", False):  # (in no mode: models.layers.check_forward_inputs)
        raise ValueError("output_attentions=True is not supported: the looped models' attention (dense or paged, over "
                         "one KV plane per depth) never materializes its weights, in any mode or forward call. Drop "
                         "output_attentions.")
    if getattr(generation_config, "output_hidden_states", False):
        raise ValueError(f"output_hidden_states=True is not supported with speculative_mode={spec.mode!r}: "
                         "speculative decoding never runs padding columns, so it cannot return plain decoding's "
                         "per-step tensors. Use speculative_mode=None for output_hidden_states, or a forward call on "
                         "the output sequences.")
    if generation_mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        key = next((key for key in STRATEGY_SETTINGS.get(generation_mode, ()) if getattr(generation_config, key, None)
                    is not None), None)  # the one the config sets
        asked = f" ({key}={getattr(generation_config, key)!r}); drop {key}," if key else ";"
        raise ValueError(f"speculative_mode={spec.mode!r} supports greedy decoding and sampling, not "
                         f"{generation_mode.value.replace('_', ' ')}{asked} or pass speculative_mode=None.")


def settings_fallback(generation_config, synced_gpus: bool) -> str | None:
    """Why a call's settings ask for something besides its tokens that only plain decoding does, or None. The engine
    prefills a prompt in one call and stops calling the model once its rows have stopped; plain decoding honours
    `prefill_chunk_size` (the prompt in chunks, which bounds the prefill's memory) and `synced_gpus` (a process whose
    rows have stopped keeps calling forward until every process's have, as DeepSpeed ZeRO-3 and FSDP need: the
    others gather sharded weights in each call). Such a call decodes plainly: its tokens are the same."""
    if synced_gpus:
        return ("synced_gpus=True asks every process to call the model until all have finished, which speculative "
                "decoding does not do; decoded with plain decoding instead")
    chunk = getattr(generation_config, "prefill_chunk_size", None)
    if chunk is not None:
        return (f"prefill_chunk_size={chunk!r} asks for a prompt prefilled in chunks, which speculative decoding does "
                "not do; decoded with plain decoding instead")
    return None


def synced_gpus_of(model, synced_gpus) -> bool:
    """`generate`'s `synced_gpus` as transformers resolves it: the argument, else True for a model that DeepSpeed
    ZeRO-3 or FSDP shards over more than one process."""
    if synced_gpus is not None:
        return bool(synced_gpus)
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    from transformers.integrations.fsdp import is_fsdp_managed_module

    many = torch.distributed.is_available() and torch.distributed.is_initialized() \
        and torch.distributed.get_world_size() > 1
    return bool(many and (is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model)))


def merged_config(model, kwargs: dict) -> GenerationConfig:
    """A call's generation config as transformers resolves it for plain decoding: the passed config
    (`kwargs["generation_config"]`) over the model's over the global defaults (`keep_passed_exit` applied), then the
    call's generation kwargs (the speculative keys left out: their callers read them themselves), its numpy counts as
    Python ints. A copy: the inputs stay as they were."""
    given = {key: value for key, value in kwargs.items() if key not in SPECULATIVE_KEYS and key != "generation_config"}
    config, _ = GenerationMixin._prepare_generation_config(model, kwargs.get("generation_config"), **given)
    keep_passed_exit(kwargs.get("generation_config"), config)
    count_settings_as_ints(config)  # (as generate's own merge: `LoopSpecGenerationMixin._prepare_generation_config`)
    return config


def merged_exit(given: dict, config) -> dict:
    """The exit options (`EXIT_OPTIONS`) a call runs with, those set only: the call's `given` ones alone when one of
    them chooses an exit (they are alternatives: one replaces all of the config's), else `config`'s with the call's
    over them. None given is not given (`use_weighted_exit=False` chooses nothing, and keeps a config's exit)."""
    given = {key: value for key, value in given.items() if value is not None}
    if any(map(asks, given.values())):
        return given
    return {key: value for key in EXIT_OPTIONS if (value := given.get(key, getattr(config, key, None))) is not None}


def keep_passed_exit(passed, merged) -> None:
    """A config `passed` to a call that chooses an exit replaces the model's exit options in `merged` (the two merged
    as transformers merges them, which fills the passed config's unset keys from the model's): the options are
    alternatives, so the model's `exit_at_step` would meet the passed `exit_threshold` ("Pass at most one")."""
    if passed is not None and any(asks(getattr(passed, key, None)) for key in EXIT_OPTIONS):
        for key in EXIT_OPTIONS:
            setattr(merged, key, getattr(passed, key, None))


def reject_recurrence_options(model_name: str, kwargs: dict) -> None:
    """`ValueError` when `kwargs` set one of Huginn's recurrence settings (`RECURRENCE_OPTIONS`), for a family whose
    loop count is fixed by its config (Ouro): such a setting would otherwise pass through `**kwargs` unread."""
    given = [f"{name}={kwargs[name]!r}" for name in RECURRENCE_OPTIONS if kwargs.get(name) is not None]
    if given:
        raise ValueError(f"{', '.join(given)}: {model_name} has no recurrence settings (they are Huginn's); it runs "
                         "config.total_ut_steps loops: pass exit_at_step=k to take loop k's logits, or change "
                         "total_ut_steps.")
