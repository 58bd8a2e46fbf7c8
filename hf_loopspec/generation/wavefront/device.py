"""The wavefront engine's device-specific parts: read-backs that overlap the next cycles, and CUDA-graph replay.

**Untested on a GPU** (no GPU was available when this was written): on a CPU these paths reduce to a plain copy
and a plain compiled step, which is what the tests run.

* `ReadBack`: a snapshot of the committed counts `[B]`, finished flags `[B]` and, when a streamer is fed, the
  committed-token buffer, taken on the compute stream. On CUDA it is copied into pinned host memory on a side
  stream that waits for the compute stream, with an event the host waits on only when it reads the values
  (`values`), so the cycles launched meanwhile run while the copy lands. On a CPU the values are there at once.
* `GraphStep`: the step compiled with inductor's CUDA graphs (`mode="reduce-overhead"`'s option; each shape is
  captured once and replayed) with the buffers the step writes in place (`IN_PLACE`: the KV pools, the sibling KV
  rows) marked as static addresses. A replay's outputs live in the graphs' memory pool, and the next replay (a new
  generation, `cudagraph_mark_step_begin`) frees them; since every call's inputs are the previous call's outputs,
  `GraphStep` hands the host loop copies (`owned`), the remedy torch's own error message names. If compiling or
  capturing fails, it logs why and runs the eager step from then on (the step is a pure tensor function, so both give
  the same tokens).
"""

from __future__ import annotations

from dataclasses import fields, replace

import torch

from ...logs import get_logger
from .state import WavefrontState

logger = get_logger(__name__)


class ReadBack:
    """One read-back in flight (see the module docstring)."""

    def __init__(self, state: WavefrontState, tokens: bool):
        snapshot = [torch.stack([state.n_out, state.finished.long()])]  # [2, B]
        if tokens:
            snapshot.append(state.out.clone())  # [B, T + 1]
        self.event = None
        if snapshot[0].is_cuda:
            device = snapshot[0].device
            side = _side_stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                host = [torch.empty(x.shape, dtype=x.dtype, pin_memory=True) for x in snapshot]
                for target, source in zip(host, snapshot):
                    target.copy_(source, non_blocking=True)
                    source.record_stream(side)
                self.event = torch.cuda.Event()
                self.event.record(side)
            snapshot = host
        self.host = snapshot

    def values(self) -> tuple[list[int], list[bool], torch.Tensor | None]:
        """Committed counts, finished flags and (when asked for) the token buffer, on the host."""
        if self.event is not None:
            self.event.synchronize()
        both = self.host[0].cpu()
        return both[0].tolist(), [bool(x) for x in both[1].tolist()], self.host[1].cpu() if len(self.host) > 1 \
            else None


_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device):
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


def uses_cuda_graphs(device: torch.device, backend: str | None) -> bool:
    """Whether the step of a run on `device` compiled with `backend` replays CUDA graphs (inductor on CUDA)."""
    return device.type == "cuda" and backend == "inductor"


# the state's tensors the step writes in place
IN_PLACE = ("k_pool", "v_pool", "sib_k", "sib_v", "scores_out", "logits_out")


def owned(result: WavefrontState, given: dict[str, torch.Tensor]) -> WavefrontState:
    """`result` (the state a call of the compiled step returned; the step may rebind the fields of the state it was
    given) holding no tensor a later replay can free. `given`: the state's tensors before the call, by field name.
    The `IN_PLACE` buffers are the given ones (the step wrote them), every other tensor that is not a given one
    passed through is copied."""
    changes = {}
    for field in fields(result):
        value, before = getattr(result, field.name), given[field.name]
        if field.name in IN_PLACE:
            changes[field.name] = before
        elif value is not before:
            changes[field.name] = value.clone()
    return replace(result, **changes)


class GraphStep:
    """The step compiled with CUDA graphs (`compiling.compiled_cycles`), with an eager fallback. Its result owns its
    tensors (`owned`), so it is a valid input for the next call and for the eager step."""

    def __init__(self, compiled, eager):
        self.compiled, self.eager, self.failed = compiled, eager, False

    def __call__(self, state: WavefrontState, noise: torch.Tensor | None) -> WavefrontState:
        if not self.failed:
            for name in IN_PLACE:
                buffer = getattr(state, name)
                if buffer.numel():  # empty sibling rows without second proposals
                    torch._dynamo.mark_static_address(buffer)  # written in place by every replay
            given = {field.name: getattr(state, field.name) for field in fields(state)}
            try:
                torch.compiler.cudagraph_mark_step_begin()  # a new generation: the previous replay's outputs die
                return owned(self.compiled(state, noise), given)
            except Exception as error:  # noqa: BLE001 - any compile or capture failure: run eagerly instead
                logger.warning("hf_loopspec: the wavefront step could not run as a CUDA graph (%s: %s); running it "
                               "eagerly.", type(error).__name__, error)
                self.failed = True
                state = replace(state, **given)  # the fields as they were before the failed call
        return self.eager(state, noise)
