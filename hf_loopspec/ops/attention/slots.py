"""Slot attention: the attention of the wavefront engine's core call (`generation.wavefront.step`), over the flat KV
pools of a `PagedLoopCache` laid out in table order (`PagedLoopCache.reserve_in_order`, `PagedLoopCache.flat_pools`).

Rows are fixed-shape: B*L lane rows, then B*P prompt rows, then optionally extra rows with KV of their own (the
engine's sibling rows). Table t = sequence * planes + plane of layer l sits at flat slots
`l * layer_slots + t * W .. + C - 1` (`SlotLayout`), so the keys of every table are one strided view of the pool,
read in place. With a page map (`pages` `[tables, W / page_size]`, continuous batching: each table's pages are
wherever its request's allocation put them) position j of table t is slot `pages[t, j // page_size] * page_size +
j % page_size` instead (`table_slot`), and a call gathers each table's S positions through the map (one index per
call, shared by the layers): the map is data, so the shapes, and a compiled step, do not depend on it.
Every active lane or prompt row writes its KV at its position of its table, then attends to positions
`0 .. position` of that table (never at or beyond `read_span`); an inactive row writes into the trash slot and its
output is zero. `naive.naive_slot_attention` is the readable reference that this op is tested against.

The lane rows' queries are placed on a grid of R query cells per table by a one-hot matrix (exact in fp32): R = 1
when at most one running lane shares a (sequence, plane) (the caller's invariant), R = L when a lane's cell is its
slot. The prompt rows of a sequence share one plane and attend together, causally.

Kernels: eager, and compiled on CUDA, the attention is torch's fused `scaled_dot_product_attention` (`attend`), which
reads the strided table views in place. Compiled for a CPU, the lane grid uses `attend_cells` (two batched products
and a masked softmax, which inductor fuses). The Triton paged kernel (`triton_paged.py`) does not serve this op on
CUDA: it serves `PagedKVAttention` (core calls planned by `PagedLoopCache.plan_rows`, i.e. the lane decoder and plain
decoding on a `PagedLoopCache`), which reads through block tables; this op never builds block tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .stored import stored

__all__ = ["SlotAttention", "SlotLayout", "attend", "attend_cells", "table_slot"]


def table_slot(pages: torch.Tensor | None, table_width: int, table: torch.Tensor, position: torch.Tensor) \
        -> torch.Tensor:
    """The pool slot (within a layer) of `position` in `table` (broadcast together): `table * table_width + position`
    for tables laid out in order (`pages` None), else through the page map `pages` `[tables, W / page_size]`."""
    if pages is None:
        return table * table_width + position
    page_size = table_width // pages.shape[1]
    return pages[table, position // page_size] * page_size + position % page_size


@dataclass(frozen=True)
class SlotLayout:
    """Where the tables sit in the flat pools, and what a call reads (Python values: constants of a compiled step)."""

    layers: int  # the model's layers; layer l owns pool slots l * layer_slots .. (layer_slots = pool rows // layers)
    planes: int  # KV planes per sequence
    table_width: int  # W: pool slots per (sequence, plane) table
    positions: int  # C <= W: positions reserved per table; written positions are clamped to 0 .. C - 1
    read_span: int  # S <= C: rows read positions 0 .. S - 1 only
    cells: int  # R: query cells per table on the lane grid (1, or L: a lane's cell is its slot)


class SlotAttention:
    """`KVAttention` (`layer_idx, q, k, v -> out`) of one core call over fixed-shape rows (module docstring).

    Args:
        k_pool, v_pool: the flat pools `[layers * layer_slots, Hkv, D]`, written in place.
        trash_slot: `[]` int64, a slot of each layer that no active row writes or reads; inactive rows write there.
        layout: the `SlotLayout`.
        pages: the page map `[B * planes, W / page_size]` int64 (module docstring), or None or an empty tensor: the
            tables lie in order.
        lanes: plane, position, active, each `[B, L]`; with `layout.cells == 1` at most one active lane per
            (sequence, plane).
        prompts: plane `[B]`, position `[B, P]`, active `[B, P]`.
        extra: rows after the prompt rows with KV of their own, or None: an object with `active` `[E]` and
            `attend(layer_idx, q, k, v, keys, values, attend) -> [E, Hq, D]` (keys, values: every table's
            `[B * planes, S, Hkv, D]`; `attend`: this module's `attend`).

    After `compact()` it takes the active rows only (the compacted core call; the one data-dependent shape).
    """

    rows = None  # [n] the rows the core call runs when it runs only the active ones, else None
    extra_idle = False  # compacted with no active extra row: the extra rows' attention is skipped (their output is 0)

    def __init__(self, k_pool: torch.Tensor, v_pool: torch.Tensor, trash_slot: torch.Tensor, layout: SlotLayout,
                 lanes: tuple, prompts: tuple, extra=None, pages: torch.Tensor | None = None):
        self.k_pool, self.v_pool, self.layout, self.extra = k_pool, v_pool, layout, extra
        pages = pages if pages is not None and pages.numel() else None
        self.layer_slots = k_pool.shape[0] // layout.layers  # pool slots per layer
        plane, position, active = lanes
        prompt_plane, prompt_position, prompt_active = prompts
        batch, lanes = position.shape
        device = position.device
        planes, cells = layout.planes, layout.cells
        seq = torch.arange(batch, device=device)  # [B]
        plane, prompt_plane = plane.clamp(max=planes - 1), prompt_plane.clamp(max=planes - 1)
        self.prompt_table = seq * planes + prompt_plane  # [B]
        self.active = torch.cat([active.flatten(), prompt_active.flatten(), *([extra.active] if extra else [])])  # [N]
        slot = lambda table, pos: table_slot(pages, layout.table_width, table,  # noqa: E731
                                             pos.clamp(0, layout.positions - 1))
        written = torch.cat([slot(seq[:, None] * planes + plane, position).flatten(),
                             slot(self.prompt_table[:, None], prompt_position).flatten()])  # [N]
        self.write_slot = torch.where(self.active[: len(written)], written, trash_slot)  # [B*L + B*P]
        cell = plane * cells + (torch.arange(lanes, device=device) if cells > 1 else 0)  # [B, L]
        self.place = ((cell[..., None] == torch.arange(planes * cells, device=device)) & active[..., None]) \
            .float()  # [B, L, planes * R] one-hot: the grid cell of each running lane
        cell_position = torch.where(self.place.bool(), position[..., None], 0).amax(1)  # [B, planes * R]; 0: empty
        span = torch.arange(layout.read_span, device=device)  # [S]
        # [B * planes * S] the slots of every table's positions 0 .. S - 1 through the page map; None: views
        self.read_slot = None if pages is None else \
            slot(torch.arange(batch * planes, device=device)[:, None], span).flatten()
        self.lane_visible = (span <= cell_position[..., None]).view(batch * planes, 1, cells, -1)  # [., 1, R, S]
        self.prompt_visible = (span <= prompt_position[..., None])[:, None]  # [B, 1, P, S]

    def compact(self) -> torch.Tensor:
        """Take the active rows only from now on (reads `active` on the host); returns them, `[n]` int64."""
        self.rows = self.active.nonzero()[:, 0]
        self.extra_idle = not len(self.rows) or int(self.rows[-1]) < len(self.write_slot)
        return self.rows

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [N, Hq, D]   k, v: [N, Hkv, D]   ([n, ...] for the rows `rows` when compacted)
        layout = self.layout
        if self.rows is not None:  # back on the fixed rows: inactive ones are zeros, written to the trash slot
            q, k, v = (x.new_zeros(len(self.active), *x.shape[1:]).index_copy(0, self.rows, x) for x in (q, k, v))
        first = layer_idx * self.layer_slots  # the layer's first slot in the flat pools
        pooled = len(self.write_slot)  # the lane and prompt rows: they write the pool
        self.k_pool.index_copy_(0, self.write_slot + first, stored(k[:pooled], self.k_pool.dtype))
        self.v_pool.index_copy_(0, self.write_slot + first, stored(v[:pooled], self.v_pool.dtype))
        batch, lanes, grid = self.place.shape
        tables = batch * layout.planes
        shape = (tables, layout.table_width, *self.k_pool.shape[1:])
        if self.read_slot is None:
            tables_of = lambda pool: pool[first: first + tables * layout.table_width].view(shape)  # noqa: E731
            keys = tables_of(self.k_pool)[:, : layout.read_span]  # [B * planes, S, Hkv, D]
            values = tables_of(self.v_pool)[:, : layout.read_span]
        else:
            keys, values = (pool.index_select(0, self.read_slot + first).view(tables, layout.read_span, *shape[2:])
                            for pool in (self.k_pool, self.v_pool))
        n = batch * lanes
        # (a non-finite query is placed as 0: the one-hot product sums a sequence's lanes, and 0 * NaN would reach
        # the cells of its other lanes; that lane's own residual stays non-finite)
        lane_q = q[:n].float().view(batch, lanes, -1).nan_to_num(0.0, 0.0, 0.0)  # [B, L, Hq * D]
        grid_q = (self.place.transpose(1, 2) @ lane_q).view(tables, layout.cells, *q.shape[1:])  # [., R, Hq, D]
        lane_attend = attend_cells if torch.compiler.is_compiling() and q.device.type == "cpu" else attend
        grid_out = lane_attend(grid_q.transpose(1, 2), keys, values, self.lane_visible)  # [B * planes, Hq, R, D]
        out = [(self.place @ grid_out.transpose(1, 2).reshape(batch, grid, -1)).view(n, *q.shape[1:])]  # [B*L, Hq, D]
        prompts = self.prompt_visible.shape[2]
        if prompts:
            prompt_q = q[n:pooled].float().view(batch, prompts, *q.shape[1:]).transpose(1, 2)  # [B, Hq, P, D]
            prompt_out = attend(prompt_q, keys[self.prompt_table], values[self.prompt_table], self.prompt_visible)
            out.append(prompt_out.transpose(1, 2).flatten(0, 1))  # [B*P, Hq, D]
        if self.extra is not None and self.extra_idle:
            out.append(q.new_zeros(len(q) - pooled, *q.shape[1:]).float())
        elif self.extra is not None:
            out.append(self.extra.attend(layer_idx, q[pooled:], k[pooled:], v[pooled:], keys, values, attend))
        out = torch.where(self.active[:, None, None], torch.cat(out), 0.0).to(q.dtype)  # [N, Hq, D]
        return out if self.rows is None else out[self.rows]


def attend_cells(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """`attend` for a few query cells per table (the lane grid), as two batched products and a masked softmax: the
    lane grid's attention when the step is compiled for a CPU, where inductor makes it two matrix-multiply calls and
    one fused kernel, cheaper than the fused attention op's fixed cost on small shapes (measured on ouro-tiny).
    Eager, `attend` (that op) stays: it reads the strided KV views in place, where the products copy them; it also
    serves the prompt rows, whose scores would be large, and CUDA (not measured)."""
    groups, heads, cells, dim = q.shape
    kv_heads = keys.shape[2]
    k = keys.float().transpose(1, 2)[:, :, None]  # [G, Hkv, 1, S, D] (query head h reads KV head h // (Hq / Hkv))
    v = values.float().transpose(1, 2)[:, :, None]
    scores = q.reshape(groups, kv_heads, heads // kv_heads, cells, dim) @ k.transpose(-1, -2) * dim ** -0.5
    scores = scores.masked_fill(~visible[:, :, None], float("-inf"))  # [G, Hkv, Hq / Hkv, R, S]
    return (torch.softmax(scores, -1) @ v).reshape(groups, heads, cells, dim)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """fp32 attention of queries `q` `[G, Hq, R, D]` over `keys`, `values` `[G, S, Hkv, D]` (strided views are read in
    place) with mask `visible` `[G, 1, R, S]` (every query sees at least one position): `[G, Hq, R, D]`. Query head
    h reads KV head h // (Hq / Hkv)."""
    return F.scaled_dot_product_attention(q, keys.transpose(1, 2).float(), values.transpose(1, 2).float(),
                                          attn_mask=visible, scale=q.shape[-1] ** -0.5, enable_gqa=True)
