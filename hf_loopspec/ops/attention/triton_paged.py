"""Triton kernels for the paged KV pool: `write_kv_triton` and `paged_attention_triton`.

Same contracts as `naive.naive_write_kv` and `naive.naive_paged_attention`. Neither launcher synchronises with the
host, so both can be captured in a CUDA graph.

The attention kernel runs one program per (row, KV head). The program loads the `Hq // Hkv` query heads that
share the KV head, walks the row's context in blocks of `BLOCK_N` positions (looking up each position's page
in the row's block table) and keeps an online softmax in fp32. Only positions below the row's context are
loaded, so garbage or NaN elsewhere in the pool is never read.

With `TRITON_INTERPRET=1` set before this module is imported, the kernels are decorated for Triton's CPU
interpreter and also run on CPU tensors (fp32 and fp16; the interpreter mishandles bf16).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .stored import stored

# Whether the kernels below were decorated for the CPU interpreter: triton reads the variable at decoration time.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

BLOCK_N = 64  # context positions per step of the attention kernel


@triton.jit
def _write_kv_kernel(
    k_ptr,  # [N, Hkv, D]
    v_ptr,  # [N, Hkv, D]
    k_cache_ptr,  # [num_pages, page_size, Hkv, D]
    v_cache_ptr,  # [num_pages, page_size, Hkv, D]
    slots_ptr,  # [N]
    stride_k_row,
    stride_k_head,
    stride_v_row,
    stride_v_head,
    stride_kc_page,
    stride_kc_offset,
    stride_kc_head,
    stride_vc_page,
    stride_vc_offset,
    stride_vc_head,
    page_size,
    num_kv_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per row: copy its `[Hkv, D]` key and value into its slot, or nothing if the slot is < 0."""
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot >= 0:
        page = slot // page_size
        offset = slot % page_size
        heads = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
        dims = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
        mask = (heads < num_kv_heads) & (dims < head_dim)
        k = tl.load(k_ptr + row * stride_k_row + heads * stride_k_head + dims, mask=mask)
        k_slot = k_cache_ptr + page * stride_kc_page + offset * stride_kc_offset
        tl.store(k_slot + heads * stride_kc_head + dims, k, mask=mask)
        v = tl.load(v_ptr + row * stride_v_row + heads * stride_v_head + dims, mask=mask)
        v_slot = v_cache_ptr + page * stride_vc_page + offset * stride_vc_offset
        tl.store(v_slot + heads * stride_vc_head + dims, v, mask=mask)


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [N, Hq, D]
    k_cache_ptr,  # [num_pages, page_size, Hkv, D]
    v_cache_ptr,  # [num_pages, page_size, Hkv, D]
    out_ptr,  # [N, Hq, D]
    block_tables_ptr,  # [T, max_pages]
    table_ids_ptr,  # [N]
    context_lens_ptr,  # [N]
    scale,
    stride_q_row,
    stride_q_head,
    stride_o_row,
    stride_o_head,
    stride_kc_page,
    stride_kc_offset,
    stride_kc_head,
    stride_vc_page,
    stride_vc_offset,
    stride_vc_head,
    stride_bt_table,
    page_size,
    group_size,
    head_dim,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One program per (row, KV head): attention of the row's `group_size` query heads over its context."""
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    table = tl.load(table_ids_ptr + row).to(tl.int64)
    context_len = tl.load(context_lens_ptr + row).to(tl.int32)
    table_pages = block_tables_ptr + table * stride_bt_table

    group = tl.arange(0, BLOCK_G)  # [BLOCK_G] query heads of this KV head (padded to BLOCK_G >= 16 for tl.dot)
    dims = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    q_heads = kv_head * group_size + group
    q_mask = (group < group_size)[:, None] & (dims < head_dim)[None, :]  # [BLOCK_G, BLOCK_D]
    q_ptrs = q_ptr + row * stride_q_row + q_heads[:, None] * stride_q_head + dims[None, :]
    q = tl.load(q_ptrs, mask=q_mask, other=0.0).to(tl.float32) * scale  # [BLOCK_G, BLOCK_D]

    running_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(0, context_len, BLOCK_N):
        positions = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        valid = positions < context_len
        pages = tl.load(table_pages + positions // page_size, mask=valid, other=0).to(tl.int64)
        offsets = positions % page_size
        kv_mask = valid[:, None] & (dims < head_dim)[None, :]  # [BLOCK_N, BLOCK_D]
        k_ptrs = k_cache_ptr + pages[:, None] * stride_kc_page + offsets[:, None] * stride_kc_offset
        k = tl.load(k_ptrs + kv_head * stride_kc_head + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        v_ptrs = v_cache_ptr + pages[:, None] * stride_vc_page + offsets[:, None] * stride_vc_offset
        v = tl.load(v_ptrs + kv_head * stride_vc_head + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)

        scores = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BLOCK_G, BLOCK_N]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))  # finite: every block holds a valid position
        rescale = tl.exp(running_max - new_max)  # [BLOCK_G]
        probs = tl.exp(scores - new_max[:, None])  # [BLOCK_G, BLOCK_N]
        running_sum = running_sum * rescale + tl.sum(probs, 1)
        acc = acc * rescale[:, None] + tl.dot(probs, v, input_precision="ieee")
        running_max = new_max

    out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]  # zeros for an empty context
    out_ptrs = out_ptr + row * stride_o_row + q_heads[:, None] * stride_o_head + dims[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def write_kv_triton(
    k: torch.Tensor,  # [N, Hkv, D]
    v: torch.Tensor,  # [N, Hkv, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    slots: torch.Tensor,  # [N] int64; < 0 marks an inactive row
) -> None:
    """Triton twin of `naive.naive_write_kv`: scatter each row's key and value (`stored`) into its flat slot. Rows
    whose head_dim is strided (a projection computed transposed) and strided `slots` are copied to unit stride first
    (the pools, which the kernel writes, must have it)."""
    k, v = unit_stride(stored(k, k_cache.dtype)), unit_stride(stored(v, v_cache.dtype))
    slots = unit_stride(slots)
    _check_unit_stride(k_cache, v_cache)
    num_rows, num_kv_heads, head_dim = k.shape
    if num_rows == 0:
        return
    _write_kv_kernel[(num_rows,)](
        k,
        v,
        k_cache,
        v_cache,
        slots,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        k_cache.shape[1],
        num_kv_heads,
        head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def paged_attention_triton(
    q: torch.Tensor,  # [N, Hq, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    block_tables: torch.Tensor,  # [T, max_pages] int32
    table_ids: torch.Tensor,  # [N] int
    context_lens: torch.Tensor,  # [N] int; 0 marks an inactive row
    scale: float,
) -> torch.Tensor:
    """Triton twin of `naive.naive_paged_attention`: `[N, Hq, D]` in `q.dtype`, zeros for inactive rows (queries
    whose head_dim is strided, and strided tables, table ids or lengths, are copied to unit stride first)."""
    q, block_tables, table_ids, context_lens = map(unit_stride, (q, block_tables, table_ids, context_lens))
    _check_unit_stride(k_cache, v_cache)
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    out = torch.empty_like(q)  # [N, Hq, D]
    if num_rows == 0:
        return out
    group_size = num_heads // num_kv_heads
    _paged_attention_kernel[(num_rows, num_kv_heads)](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        table_ids,
        context_lens,
        scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        k_cache.shape[1],
        group_size,
        head_dim,
        BLOCK_G=max(16, triton.next_power_of_2(group_size)),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=BLOCK_N,
    )
    return out


def unit_stride(x: torch.Tensor) -> torch.Tensor:
    """`x`, or a contiguous copy of it when its last dimension is strided (the kernels address it with stride 1)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_unit_stride(*tensors: torch.Tensor) -> None:
    """The kernels address the last dimension (head_dim, or a block table's pages) with stride 1."""
    for tensor in tensors:
        if tensor.stride(-1) != 1:
            raise ValueError(f"expected a unit stride in the last dimension, got strides {tensor.stride()}")
