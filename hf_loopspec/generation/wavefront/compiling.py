"""The compiled forms of the wavefront step (`torch.compile(fullgraph=True)` of `step.make_cycles`), built on first
use and kept beside the model (`compiled.compiled_store`), so that later runs of the same plan and shapes compile
nothing."""

from __future__ import annotations

import types

import torch

from ..compiled import compiled_store
from .device import GraphStep, uses_cuda_graphs
from .state import Plan, WavefrontState
from .step import make_cycles

# Inductor's options for the step function on a CPU in fp32: a C++ wrapper, no Python between the kernels. Not in
# bf16: there the C++ wrapper's step of block mode put non-finite values into alive lanes' hidden states
# and KV (ouro-tiny, prompt 128: EOS from the second token on), which neither the Python wrapper nor the eager step
# did. With the wrapper put back for bf16 (here and in `compiled_prefill`), `test_compiled_bf16_block_stays_finite`
# passes on the current step and torch; it stays off in bf16 until something shows it sound there.
CPU_INDUCTOR_OPTIONS = {"cpp_wrapper": True}
# Inductor's options for a step with second proposals: no buffer reused in place. With that reuse the compiled step of
# pipeline mode with `second_draft_loops` (ouro-tiny, CPU, fp32, with or without the C++ wrapper) wrote other values
# into the sibling's private KV rows and the pools than the eager step from its first call on, and committed other
# tokens than plain decoding; without it, the eager step's tokens (`test_compiled_second_proposals_keep_plains_tokens`).
SIBLING_INDUCTOR_OPTIONS = {"inplace_buffers": False}


# The model's store of compiled step functions (`compiled.compiled_store`): {(plan, cycles, backend, lane dtype, CUDA
# graphs) or (plan, "prefill", backend, lane dtype): compiled function} (`compiled_cycles`, `compiled_prefill`)
STORE = "wavefront"


def _private_copy(function):
    """`function` with a code object of its own: dynamo counts a function's compiles (against its recompile limit)
    and keeps its automatic-dynamic record per code object."""
    return types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)


def compiled_cycles(model, plan: Plan, cycles: int, backend: str, device: torch.device):
    """`torch.compile(fullgraph=True)` of `cycles` cycles of `plan`'s step for `model` (`step.make_cycles`), built
    on first use and kept beside the model, so that later runs of the same plan (and shapes) compile nothing. Each is
    compiled from a private copy of the function's code (`_private_copy`). Inductor on CUDA
    compiles with `mode="reduce-overhead"` (CUDA graphs, with an eager fallback: `device.GraphStep`; untested on a
    GPU)."""
    store = compiled_store(model, STORE)
    key = (plan, cycles, backend, model.lane_dtype, uses_cuda_graphs(device, backend))
    if key not in store:
        run = make_cycles(model, plan, cycles)
        options = None
        if backend == "inductor":
            cpp_wrapper = device.type == "cpu" and model.lane_dtype == torch.float32
            options = inductor_options(plan, {"triton.cudagraphs": True} if key[-1] else  # mode "reduce-overhead"
                                       CPU_INDUCTOR_OPTIONS if cpp_wrapper else {})
        compiled = torch.compile(_private_copy(run), backend=backend, fullgraph=True, options=options)
        store[key] = untraceable_named(GraphStep(compiled, run) if key[-1] else compiled, backend)
    return store[key]


def inductor_options(plan: Plan, options: dict) -> dict | None:
    """`options` for inductor's compile of `plan`'s step, with `SIBLING_INDUCTOR_OPTIONS` for second proposals;
    None for none."""
    options = {**options, **(SIBLING_INDUCTOR_OPTIONS if plan.second_loops is not None else {})}
    return options or None


def compiled_prefill(model, plan: Plan, backend: str):
    """One cycle of `plan`'s step for `model`, compiled (fullgraph) for states that carry prompt rows, with their
    number P dynamic: one graph serves every prompt width of the bucket of C (P = 1, a prompt of two tokens, gets a
    graph of its own: dynamo specializes sizes 0 and 1). Inductor's default mode everywhere: no CUDA graphs (they are
    captured per shape, and P varies) and no C++ wrapper (with it, a second prompt width compiled again on
    `ouro-tiny`). Kept beside the model like `compiled_cycles`."""
    store = compiled_store(model, STORE)
    key = (plan, "prefill", backend, model.lane_dtype)
    if key not in store:
        private = _private_copy(make_cycles(model, plan, 1))
        options = inductor_options(plan, {}) if backend == "inductor" else None
        compiled = torch.compile(private, backend=backend, fullgraph=True, options=options)

        def cycle(state: WavefrontState, noise: torch.Tensor | None) -> WavefrontState:
            if state.prompt_real.shape[1] > 1:
                torch._dynamo.mark_dynamic(state.prompt_hidden, 1)
                torch._dynamo.mark_dynamic(state.prompt_real, 1)
            return compiled(state, noise)

        store[key] = untraceable_named(cycle, backend)
    return store[key]


def untraceable_named(run, backend: str):
    """`run` (a compiled step) with dynamo's refusal to trace the model's code (`torch._dynamo.exc.Unsupported`, e.g.
    from an adapter's layers that torch.compile cannot capture whole) raised as a `ValueError` naming `compile_core`
    and the fix."""

    def checked(state: WavefrontState, noise: torch.Tensor | None) -> WavefrontState:
        try:
            return run(state, noise)
        except torch._dynamo.exc.Unsupported as error:
            reason = str(error).strip().splitlines()[0]
            raise ValueError(f"compile_core (backend {backend!r}): torch.compile cannot trace this model's step whole "
                             f"({reason}); decode it eager (compile_core=None), or drop the modules it cannot "
                             "trace.") from error

    return checked


def one_at_a_time(cycle, cycles: int):
    """`cycles` calls of the one-cycle function `cycle`, as a function `(state, noise) -> state` of `cycles` cycles
    (`noise`: `[cycles, ...]` or None, as `make_cycles` takes it)."""

    def run(state: WavefrontState, noise: torch.Tensor | None) -> WavefrontState:
        for i in range(cycles):
            state = cycle(state, None if noise is None else noise[i: i + 1])
        return state

    return run
