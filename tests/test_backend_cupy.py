"""The CuPy raw-CUDA backend (kvcore_cupy).

Three tiers:

* everywhere: construction fails cleanly without cupy / CUDA; the declared
  capabilities; the host-side launch planning (fast page-size division, GQA
  tiling, split-KV plan, load width) as properties;
* everywhere with g++: the *same* .cu kernels and the same host code run on
  the CPU through tests/cupy_emulation (a fiber scheduler that emulates warp
  shuffles and __syncthreads), held to the conformance suite and to the torch
  oracle on the shapes the suite's quick profile does not reach (head dims
  80..256, GQA groups above 8, unaligned caches, many splits);
* on a GPU (``gpu`` marker; skipped without CUDA or cupy): the conformance
  suite on device cuda, NVRTC accepting every module, and the benchmark shape.
"""

from __future__ import annotations

import importlib.util
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcore_cupy import CupyBackend, kernels, plan
from kvcore_cupy.backend import widest_chunk
from kvcore_torch import TorchBackend

from kvcore import backend as registry
from kvcore.backend import Backend
from kvcore.errors import Unsupported
from kvcore.layout import cdiv
from kvcore.testing import tolerance
from kvcore.testing.kernel_cases import operands
from kvcore.testing.pytest_plugin import KernelConformance

pytestmark = pytest.mark.numeric  # rerun by CI as other CPUs (.ci/run)
I32, I64 = torch.int32, torch.int64
HAVE_CUPY = importlib.util.find_spec("cupy") is not None
HAVE_GPU = HAVE_CUPY and torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAVE_GPU, reason="needs cupy and a CUDA device")
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found (emulation)")


# -- construction and capabilities -------------------------------------------------


@pytest.mark.skipif(HAVE_GPU, reason="cupy and CUDA are both here")
def test_construction_raises_unsupported_without_cupy_or_cuda() -> None:
    with pytest.raises(Unsupported, match=r"cupy is not installed|no CUDA device"):
        CupyBackend()
    with pytest.raises(Unsupported):
        registry.get("cupy")


def test_registered_and_declares_cuda_only() -> None:
    assert "cupy" in registry.available()
    caps = CupyBackend.capabilities
    assert caps.devices == frozenset({"cuda"})
    assert caps.dtypes == frozenset(
        {"float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"}
    )
    assert caps.head_dims == frozenset({64, 80, 96, 128, 256})
    assert caps.page_sizes is None  # every page size 1..128


# -- host-side planning --------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(d=st.integers(1, 128), n=st.integers(0, (1 << 31) - 1))
def test_fast_divisor_divides_like_the_kernel(d: int, n: int) -> None:
    fd = plan.fast_divisor(d)
    assert fd.mul < 1 << 32 and fd.shift <= 7
    assert fd.div(n) == n // d


def test_fast_divisor_at_page_boundaries() -> None:
    for d in range(1, 129):
        fd = plan.fast_divisor(d)
        for page in (0, 1, 2, 1000, (1 << 31) // d - 1):
            for n in (page * d - 1, page * d, page * d + d - 1):
                if 0 <= n < 1 << 31:
                    assert fd.div(n) == n // d, (d, n)


@given(group=st.integers(1, 128))
def test_group_tiling_covers_the_group(group: int) -> None:
    t = plan.group_tiling(group)
    assert t.tile in kernels.GROUP_TILES
    assert t.tile * t.n_chunks >= group > t.tile * (t.n_chunks - 1)
    if group <= max(kernels.GROUP_TILES):
        assert t.n_chunks == 1 and t.tile < 2 * group  # K/V read once, < half masked


@given(
    max_tokens=st.integers(1, 1 << 20),
    base=st.integers(1, 1 << 14),
    sms=st.integers(1, 256),
    min_split=st.integers(1, 512),
    align=st.sampled_from([1, 8, 16, 64]),
)
def test_split_plan_covers_every_token(
    max_tokens: int, base: int, sms: int, min_split: int, align: int
) -> None:
    p = plan.split_plan(max_tokens, base, sms, min_split=min_split, align=align)
    assert p.num_splits >= 1 and p.split_len % align == 0
    assert p.num_splits * p.split_len >= max_tokens > (p.num_splits - 1) * p.split_len
    assert p.num_splits <= max(1, max_tokens // min_split)  # no split shorter than asked
    assert p.num_splits <= 65535  # grid.z


def test_split_plan_for_the_benchmark_shape() -> None:
    """B=64, Hkv=8, ctx 4096, page 16 on 132 SMs: >= 4 CTAs per SM, long splits."""
    p = plan.split_plan(4096, 64 * 8, 132)
    assert 64 * 8 * p.num_splits >= 4 * 132
    assert p.split_len >= 1024
    short = plan.split_plan(128, 64 * 8, 132)
    assert short.num_splits == 1  # short contexts skip the merge


def test_widest_chunk() -> None:
    def of(t: torch.Tensor) -> int:
        return widest_chunk(tuple(t.shape), t.stride(), t.data_ptr(), t.element_size())

    pool = torch.zeros(4, 2, 16, 2, 64, dtype=torch.bfloat16)
    assert of(pool) == 16
    assert of(pool.transpose(0, 1)) == 16  # a stride permutation keeps rows aligned
    padded = torch.zeros(4, 2, 16, 3, 64 + 3, dtype=torch.bfloat16)[:, :, :, 1:, :64]
    assert of(padded) == 2
    assert of(torch.zeros(4, 2, 16, 3, 65)[:, :, :, :, :64]) == 4  # fp32: element-wise
    one_page = torch.zeros(1, 2, 1, 1, 64)[:, :, :, :, :64]  # size-1 dims never move
    assert of(one_page) == 16


# -- the kernels on the CPU, through the emulation -------------------------------------


def _emulated() -> CupyBackend:
    from cupy_emulation import EmulatedCupyBackend

    if shutil.which("g++") is None:
        pytest.skip("g++ not found: the CPU emulation of the CUDA kernels needs it")
    return EmulatedCupyBackend()


@needs_gxx
class TestCupyEmulatedConformance(KernelConformance):
    """The conformance suite (quick profile: head dim 64, page sizes 1..16, GQA up
    to 4) on the CUDA kernels, run on the CPU."""

    backend = staticmethod(_emulated)
    device = "cpu"
    profile = "quick"


def _paged(
    lens: list[int], page_size: int, hkv: int, d: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """A random cache whose sequences own shuffled pages; unused slots hold NaN.
    Returns (cache, block_table, the 3 pages no sequence holds)."""
    need = [cdiv(n, page_size) for n in lens]
    num_pages = sum(need) + 3
    cache = torch.full((num_pages, 2, page_size, hkv, d), float("nan"), dtype=dtype)
    order = torch.randperm(num_pages, generator=gen)
    table = torch.zeros(len(lens), max(need), dtype=I32)
    at = 0
    for b, (n, p) in enumerate(zip(lens, need, strict=True)):
        pages = order[at : at + p]
        at += p
        table[b, :p] = pages.to(I32)
        kv = torch.randn(2, p * page_size, hkv, d, generator=gen).to(dtype)
        for j, page in enumerate(pages.tolist()):
            lo, hi = j * page_size, min((j + 1) * page_size, n)
            if hi > lo:
                cache[page, :, : hi - lo] = kv[:, lo:hi]
    return cache, table, order[at:].tolist()


def decode(
    backend: Backend,
    q: torch.Tensor,
    cache: torch.Tensor,
    table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return backend.decode(backend.plan_decode(cache, table, seq_lens), q, cache, scale)


def assert_close(
    got: torch.Tensor,
    want: torch.Tensor,
    query: torch.Tensor,
    cache: torch.Tensor,
    keys: int,
    scale: float,
    *,
    sides: int = 1,
) -> None:
    """tolerance.attention's bound: the CUDA kernels and kvcore_torch (or, ``sides=2``,
    the CUDA kernels twice) read the same query and stored K/V (``keys`` per query at
    most); the order of the sums and the kernels' dot operands (kernel_cases.operands:
    a 16-bit query's P) differ."""
    key, value = tolerance.cache_parts(cache)
    ops = operands("cupy", "cuda", tolerance.format_name(query.dtype))
    bound = tolerance.attention(query, key, value, scale, keys=keys, operands=ops, sides=sides)
    tolerance.assert_close(got, want, bound, "the CUDA kernels vs kvcore_torch")


@needs_gxx
@pytest.mark.parametrize(
    ("dtype", "d", "hq", "hkv", "page_size", "lens", "unaligned"),
    [
        # the benchmark's head geometry (GQA 4, D 128, bf16, page 16), several splits
        (torch.bfloat16, 128, 8, 2, 16, [1, 15, 16, 17, 300], False),
        # a GQA group above 8 (12 -> two chunks of 8), odd page size, fp16
        (torch.float16, 80, 24, 2, 7, [6, 7, 8, 90], False),
        # MQA (group 32 -> four chunks), page 128, fp32, D 96
        (torch.float32, 96, 32, 1, 128, [1, 127, 129], False),
        # D 256, page 1, element-wise loads on a padded (unaligned) cache
        (torch.bfloat16, 256, 2, 2, 1, [3, 40], True),
    ],
)
def test_emulated_kernels_match_the_oracle(
    dtype: torch.dtype,
    d: int,
    hq: int,
    hkv: int,
    page_size: int,
    lens: list[int],
    unaligned: bool,
) -> None:
    """Shapes beyond the quick profile: decode, prefill over a cached prefix, and
    write_kv / copy_pages round trips, against kvcore_torch."""
    backend, oracle = _emulated(), TorchBackend()
    gen = torch.Generator().manual_seed(d * 7 + hq)
    cache, table, spare = _paged(lens, page_size, hkv, d, dtype, gen)
    if unaligned:  # the same values in a view whose rows are not 16-byte aligned
        big = torch.full((*cache.shape[:3], hkv + 1, d + 3), float("nan"), dtype=dtype)
        big[:, :, :, 1:, :d] = cache
        cache = big[:, :, :, 1:, :d]
        assert (
            widest_chunk(tuple(cache.shape), cache.stride(), cache.data_ptr(), cache.element_size())
            < 16
        )
    seq_lens = torch.tensor(lens, dtype=I32)
    scale = d**-0.5

    q = torch.randn(len(lens), hq, d, generator=gen).to(dtype)
    got = decode(backend, q, cache, table, seq_lens, scale)
    want = decode(oracle, q, cache, table, seq_lens, scale)
    assert_close(got, want, q, cache, max(lens), scale)

    q_lens = [min(n, 1 + n // 3) for n in lens]  # the rest of each sequence is cached
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=I32)
    qp = torch.randn(int(cu[-1]), hq, d, generator=gen).to(dtype)
    got = backend.prefill(backend.plan_prefill(cache, table, cu, seq_lens), qp, cache, scale)
    want = oracle.prefill(oracle.plan_prefill(cache, table, cu, seq_lens), qp, cache, scale)
    assert_close(got, want, qp, cache, max(lens), scale)

    # write_kv: new tokens into slots of spare pages (one skipped), bit-exact
    slots = torch.tensor([spare[0] * page_size, -1, spare[1] * page_size + page_size - 1])
    k, v = (torch.randn(3, hkv, d, generator=gen).to(dtype) for _ in range(2))
    mine, ref = cache.clone(), cache.clone()
    backend.write_kv(backend.plan_write(mine, slots), mine, k, v)
    oracle.write_kv(oracle.plan_write(ref, slots), ref, k, v)
    assert torch.equal(mine.nan_to_num(7.0), ref.nan_to_num(7.0))
    # copy_pages: copy-on-write of the first pages of sequence 0 onto spare pages
    src = table[0, :1].long()
    dst = torch.tensor([spare[2]], dtype=I64)
    backend.copy_pages(backend.plan_copy(mine, src, dst), mine)
    oracle.copy_pages(oracle.plan_copy(ref, src, dst), ref)
    assert torch.equal(mine.nan_to_num(7.0), ref.nan_to_num(7.0))


# -- on a GPU -------------------------------------------------------------------------


@pytest.mark.gpu
class TestCupyConformanceCuda(KernelConformance):
    backend = "cupy"
    device = "cuda"  # the fixture skips without CUDA, and on Unsupported (no cupy)


@pytest.mark.gpu
@pytest.mark.slow
class TestCupyConformanceCudaFull(KernelConformance):
    backend = "cupy"
    device = "cuda"
    profile = "full"


@pytest.mark.gpu
@needs_gpu
def test_nvrtc_compiles_every_module() -> None:
    """NVRTC (not nvcc) accepts every (file, dtype, head dim, width) module."""
    from kvcore_cupy import runtime

    modules = runtime.Modules()
    for file in kernels.ATTENTION_FILES:
        for dtype in kernels.C_TYPES:
            for d in kernels.HEAD_DIMS:
                for wide in (True, False):
                    for name in kernels.module_names(file, dtype, d, wide):
                        assert modules.function(file, dtype, d, wide, name) is not None
    for name in kernels.CACHE_OPS_KERNELS:
        assert modules.cache_op(name) is not None


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_benchmark_shape_matches_oracle(dtype: torch.dtype) -> None:
    """B=64, ctx 4096 (ragged), Hq=32, Hkv=8, D=128, page 16: decode against the
    oracle on cuda (several splits and the merge), and prefill of the last token."""
    gen = torch.Generator().manual_seed(0)
    lens = [4096 - 61 * b for b in range(64)]
    cache, table, _ = _paged(lens, 16, 8, 128, dtype, gen)
    cache, table = cache.cuda(), table.cuda()
    seq_lens = torch.tensor(lens, dtype=I32, device="cuda")
    q = torch.randn(64, 32, 128, generator=gen).to(dtype).cuda()
    backend, oracle = CupyBackend(), TorchBackend()
    got = decode(backend, q, cache, table, seq_lens, 128**-0.5)
    want = decode(oracle, q, cache, table, seq_lens, 128**-0.5)
    assert_close(got, want, q, cache, max(lens), 128**-0.5)
    cu = torch.arange(65, dtype=I32, device="cuda")
    last = backend.prefill(backend.plan_prefill(cache, table, cu, seq_lens), q, cache, 128**-0.5)
    assert_close(last, got, q, cache, max(lens), 128**-0.5, sides=2)  # both the CUDA kernels
