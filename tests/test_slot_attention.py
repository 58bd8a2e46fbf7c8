"""`ops.attention.slots.SlotAttention` (the wavefront step's attention) against the readable reference
`naive.naive_slot_attention` (one row at a time, run in fp64), on random scenes: several shapes, one and several
query cells per table, grouped-query heads, dead rows (whose positions and planes may lie outside the tables), the
compacted call (active rows only) and the lane-grid kernel of a CPU-compiled step (`attend_cells`).

Every scene respects the op's contract: with one cell per table at most one live lane per (sequence, plane); no two
live rows write the same (table, position); live rows sit below the read span; the trash slot (position C - 1 of
table 0) lies beyond it. Pools start with random values (KV written before), never NaN.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from tolerances import assert_fp32_close

from hf_loopspec.ops.attention import naive_slot_attention
from hf_loopspec.ops.attention.slots import SlotAttention, SlotLayout, table_slot


@dataclass
class Scene:
    layout: SlotLayout
    q: torch.Tensor  # [N, Hq, D]
    k: torch.Tensor  # [N, Hkv, D]
    v: torch.Tensor
    k_pool: torch.Tensor  # [layers * layer_slots, Hkv, D]
    v_pool: torch.Tensor
    trash: torch.Tensor  # [] int64
    lanes: tuple  # plane, position, active [B, L]
    prompts: tuple  # plane [B], position [B, P], active [B, P]


def make_scene(seed: int, batch: int, lanes: int, prompts: int, planes: int, heads: int, kv_heads: int, dim: int,
               cells: int) -> Scene:
    g = torch.Generator().manual_seed(seed)
    span = prompts + lanes + 3  # S: prompt rows at 0 .. P - 1, lanes at P .. S - 1
    positions, width = span + 1, span + 3  # C, W: the trash slot C - 1 is beyond the span; W > C is allowed
    layout = SlotLayout(layers=2, planes=planes, table_width=width, positions=positions, read_span=span, cells=cells)
    layer_slots = batch * planes * width + 3  # a pool larger than the tables, as after a growth
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    if cells == 1:  # distinct planes per sequence: at most one lane per table
        plane = torch.stack([torch.randperm(planes, generator=g)[:lanes] for _ in range(batch)])
        position = torch.randint(prompts, span, (batch, lanes), generator=g)
    else:  # lanes may share a plane at distinct positions
        plane = torch.randint(0, planes, (batch, lanes), generator=g)
        position = torch.stack([prompts + torch.randperm(span - prompts, generator=g)[:lanes] for _ in range(batch)])
    active = torch.rand(batch, lanes, generator=g) < 0.7
    active[0, 0], active[-1, -1] = True, False  # at least one live and one dead lane
    plane = torch.where(active, plane, planes + 2)  # dead rows may name a plane past the last (clamped)
    position = torch.where(active, position, positions + 5)  # ... and a position past the table (clamped)
    prompt_active = torch.rand(batch, prompts, generator=g) < 0.7
    rows = batch * (lanes + prompts)
    return Scene(layout, rand(rows, heads, dim), rand(rows, kv_heads, dim), rand(rows, kv_heads, dim),
                 rand(2 * layer_slots, kv_heads, dim), rand(2 * layer_slots, kv_heads, dim),
                 torch.tensor(positions - 1), (plane, position, active),
                 (torch.randint(0, planes, (batch,), generator=g), torch.arange(prompts).expand(batch, -1),
                  prompt_active))


SHAPES = {  # batch, lanes, prompts, planes, Hq, Hkv, D, cells
    "one-cell-gqa": (2, 3, 4, 4, 4, 2, 8, 1),
    "one-cell-one-kv-head": (1, 2, 5, 3, 6, 1, 4, 1),
    "cell-per-lane-no-prompts": (3, 4, 0, 2, 2, 2, 16, 4),
    "cell-per-lane-gqa": (2, 5, 3, 3, 4, 2, 8, 5),
}


def run_both(scene: Scene, layer: int, compact: bool = False):
    """The op on fp32 copies of the pools and the reference on fp64 copies: (op output, op pools, reference output,
    reference pools)."""
    k_pool, v_pool = scene.k_pool.clone(), scene.v_pool.clone()
    op = SlotAttention(k_pool, v_pool, scene.trash, scene.layout, scene.lanes, scene.prompts)
    q, k, v = scene.q, scene.k, scene.v
    if compact:
        rows = op.compact()
        q, k, v = q[rows], k[rows], v[rows]
    out = op(layer, q, k, v)
    if compact:  # back on the fixed rows (dead rows: zeros, as the op returns them uncompacted)
        out = torch.zeros_like(scene.q).index_copy(0, op.rows, out)
    ref_k, ref_v = scene.k_pool.double(), scene.v_pool.double()
    ref = naive_slot_attention(layer, scene.q.double(), scene.k.double(), scene.v.double(), ref_k, ref_v,
                               scene.layout, scene.lanes, scene.prompts)
    return out, (k_pool, v_pool), ref, (ref_k, ref_v)


def assert_matches(scene: Scene, layer: int, out, pools, ref, ref_pools) -> None:
    # fp32 against fp64: the op's widest reductions are the scores (over D) and the softmax-weighted sum (over at
    # most S positions); the one-hot grid placement is exact. One layer of width max(D, S) (tests/tolerances.py).
    assert_fp32_close(out.double(), ref, layers=1, width=max(scene.q.shape[-1], scene.layout.read_span))
    dead = ~torch.cat([scene.lanes[2].flatten(), scene.prompts[2].flatten()])
    assert (out[dead] == 0).all()
    trash = layer * (scene.k_pool.shape[0] // scene.layout.layers) + int(scene.trash)
    for pool, ref_pool, before in zip(pools, ref_pools, (scene.k_pool, scene.v_pool)):
        pool, ref_pool = pool.double(), ref_pool.clone()
        ref_pool[trash] = pool[trash]  # dead rows write the trash slot; the reference writes nothing for them
        assert torch.equal(pool, ref_pool)  # the same slots written with the same (exactly converted) values
        assert not torch.equal(pool, before.double())  # live rows did write


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("shape", SHAPES)
def test_slot_attention_matches_the_reference(shape, seed):
    scene = make_scene(seed, *SHAPES[shape])
    assert_matches(scene, 1, *run_both(scene, layer=1))


@pytest.mark.parametrize("shape", SHAPES)
def test_compacted_call_matches_the_reference(shape):
    """`rows` set: called with the live rows only, it returns theirs, equal to the full call's."""
    scene = make_scene(3, *SHAPES[shape])
    assert_matches(scene, 0, *run_both(scene, layer=0, compact=True))


@pytest.mark.parametrize("shape", SHAPES)
def test_lane_grid_of_a_cpu_compiled_step_matches_the_reference(shape, monkeypatch):
    """Compiled for a CPU the lane grid takes `attend_cells` (products and a masked softmax) instead of the fused
    op: run eagerly by making the op believe it is being compiled."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    scene = make_scene(4, *SHAPES[shape])
    assert_matches(scene, 1, *run_both(scene, layer=1))


def test_reference_reads_what_it_wrote_and_nothing_past_a_row():
    """The reference itself against a hand computation: one live lane of one head at position 1 of a table whose
    position 0 holds key 0; position 2 (visible to no row) holds a huge key that would dominate any read of it."""
    layout = SlotLayout(layers=1, planes=1, table_width=4, positions=4, read_span=3, cells=1)
    k_pool, v_pool = torch.zeros(4, 1, 1, dtype=torch.float64), torch.zeros(4, 1, 1, dtype=torch.float64)
    k_pool[2], v_pool[0], v_pool[2] = 1e6, 3.0, 1e6
    q, k, v = (torch.tensor([[[x]]], dtype=torch.float64) for x in (2.0, 1.0, 5.0))
    lanes = (torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=bool))
    prompts = (torch.zeros(1, dtype=torch.long), torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 0, dtype=bool))
    out = naive_slot_attention(0, q, k, v, k_pool, v_pool, layout, lanes, prompts)
    weights = torch.softmax(torch.tensor([0.0, 2.0 * 1.0], dtype=torch.float64), 0)  # scores q*k at positions 0, 1
    assert torch.allclose(out[0, 0, 0], weights[0] * 3.0 + weights[1] * 5.0)
    assert k_pool[1, 0, 0] == 1.0 and v_pool[1, 0, 0] == 5.0


@pytest.mark.parametrize("shape", SHAPES)
def test_a_page_map_reads_and_writes_what_tables_in_order_do(shape):
    """Through a page map (`pages`, continuous batching) the op equals the op on tables laid out in order, on a pool
    whose pages are those pages shuffled: the same output, and every page written as its in-order page (the trash
    slot included, mapped like any position)."""
    scene = make_scene(5, *SHAPES[shape])
    page, width = 4, 16  # W = 16 >= every shape's C: four pages per table
    layout = replace(scene.layout, table_width=width)
    batch, planes = scene.lanes[0].shape[0], layout.planes
    count = batch * planes * width // page + 1  # pages per layer: the tables' and one more
    g = torch.Generator().manual_seed(6)
    shuffled = torch.randperm(count, generator=g)  # in-order page i is page shuffled[i] of the paged pool
    pages = shuffled[: count - 1].view(batch * planes, width // page)
    rand = torch.randn(2, layout.layers * count * page, *scene.k_pool.shape[1:], generator=g)
    in_order = [rand[0].clone(), rand[1].clone()]
    paged = [torch.empty_like(pool) for pool in in_order]
    as_pages = lambda pool: pool.view(layout.layers, count, page, *pool.shape[1:])  # noqa: E731
    for source, target in zip(in_order, paged):
        as_pages(target)[:, shuffled] = as_pages(source)
    trash = scene.trash
    paged_trash = table_slot(pages, width, torch.tensor(0), trash)
    expected = SlotAttention(*in_order, trash, layout, scene.lanes, scene.prompts)(1, scene.q, scene.k, scene.v)
    out = SlotAttention(*paged, paged_trash, layout, scene.lanes, scene.prompts, pages=pages)(1, scene.q, scene.k,
                                                                                              scene.v)
    # the same values read in the same order, gathered instead of viewed: equal up to the kernels' reduction order
    assert_fp32_close(out.double(), expected.double(), layers=1, width=max(scene.q.shape[-1], layout.read_span))
    for source, target in zip(in_order, paged):
        assert torch.equal(as_pages(target)[:, shuffled], as_pages(source))
