"""How the lane decoder calls the model's core and head: eagerly, or as static-shape compiled calls.

`EagerStages` calls `model.core` / `model.head` on exactly the rows of a cycle. `StaticStages` (generate's
`compile_core=True` or a `torch.compile` backend name) gives every call a static shape, which is what
`torch.compile` without recompilation (and, later, CUDA-graph capture) needs:

* Row buckets: a call's rows are padded up to a bucket, one of the (at most 8) powers of two from
  max(1, capacity / 128) to the run's capacity (`capacity_for`). Padded rows are inactive: slot -1 (they write
  no KV), context length 0 (they read none and attend to nothing), position 0, zero hidden state; their outputs
  are dropped. A call with more rows than the largest bucket (a long prompt's prefill) runs eagerly.
* Fixed-capacity metadata: each stage keeps device buffers of `capacity` rows (slot, table, context length,
  position) and a `[tables, pages per table]` block-table buffer sized for the most tables and the longest
  sequence of the runs so far (grown for a run that needs more: the graphs never see it); every call refills them
  in place (device copies, no host synchronisation), and the attention object a compiled graph sees is the same
  object for the life of the stages.
* Attention is one opaque custom op in the graph (`hf_loopspec::static_attention`): it writes the rows' KV and
  attends through the stage's `StaticRows`, which the compiler never traces (on CPU the reference groups rows by
  table, which is data dependent). Every other part of a core call (norms, projections, rotary embeddings, MLPs)
  is compiled into one graph per bucket, without graph breaks.

Stages are cached on the model per (backend, device, dtype, capacity, layout), so a second `generate` call whose
batch has the same capacity (`capacity_for`) and settings compiles nothing, whatever its prompt and output lengths.
`compiles` counts the graphs each stage compiled and `shapes` the buckets it ran: without recompilation they are
equal in number.
"""

from __future__ import annotations

import types
import weakref
from collections import Counter

import torch

from ..cache.paged import PagedKVAttention, PagedLoopCache
from ..cache.rows import RowBatch
from .compiled import compiled_store


class EagerStages:
    """The model's stages called directly on a cycle's rows."""

    def __init__(self, model, cache: PagedLoopCache):
        self.model, self.cache = model, cache

    def core(self, hidden: torch.Tensor, positions: torch.Tensor, rows: RowBatch) -> torch.Tensor:
        return self.model.core(hidden, positions, self.cache.attention(rows))

    def head(self, hidden: torch.Tensor, positions: torch.Tensor, rows: RowBatch | None) -> torch.Tensor:
        return self.model.head(hidden, positions, None if rows is None else self.cache.attention(rows))


def capacity_for(batch: int, num_loops: int, num_speculative_tokens: int) -> int:
    """Rows of the largest bucket: a power of two >= the most lanes a decode cycle can hold (per sequence at most
    one lane per depth, or K + 1 in a block round; lanes of the prompt beyond that run eagerly)."""
    rows = batch * max(num_loops, num_speculative_tokens + 1)
    return max(4, 1 << (rows - 1).bit_length())


_STATIC_ROWS: weakref.WeakValueDictionary[int, StaticRows] = weakref.WeakValueDictionary()
STORE = "stages"  # the model's store of {shape key: StaticStages} (`compiled.compiled_store`)


def static_stages_of(model) -> list[StaticStages]:
    """The compiled stages built for `model` so far (one per backend and shape)."""
    return list(compiled_store(model, STORE).values())


@torch.library.custom_op("hf_loopspec::static_attention", mutates_args=())
def static_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, handle: int, layer_idx: int) -> torch.Tensor:
    """Write `k`, `v` and attend with the rows loaded into `StaticRows` number `handle` (an opaque graph node).

    The op writes the page pool, which the graph does not see; successive layers' calls are ordered by their data
    dependencies (each layer's q, k, v come from the previous layer's output).
    """
    return _STATIC_ROWS[handle].attention(layer_idx, q, k, v)


@static_attention.register_fake
def _(q, k, v, handle, layer_idx):
    return torch.empty_like(q)


class StaticRows:
    """Fixed-capacity row metadata of one stage, and the `KVAttention` its compiled calls use.

    `load` pads a `RowBatch` into the buffers; `__call__` attends with the padded rows through the
    `static_attention` op. The padded batch keeps the real rows' lineage, so a debug cache still checks I1. Block
    table entries past a table's current pages may be stale: rows never read past their context length.
    """

    def __init__(self, capacity: int, tables: int, pages_per_table: int, device: torch.device):
        self.slot = torch.full((capacity,), -1, dtype=torch.long, device=device)
        self.table = torch.zeros(capacity, dtype=torch.int32, device=device)
        self.context_len = torch.zeros(capacity, dtype=torch.int32, device=device)
        self.position = torch.zeros(capacity, dtype=torch.long, device=device)
        self.block_tables = torch.full((tables, pages_per_table), -1, dtype=torch.int32, device=device)
        self.attention: PagedKVAttention | None = None
        self.handle = id(self)
        _STATIC_ROWS[self.handle] = self

    def ensure_tables(self, tables: int, pages_per_table: int) -> None:
        """Grow the block-table buffer to hold `tables` tables of `pages_per_table` pages (it never shrinks)."""
        rows, width = self.block_tables.shape
        if rows < tables or width < pages_per_table:
            self.block_tables = self.block_tables.new_full((max(rows, tables), max(width, pages_per_table)), -1)

    def load(self, cache: PagedLoopCache, rows: RowBatch, size: int) -> None:
        n = rows.num_rows
        for buffer, values, fill in ((self.slot, rows.slot, -1), (self.table, rows.table, 0),
                                     (self.context_len, rows.context_len, 0), (self.position, rows.position, 0)):
            buffer[:n].copy_(values)
            buffer[n:size].fill_(fill)
        tables = rows.block_tables  # [tables, width]: width grows with the longest sequence
        self.block_tables[: tables.shape[0], : tables.shape[1]].copy_(tables)
        padded = RowBatch(seq=rows.seq, depth=rows.depth, position=self.position[:size], table=self.table[:size],
                          slot=self.slot[:size], context_len=self.context_len[:size],
                          block_tables=self.block_tables, lineage=rows.lineage)
        self.attention = PagedKVAttention(cache, padded)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return static_attention(q, k, v, self.handle, layer_idx)


class StaticStages:
    """The model's core and head as compiled calls over row buckets (see the module docstring)."""

    def __init__(self, model, backend: str, capacity: int, tables: int, pages_per_table: int,
                 device: torch.device, head_attends: bool = False):
        self.model, self.cache = model, None
        self.head_attends = head_attends  # the head has KV (exit planes): it attends through `head_rows`
        # At most 8 buckets (dynamo keeps 8 compiled entries per function): capacity / 128, ..., capacity, >= 1.
        self.buckets = tuple(size for size in (capacity >> i for i in range(7, -1, -1)) if size >= 1)
        self.compiles: Counter[str] = Counter()  # graphs compiled per stage
        self.shapes: dict[str, set[int]] = {"core": set(), "head": set()}  # buckets each stage has run
        self.core_rows = StaticRows(capacity, tables, pages_per_table, device)
        self.head_rows = StaticRows(capacity, tables, pages_per_table, device)
        self._core = self._compile(StaticStages._run_core, backend, "core")
        self._head = self._compile(StaticStages._run_head, backend, "head")

    @classmethod
    def for_run(cls, model, cache: PagedLoopCache, backend: str, batch: int, capacity: int, max_positions: int,
                device: torch.device, dtype: torch.dtype) -> StaticStages:
        """The model's stages for a run of `batch` sequences of at most `max_positions` positions on `cache`,
        built on first use and kept (beside the model) for later runs of the same capacity, whatever their lengths."""
        tables = batch * cache.num_planes
        pages_per_table = -(-max_positions // cache.page_size)
        key = (backend, str(device), dtype, capacity, cache.kv_layout)
        store = compiled_store(model, STORE)
        if key not in store:
            store[key] = cls(model, backend, capacity, tables, pages_per_table, device,
                             head_attends=cache.kv_layout.first_exit_plane is not None)
        stages = store[key]
        stages.cache = cache
        for rows in (stages.core_rows, stages.head_rows):
            rows.ensure_tables(tables, pages_per_table)
        return stages

    def _compile(self, method, backend: str, stage: str):
        """`torch.compile` of `method` bound to these stages, on a private copy of its code: dynamo keeps its
        compiled entries per code object, so stages of other models never use up this one's entries. The backend
        closes over the counter, not the stages: dynamo keeps every backend for the life of the process, and the stages
        reference the model."""
        compiler, compiles = torch._dynamo.lookup_backend(backend), self.compiles

        def compile_graph(graph_module, example_inputs):
            compiles[stage] += 1
            return compiler(graph_module, example_inputs)

        private = types.FunctionType(method.__code__.replace(), method.__globals__, method.__name__)
        return torch.compile(types.MethodType(private, self), backend=compile_graph, dynamic=False)

    def _run_core(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.core(hidden, positions, self.core_rows)

    def _run_head(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.head(hidden, positions, self.head_rows if self.head_attends else None)

    def bucket(self, rows: int) -> int | None:
        return next((size for size in self.buckets if size >= rows), None)

    def core(self, hidden: torch.Tensor, positions: torch.Tensor, rows: RowBatch) -> torch.Tensor:
        return self._call("core", self._core, self.core_rows, self.model.core, hidden, positions, rows)

    def head(self, hidden: torch.Tensor, positions: torch.Tensor, rows: RowBatch | None) -> torch.Tensor:
        return self._call("head", self._head, self.head_rows, self.model.head, hidden, positions, rows)

    def _call(self, stage: str, compiled, static_rows: StaticRows, eager, hidden, positions, rows):
        """`hidden` `[n, H]` through the compiled stage in the smallest bucket that holds n rows, or eagerly
        above the largest; `rows` (None for a head without KV) is loaded into the stage's static buffers."""
        n = len(hidden)
        size = self.bucket(n)
        if size is None:
            return eager(hidden, positions, None if rows is None else self.cache.attention(rows))
        if rows is not None:
            static_rows.load(self.cache, rows, size)
        self.shapes[stage].add(size)
        return compiled(_pad(hidden, size), _pad(positions, size))[:n]


def _pad(x: torch.Tensor, size: int) -> torch.Tensor:
    """`x` `[n, ...]` followed by zero rows up to `[size, ...]`."""
    if len(x) == size:
        return x
    return torch.cat([x, x.new_zeros(size - len(x), *x.shape[1:])])
