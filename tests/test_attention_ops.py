"""Tests of the paged-attention ops in `hf_loopspec.ops.attention`.

* The oracle is the package's readable reference, `naive.naive_paged_attention` (one row and one position at a
  time), run in fp64; it is itself checked against dense attention over each table's keys and values, which
  knows nothing about pages.
* The vectorised PyTorch path (`torch_paged`) against the oracle (named scenes, and random ones drawn by
  hypothesis).
* The Triton kernels against the same oracle and against the PyTorch path: on CPU under `TRITON_INTERPRET=1`
  (fp32, fp16) and on a GPU (`gpu` marker; adds bf16). The variable must be set before the kernels are
  decorated, so `test_triton_kernels_under_interpreter` reruns this module's kernel tests (those named
  `*triton*` or `*dispatch*`) in a subprocess that sets it; in this process they are skipped.

Every scene fills the unused pool memory with NaN and pads block tables with -1 or out-of-range page ids, so a
read outside a row's context or past a table's length shows up as NaN or an indexing error.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from processes import ROOT
from tolerances import fp32_tolerance

from hf_loopspec.ops.attention import (
    naive_paged_attention,
    naive_write_kv,
    paged_attention,
    paged_attention_torch,
    torch_paged,
    write_kv,
    write_kv_torch,
)

try:
    from hf_loopspec.ops.attention.triton_paged import paged_attention_triton, write_kv_triton
except ImportError:
    paged_attention_triton = write_kv_triton = None

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
GARBAGE_PAGE = 10**6  # out-of-range page id used to pad some block tables

TOLERANCES = {
    # One attention layer on unit-normal q, k, v (outputs are convex combinations of the values: scale 1) whose
    # widest reduction is over 150 positions (the longest scene; head_dim <= 128): derived in tests/tolerances.py.
    torch.float32: fp32_tolerance(layers=1, width=150),
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1e-2, "rtol": 1e-2},
}

needs_triton = pytest.mark.skipif(paged_attention_triton is None, reason="triton is not installed")
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 subprocess of test_triton_kernels_under_interpreter"
)
needs_cuda = pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="needs CUDA")

KERNEL_TARGETS = [  # (device, dtype) on which the Triton kernels are checked
    pytest.param("cpu", torch.float32, marks=needs_interpreter, id="interpreter-fp32"),
    pytest.param("cpu", torch.float16, marks=needs_interpreter, id="interpreter-fp16"),
    pytest.param("cuda", torch.float32, marks=(pytest.mark.gpu, needs_cuda), id="cuda-fp32"),
    pytest.param("cuda", torch.float16, marks=(pytest.mark.gpu, needs_cuda), id="cuda-fp16"),
    pytest.param("cuda", torch.bfloat16, marks=(pytest.mark.gpu, needs_cuda), id="cuda-bf16"),
]


# ----------------------------------------------------------------------------------------------------------------
# Scenes: a paged pool with several tables, the rows that read it, and the dense truth per table.


@dataclass
class Scene:
    q: torch.Tensor  # [N, Hq, D]
    k_cache: torch.Tensor  # [num_pages, page_size, Hkv, D]; NaN wherever no position was written
    v_cache: torch.Tensor  # [num_pages, page_size, Hkv, D]
    block_tables: torch.Tensor  # [T, max_pages] int32, padded with -1 or GARBAGE_PAGE
    table_ids: torch.Tensor  # [N] int64
    context_lens: torch.Tensor  # [N] int64
    keys: list[torch.Tensor]  # per table t: [table_lens[t], Hkv, D], what the pool holds for that table
    values: list[torch.Tensor]
    scale: float

    def args(self) -> tuple:
        return self.q, self.k_cache, self.v_cache, self.block_tables, self.table_ids, self.context_lens, self.scale

    def to(self, device: str = "cpu", dtype: torch.dtype = torch.float32, index_dtype=torch.int64) -> Scene:
        def move(x: torch.Tensor) -> torch.Tensor:
            return x.to(device, dtype if x.is_floating_point() else x.dtype)

        return replace(
            self,
            q=move(self.q),
            k_cache=move(self.k_cache),
            v_cache=move(self.v_cache),
            block_tables=move(self.block_tables),
            table_ids=self.table_ids.to(device, index_dtype),
            context_lens=self.context_lens.to(device, index_dtype),
            keys=[move(k) for k in self.keys],
            values=[move(v) for v in self.values],
        )


def make_scene(
    table_lens: list[int],  # written length of each table
    rows: list[tuple[int, int]],  # (table id, context length <= that table's length) per query row
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    seed: int = 0,
) -> Scene:
    """Write each table's random keys and values into randomly chosen pages of a NaN-filled pool."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_table = [-(-length // page_size) for length in table_lens]
    num_pages = sum(pages_per_table) + 2  # two spare pages that stay NaN
    free_pages = torch.randperm(num_pages, generator=gen).tolist()
    max_pages = max(pages_per_table) + 1  # every table has padding entries
    block_tables = torch.empty(len(table_lens), max_pages, dtype=torch.int32)
    for t in range(len(table_lens)):
        block_tables[t] = GARBAGE_PAGE if t % 2 else -1
    k_cache = torch.full((num_pages, page_size, num_kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    keys, values = [], []
    for t, length in enumerate(table_lens):
        keys.append(torch.randn(length, num_kv_heads, head_dim, generator=gen))
        values.append(torch.randn(length, num_kv_heads, head_dim, generator=gen))
        for i in range(pages_per_table[t]):
            page = free_pages.pop()
            block_tables[t, i] = page
            written = slice(i * page_size, min((i + 1) * page_size, length))
            k_cache[page, : written.stop - written.start] = keys[t][written]
            v_cache[page, : written.stop - written.start] = values[t][written]
    table_ids, context_lens = (torch.tensor(column, dtype=torch.int64) for column in zip(*rows))
    q = torch.randn(len(rows), num_heads, head_dim, generator=gen)
    return Scene(q, k_cache, v_cache, block_tables, table_ids, context_lens, keys, values, head_dim**-0.5)


def oracle(scene: Scene) -> torch.Tensor:
    """The readable reference on the scene's pool, in fp64 on the CPU: `[N, Hq, D]`."""
    return naive_paged_attention(*scene.to("cpu", torch.float64).args())


def dense_attention(scene: Scene) -> torch.Tensor:
    """Each row's attention over its table's dense keys and values (no pages), in fp64: `[N, Hq, D]`."""
    out = torch.zeros(scene.q.shape, dtype=torch.float64)
    for n, (table, context) in enumerate(zip(scene.table_ids.tolist(), scene.context_lens.tolist())):
        if context:
            q = scene.q[n, :, None].double()  # [Hq, 1, D]
            k, v = (x[table][:context].double().transpose(0, 1) for x in (scene.keys, scene.values))  # [Hkv, C, D]
            out[n] = F.scaled_dot_product_attention(q, k, v, scale=scene.scale, enable_gqa=True)[:, 0]
    return out


def run_of(table: int, end: int, length: int) -> list[tuple[int, int]]:
    """`length` consecutive rows of one table ending at context `end` (a prefill chunk or a verify block)."""
    return [(table, end - length + 1 + i) for i in range(length)]


SCENES = {
    # name: (table_lens, rows, num_heads, num_kv_heads, head_dim, page_size)
    "gqa-3-on-1": ([40, 17, 64], [(0, 40), (1, 17), (2, 64)], 3, 1, 64, 16),
    "gqa-6-on-3-d128": ([130, 33], [(1, 33), *run_of(0, 130, 4), (0, 65)], 6, 3, 128, 8),
    "page-boundaries": ([12], [(0, c) for c in (1, 3, 4, 5, 8, 9, 12)], 4, 4, 64, 4),
    "empty-rows-and-full-pages": ([32, 16, 0], [(0, 32), (2, 0), (1, 16), (0, 0), (1, 0), (0, 16)], 4, 2, 64, 16),
    "mixed-tables-depths-runs": (
        [150, 90, 20, 5],
        [(3, 5), *run_of(0, 150, 3), (2, 0), (1, 90), *run_of(1, 88, 2), (2, 20), (0, 70), (3, 1)],
        8,
        2,
        64,
        16,
    ),
    "prefill-chunk": ([40], run_of(0, 40, 24), 4, 2, 64, 16),
}


def scene_named(name: str) -> Scene:
    table_lens, rows, num_heads, num_kv_heads, head_dim, page_size = SCENES[name]
    return make_scene(table_lens, rows, num_heads, num_kv_heads, head_dim, page_size)


@st.composite
def random_scenes(draw, head_dims=(8, 16, 64)) -> Scene:
    num_kv_heads = draw(st.integers(1, 3))
    num_heads = num_kv_heads * draw(st.integers(1, 3))
    page_size = draw(st.sampled_from([1, 2, 4, 16]))
    table_lens = draw(st.lists(st.integers(0, 70), min_size=1, max_size=4))
    tables = st.integers(0, len(table_lens) - 1)
    rows = draw(
        st.lists(tables.flatmap(lambda t: st.tuples(st.just(t), st.integers(0, table_lens[t]))), min_size=1, max_size=8)
    )
    head_dim = draw(st.sampled_from(head_dims))
    return make_scene(table_lens, rows, num_heads, num_kv_heads, head_dim, page_size, seed=draw(st.integers(0, 99)))


def assert_matches_oracle(out: torch.Tensor, scene: Scene) -> None:
    assert out.shape == scene.q.shape and out.dtype == scene.q.dtype and out.device == scene.q.device
    torch.testing.assert_close(out.cpu().double(), oracle(scene), **TOLERANCES[out.dtype])


# ----------------------------------------------------------------------------------------------------------------
# The readable reference (the oracle) and the vectorised PyTorch path.


@pytest.mark.parametrize("name", SCENES)
def test_naive_reference_matches_dense_attention(name):
    scene = scene_named(name)
    torch.testing.assert_close(oracle(scene), dense_attention(scene), rtol=1e-12, atol=1e-12)  # fp64 both


def test_naive_write_kv_then_attend_reads_what_was_written():
    """The reference pair on one table: write a prompt's KV row by row, then attend causally."""
    gen = torch.Generator().manual_seed(0)
    length, page_size = 9, 4
    q, k, v = (torch.randn(length, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    k_cache, v_cache = (torch.full((4, page_size, 2, 8), float("nan"), dtype=torch.float64) for _ in range(2))
    block_tables = torch.tensor([[3, 0, 2, -1]])
    positions = torch.arange(length)
    naive_write_kv(k, v, k_cache, v_cache, block_tables[0, positions // page_size] * page_size + positions % page_size)
    out = naive_paged_attention(q, k_cache, v_cache, block_tables, torch.zeros(length, dtype=torch.long),
                                positions + 1, 8**-0.5)
    expected = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                              is_causal=True).transpose(0, 1)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", SCENES)
def test_torch_path_matches_oracle(name, dtype):
    scene = scene_named(name).to(dtype=dtype)
    assert_matches_oracle(paged_attention_torch(*scene.args()), scene)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("name", ["gqa-3-on-1", "mixed-tables-depths-runs"])  # one row per table, and shared tables
def test_torch_path_accepts_int32_and_int64_row_metadata(name, index_dtype):
    scene = scene_named(name).to(index_dtype=index_dtype)
    assert_matches_oracle(paged_attention_torch(*scene.args()), scene)


@settings(max_examples=60, deadline=None)
@given(scene=random_scenes())
def test_torch_path_matches_oracle_on_random_scenes(scene):
    assert_matches_oracle(paged_attention_torch(*scene.args()), scene)


def test_torch_path_split_into_one_table_per_chunk_matches_oracle(monkeypatch):
    monkeypatch.setattr(torch_paged, "_GATHER_BYTES", 1)
    scene = scene_named("mixed-tables-depths-runs")
    assert_matches_oracle(paged_attention_torch(*scene.args()), scene)


def test_torch_path_of_only_inactive_rows_or_no_rows_is_zero():
    scene = make_scene([8], [(0, 0), (0, 0)], num_heads=2, num_kv_heads=1, head_dim=16, page_size=4)
    assert torch.equal(paged_attention_torch(*scene.args()), torch.zeros_like(scene.q))
    no_rows = replace(scene, q=scene.q[:0], table_ids=scene.table_ids[:0], context_lens=scene.context_lens[:0])
    assert paged_attention_torch(*no_rows.args()).shape == (0, 2, 16)


def write_kv_case(device: str = "cpu", dtype: torch.dtype = torch.float32):
    """Five rows, two of them inactive (slot < 0), into a NaN-filled pool of 3 pages of 4 slots."""
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(5, 3, 64, generator=gen).to(device, dtype) for _ in range(2))
    k_cache, v_cache = (torch.full((3, 4, 3, 64), float("nan"), device=device, dtype=dtype) for _ in range(2))
    slots = torch.tensor([9, -1, 0, 7, -5], device=device)
    return k, v, k_cache, v_cache, slots


def test_naive_write_kv_scatters_rows_and_skips_negative_slots():
    k, v, k_cache, v_cache, slots = write_kv_case()
    naive_write_kv(k, v, k_cache, v_cache, slots)
    for row, slot in ((0, 9), (2, 0), (3, 7)):
        assert torch.equal(k_cache[slot // 4, slot % 4], k[row]) and torch.equal(v_cache[slot // 4, slot % 4], v[row])
    written = torch.zeros(3, 4, dtype=torch.bool)
    written.view(-1)[[9, 0, 7]] = True
    assert k_cache[~written].isnan().all() and v_cache[~written].isnan().all()


def test_write_kv_torch_matches_the_reference():
    k, v, k_cache, v_cache, slots = write_kv_case()
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    naive_write_kv(k, v, expected_k, expected_v, slots)
    write_kv_torch(k, v, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache, expected_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, expected_v, rtol=0, atol=0, equal_nan=True)


# ----------------------------------------------------------------------------------------------------------------
# The Triton kernels (under the interpreter in a subprocess, or on a GPU) and the dispatch.


@needs_triton
@pytest.mark.slow
@pytest.mark.skipif(INTERPRETED, reason="already running under the interpreter")
def test_triton_kernels_under_interpreter():
    """Reruns this module's kernel and dispatch tests in a subprocess with `TRITON_INTERPRET=1`."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-k", "triton or dispatch"],
        check=False,
        cwd=ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]


@needs_triton
@pytest.mark.parametrize("device, dtype", KERNEL_TARGETS)
@pytest.mark.parametrize("name", SCENES)
def test_triton_paged_attention_matches_oracle_and_torch_path(name, device, dtype):
    scene = scene_named(name).to(device, dtype)
    out = paged_attention_triton(*scene.args())
    assert_matches_oracle(out, scene)
    torch.testing.assert_close(out, paged_attention_torch(*scene.args()), **TOLERANCES[dtype])


@needs_triton
@pytest.mark.parametrize("device, dtype", KERNEL_TARGETS)
@settings(max_examples=8, deadline=None)
@given(scene=random_scenes(head_dims=(16, 64)))
def test_triton_paged_attention_matches_oracle_on_random_scenes(scene, device, dtype):
    scene = scene.to(device, dtype)
    assert_matches_oracle(paged_attention_triton(*scene.args()), scene)


@needs_triton
@pytest.mark.parametrize("device, dtype", KERNEL_TARGETS)
def test_triton_write_kv_matches_the_reference(device, dtype):
    k, v, k_cache, v_cache, slots = write_kv_case(device, dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    naive_write_kv(k, v, expected_k, expected_v, slots)
    write_kv_triton(k, v, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache, expected_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, expected_v, rtol=0, atol=0, equal_nan=True)


@needs_triton
@pytest.mark.parametrize("device, dtype", KERNEL_TARGETS)
def test_triton_kernels_take_rows_with_a_strided_head_dim(device, dtype):
    """Keys, values and queries whose head_dim is strided, as a projection of a few rows computed transposed gives
    them on a CPU (`models.layers.project`): the kernels refused them ("expected a unit stride")."""
    k, v, k_cache, v_cache, slots = write_kv_case(device, dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    naive_write_kv(k, v, expected_k, expected_v, slots)
    strided_k, strided_v = (x.transpose(0, 2).contiguous().transpose(0, 2) for x in (k, v))  # [N, Hkv, D]
    assert strided_k.stride(-1) != 1 and torch.equal(strided_k, k)
    write_kv_triton(strided_k, strided_v, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache, expected_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, expected_v, rtol=0, atol=0, equal_nan=True)
    scene = scene_named("mixed-tables-depths-runs").to(device, dtype)
    q, *rest = scene.args()
    strided_q = q.transpose(0, 2).contiguous().transpose(0, 2)  # [N, Hq, D]
    assert strided_q.stride(-1) != 1
    torch.testing.assert_close(paged_attention_triton(strided_q, *rest), paged_attention_triton(q, *rest),
                               rtol=0, atol=0)


@needs_triton
@pytest.mark.parametrize("device, dtype", KERNEL_TARGETS)
def test_triton_kernels_take_strided_slots_tables_and_lengths(device, dtype):
    """1-D slots, table ids and context lengths taken as a column of a 2-D tensor (stride 2): the kernels read them
    as contiguous, writing and reading the wrong slots without a word."""
    def strided(x: torch.Tensor) -> torch.Tensor:
        column = torch.stack([x, torch.zeros_like(x)], -1)[..., 0]
        assert column.stride(-1) == 2 and torch.equal(column, x)
        return column

    k, v, k_cache, v_cache, slots = write_kv_case(device, dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    naive_write_kv(k, v, expected_k, expected_v, slots)
    write_kv_triton(k, v, k_cache, v_cache, strided(slots))
    torch.testing.assert_close(k_cache, expected_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, expected_v, rtol=0, atol=0, equal_nan=True)
    scene = scene_named("mixed-tables-depths-runs").to(device, dtype)
    q, k_pool, v_pool, tables, table_ids, lengths, scale = scene.args()
    torch.testing.assert_close(paged_attention_triton(q, k_pool, v_pool, tables, strided(table_ids),
                                                      strided(lengths), scale),
                               paged_attention_triton(*scene.args()), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dispatch_on_cpu_picks_kernel_only_under_interpreter(dtype):
    """On CPU the PyTorch path runs, except under the interpreter, which takes fp32/fp16 but not bf16."""
    scene = scene_named("mixed-tables-depths-runs").to(dtype=dtype)
    kernel = INTERPRETED and dtype != torch.bfloat16
    expected = (paged_attention_triton if kernel else paged_attention_torch)(*scene.args())
    assert torch.equal(paged_attention(*scene.args()), expected)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=(pytest.mark.gpu, needs_cuda))])
def test_dispatch_write_then_attend_matches_causal_attention(device):
    """Prefill a prompt in two chunks, then decode one token: each call writes its rows' KV before attending."""
    gen = torch.Generator().manual_seed(0)
    length, num_heads, num_kv_heads, head_dim, page_size = 21, 4, 2, 64, 4
    q = torch.randn(length, num_heads, head_dim, generator=gen).to(device)
    k, v = (torch.randn(length, num_kv_heads, head_dim, generator=gen).to(device) for _ in range(2))
    k_cache, v_cache = (
        torch.full((8, page_size, num_kv_heads, head_dim), float("nan"), device=device) for _ in range(2)
    )
    block_tables = torch.tensor([[5, 2, 7, 0, 3, 6, -1]], dtype=torch.int32, device=device)
    pages = block_tables[0].long()

    out = torch.empty_like(q)
    for chunk in (slice(0, 13), slice(13, 20), slice(20, 21)):
        positions = torch.arange(chunk.start, chunk.stop, device=device)
        write_kv(
            k[chunk], v[chunk], k_cache, v_cache, pages[positions // page_size] * page_size + positions % page_size
        )
        table_ids = torch.zeros_like(positions)
        out[chunk] = paged_attention(q[chunk], k_cache, v_cache, block_tables, table_ids, positions + 1, head_dim**-0.5)

    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
    ).transpose(0, 1)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])
