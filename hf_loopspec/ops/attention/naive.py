"""Attention written to be read: one query row at a time, each gathering its own positions. Too slow to decode with.

* `naive_paged_attention`, `naive_write_kv`: paged attention through block tables, the reference that the
  vectorised PyTorch path (`torch_paged.py`) and the Triton kernels (`triton_paged.py`) are tested against;
* `naive_slot_attention`: the wavefront step's attention over tables laid out in order (`slots.py`), the reference
  that `slots.SlotAttention` is tested against.

Pool layout: `k_cache` and `v_cache` are `[num_pages, page_size, Hkv, D]`; position `j` of block table `t` lives
at page `block_tables[t, j // page_size]`, offset `j % page_size` (flat slot `page * page_size + offset`).
"""

from __future__ import annotations

import torch

from .slots import SlotLayout
from .stored import stored


def naive_write_kv(
    k: torch.Tensor,  # [N, Hkv, D]
    v: torch.Tensor,  # [N, Hkv, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    slots: torch.Tensor,  # [N] flat slots; < 0 marks an inactive row
) -> None:
    """Store row `n`'s key and value at flat slot `slots[n]` (non-finite entries as 0: `stored`); rows with a negative
    slot write nothing."""
    page_size = k_cache.shape[1]
    for n, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_cache[slot // page_size, slot % page_size] = stored(k[n], k_cache.dtype)
            v_cache[slot // page_size, slot % page_size] = stored(v[n], v_cache.dtype)


def naive_paged_attention(
    q: torch.Tensor,  # [N, Hq, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    block_tables: torch.Tensor,  # [T, max_pages]
    table_ids: torch.Tensor,  # [N]
    context_lens: torch.Tensor,  # [N]; 0 marks an inactive row
    scale: float,
) -> torch.Tensor:
    """Row `n` attends to positions `0 .. context_lens[n] - 1` of block table `table_ids[n]`; query head `h`
    reads KV head `h // (Hq // Hkv)`. Computed in the dtype of `q` (pass float64 tensors for an oracle);
    returns `[N, Hq, D]` in `q.dtype`, zeros for inactive rows. Reads no slot past a row's context."""
    page_size = k_cache.shape[1]
    out = torch.zeros_like(q)
    for n, (table, context) in enumerate(zip(table_ids.tolist(), context_lens.tolist())):
        if context == 0:
            continue
        positions = torch.arange(context)  # [C]
        pages = block_tables[table, positions // page_size].long()  # [C]
        keys = k_cache[pages, positions % page_size].to(q.dtype)  # [C, Hkv, D]
        values = v_cache[pages, positions % page_size].to(q.dtype)
        out[n] = _attend_row(q[n], keys, values, scale)
    return out


def naive_slot_attention(
    layer_idx: int,
    q: torch.Tensor,  # [B*L + B*P, Hq, D]: the lane rows, then the prompt rows
    k: torch.Tensor,  # [B*L + B*P, Hkv, D]
    v: torch.Tensor,  # [B*L + B*P, Hkv, D]
    k_pool: torch.Tensor,  # [layers * layer_slots, Hkv, D]
    v_pool: torch.Tensor,  # [layers * layer_slots, Hkv, D]
    layout: SlotLayout,
    lanes: tuple,  # plane, position, active: each [B, L]
    prompts: tuple,  # plane [B], position [B, P], active [B, P]
) -> torch.Tensor:
    """`slots.SlotAttention` without extra rows, one row at a time. Row n of sequence b on plane p (clamped to the last
    plane) uses table t = b * planes + p, whose position j is pool slot `layer_idx * layer_slots + t * W + j`. Every
    active row first writes its key and value at its own position (`stored`); then each active row attends to positions
    0 .. its position of its table (the caller keeps them below `layout.read_span`). Inactive rows write nothing and
    output zeros. Computed in the dtype of `q` (pass float64 tensors for an oracle)."""
    plane, position, active = lanes
    prompt_plane, prompt_position, prompt_active = prompts
    batch, lane_count = position.shape
    table_of = lambda b, p: b * layout.planes + min(int(p), layout.planes - 1)  # noqa: E731
    rows = []  # (table, position) of each row, None for an inactive row
    for b in range(batch):
        for lane in range(lane_count):
            rows.append((table_of(b, plane[b, lane]), int(position[b, lane])) if active[b, lane] else None)
    for b in range(batch):
        for p in range(prompt_position.shape[1]):
            rows.append((table_of(b, prompt_plane[b]), int(prompt_position[b, p])) if prompt_active[b, p] else None)
    first = layer_idx * (k_pool.shape[0] // layout.layers)  # the layer's first slot
    for n, row in enumerate(rows):
        if row is not None:
            table, pos = row
            k_pool[first + table * layout.table_width + pos] = stored(k[n], k_pool.dtype)
            v_pool[first + table * layout.table_width + pos] = stored(v[n], v_pool.dtype)
    out = torch.zeros_like(q)
    for n, row in enumerate(rows):
        if row is not None:
            table, pos = row
            slots = first + table * layout.table_width + torch.arange(pos + 1)  # positions 0 .. pos
            out[n] = _attend_row(q[n], k_pool[slots].to(q.dtype), v_pool[slots].to(q.dtype), q.shape[-1] ** -0.5)
    return out


def _attend_row(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """One query row `q` `[Hq, D]` over `keys`, `values` `[C, Hkv, D]`, query head h reading KV head
    h // (Hq // Hkv): `[Hq, D]`."""
    group = q.shape[0] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)  # [C, Hq, D]
    scores = torch.einsum("hd,chd->hc", q, keys) * scale  # [Hq, C]
    return torch.einsum("hc,chd->hd", scores.softmax(-1), values)  # [Hq, D]
