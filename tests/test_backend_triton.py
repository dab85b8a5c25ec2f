"""The Triton backend: its kernels against a small dense reference written here, the
split-KV merge under forced split counts, exact cache writes and copies, and the
shared conformance suite (kvcore.testing.kernels) on "triton".

On a CPU-only machine the kernels run under TRITON_INTERPRET=1 (tests/conftest.py
sets it before kvcore_triton is imported), so shapes stay tiny: <= 48 tokens,
head dims 16..64, 1-2 KV heads. GPU runs are the ``gpu``-marked tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcore_triton import TritonBackend, decode_plan
from kvcore_triton import decode as triton_decode

from kvcore import backend as registry
from kvcore.backend import FEATURES, FP8_MAX
from kvcore.layout import cdiv
from kvcore.testing import tolerance
from kvcore.testing.kernel_cases import operands
from kvcore.testing.pytest_plugin import KernelConformance

pytestmark = pytest.mark.numeric  # rerun by CI as other CPUs (.ci/run)
I32, I64 = torch.int32, torch.int64
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FAST = settings(max_examples=12, deadline=None, database=None)


# -- the reference: gather K/V per sequence, dense softmax in fp32 -------------------


def reference(
    query: torch.Tensor,  # [q_len, Hq, D]
    kv_cache: torch.Tensor,
    pages: torch.Tensor,  # [n_pages] int
    seq_len: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Bottom-right causal attention of q_len queries over seq_len paged tokens, fp32 out;
    ``scale`` defaults to 1/sqrt(D)."""
    page_size = kv_cache.shape[2]
    tokens = torch.arange(seq_len)
    rows = kv_cache[pages.long()[tokens // page_size], :, tokens % page_size]  # [L, 2, Hkv, D]
    k, v = rows[:, 0].float(), rows[:, 1].float()
    group = query.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    q_len = query.shape[0]
    scale = query.shape[2] ** -0.5 if scale is None else scale
    scores = torch.einsum("qhd,khd->hqk", query.float(), k) * scale
    allowed = tokens[None, :] <= (seq_len - q_len + torch.arange(q_len))[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@dataclass(slots=True)
class Paged:
    """A NaN-poisoned cache holding each sequence's K/V on scattered pages."""

    kv_cache: torch.Tensor  # [num_pages, 2, page_size, Hkv, D]
    block_table: torch.Tensor  # [B, max_pages] int32; padding holds garbage
    seq_lens: torch.Tensor  # [B] int32, tokens
    pages: list[torch.Tensor]  # pages of each sequence, in order


@st.composite
def paged_st(draw: st.DrawFn, max_tokens: int = 48) -> tuple[Paged, int, str]:
    """(Paged, query heads, dtype); K/V written through TritonBackend.write_kv."""
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    head_dim = draw(st.sampled_from([16, 24, 40, 64]))
    page_size = draw(st.sampled_from([1, 3, 4, 8, 16]))
    kv_heads = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 3, 4]))
    seq_lens = draw(st.lists(st.integers(1, max_tokens), min_size=1, max_size=3))
    seed = draw(st.integers(0, 2**16))
    return build(seq_lens, page_size, kv_heads, head_dim, dtype, seed), kv_heads * group, dtype


def build(
    seq_lens: list[int], page_size: int, kv_heads: int, head_dim: int, dtype: str, seed: int
) -> Paged:
    gen = torch.Generator().manual_seed(seed)
    counts = [cdiv(n, page_size) for n in seq_lens]
    num_pages = sum(counts) + 3  # spare pages stay NaN
    order = torch.randperm(num_pages, generator=gen)
    kv_cache = torch.full(
        (num_pages, 2, page_size, kv_heads, head_dim), float("nan"), dtype=DTYPES[dtype]
    )
    max_pages = max(counts) + 1
    block_table = torch.full((len(seq_lens), max_pages), -12345, dtype=I32)  # never read
    backend = TritonBackend()
    pages, start = [], 0
    for b, (n, count) in enumerate(zip(seq_lens, counts, strict=True)):
        own = order[start : start + count]
        start += count
        block_table[b, :count] = own.to(I32)
        pages.append(own)
        slots = own.repeat_interleave(page_size)[:n] * page_size + torch.arange(n) % page_size
        key = torch.randn(n, kv_heads, head_dim, generator=gen).to(DTYPES[dtype])
        value = torch.randn(n, kv_heads, head_dim, generator=gen).to(DTYPES[dtype])
        backend.write_kv(backend.plan_write(kv_cache, slots.to(I64)), kv_cache, key, value)
    paged = Paged(kv_cache, block_table, torch.tensor(seq_lens, dtype=I32), pages)
    return to_device(paged)


def to_device(p: Paged) -> Paged:
    return Paged(p.kv_cache.to(DEVICE), p.block_table.to(DEVICE), p.seq_lens.to(DEVICE), p.pages)


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    keys: int,
    scale: float,
) -> None:
    """``actual`` (the kernel) within tolerance.attention's bound of ``expected`` (the fp32
    reference): both read the same stored query and K/V (``keys`` of them per query); the
    kernel may round its dot operands as kernel_cases.operands says for this device."""
    key, value = tolerance.cache_parts(kv_cache)
    ops = operands("triton", DEVICE, tolerance.format_name(query.dtype))
    bound = tolerance.attention(query, key, value, scale, keys=keys, operands=ops)
    tolerance.assert_close(actual, expected, bound, "the Triton kernel vs the fp32 reference")


# -- decode ----------------------------------------------------------------------------


@FAST
@given(case=paged_st(), splits=st.sampled_from([None, 1, 2, 3, 64]))
def test_decode_matches_reference_for_any_split_count(
    case: tuple[Paged, int, str], splits: int | None
) -> None:
    """Forced split counts cover one split, uneven splits, and splits left empty for
    the shorter sequences of a batch (their lse = -inf must weigh nothing)."""
    paged, num_q_heads, dtype = case
    batch, head_dim = paged.seq_lens.shape[0], paged.kv_cache.shape[4]
    scale = 1 / math.sqrt(head_dim)
    query = torch.randn(batch, num_q_heads, head_dim).to(DTYPES[dtype]).to(DEVICE)
    out = triton_decode.decode(
        query,
        paged.kv_cache,
        paged.block_table.clamp(min=0),  # padding in range: the kernel must still skip it
        paged.seq_lens,
        scale,
        interpreted=DEVICE == "cpu",
        num_splits=splits,
    )
    assert out.dtype == query.dtype and out.shape == query.shape
    for b, pages in enumerate(paged.pages):
        n = int(paged.seq_lens[b])
        ref = reference(query[b : b + 1].cpu(), paged.kv_cache.cpu(), pages, n)
        assert_close(out[b : b + 1], ref, query[b : b + 1], paged.kv_cache, n, scale)


def test_decode_plan_fills_the_gpu_and_splits_page_aligned() -> None:
    """The benchmark shape on 132 SMs: 2 splits, 32-token blocks over 16-token pages;
    a lone sequence spreads over the most splits."""
    common: dict[str, Any] = dict(num_kv_heads=8, group=4, head_dim=128, page_size=16, sm_count=132)
    wide = decode_plan.plan_decode(batch=64, max_tokens=4096, interpreted=False, **common)
    assert (wide.num_splits, wide.tokens_per_split, wide.block_n) == (2, 2048, 32)
    assert wide.block_n % 16 == 0 and wide.block_h == 16 and wide.block_d == 128
    lone = decode_plan.plan_decode(batch=1, max_tokens=4096, interpreted=False, **common)
    assert lone.num_splits == decode_plan.MAX_SPLITS
    assert lone.num_splits * lone.tokens_per_split >= 4096
    short = decode_plan.plan_decode(batch=1, max_tokens=10, interpreted=False, **common)
    assert short.num_splits == 1  # never more splits than token blocks
    assert wide.num_stages == 3  # page ids one block ahead: two K/V buffers (compile test)


def test_prefill_plan_keeps_16_bit_operands_on_a_gpu() -> None:
    """fp16/bf16 operands go to tensor cores as they are; fp32, and bf16 under the
    interpreter (whose bf16 arithmetic is wrong), are widened to fp32."""
    from kvcore_triton.prefill import plan_prefill

    def f32_dot(dtype: torch.dtype, interpreted: bool) -> bool:
        plan = plan_prefill(
            group=4, head_dim=128, page_size=16, dtype=dtype, interpreted=interpreted
        )
        return plan.f32_dot

    assert not f32_dot(torch.bfloat16, False) and not f32_dot(torch.float16, False)
    assert f32_dot(torch.float32, False) and f32_dot(torch.bfloat16, True)
    assert not f32_dot(torch.float16, True)  # the interpreter's fp16 is exact


# -- prefill ---------------------------------------------------------------------------


@FAST
@given(case=paged_st(), data=st.data())
def test_prefill_over_cached_prefix_matches_reference(
    case: tuple[Paged, int, str], data: st.DataObject
) -> None:
    paged, num_q_heads, dtype = case
    seq_lens = paged.seq_lens.tolist()
    q_lens = [data.draw(st.integers(0, n), label="q_len") for n in seq_lens]
    head_dim = paged.kv_cache.shape[4]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=I32)
    query = torch.randn(sum(q_lens), num_q_heads, head_dim).to(DTYPES[dtype])
    backend = TritonBackend()
    plan = backend.plan_prefill(paged.kv_cache, paged.block_table, cu.to(DEVICE), paged.seq_lens)
    scale = 1 / math.sqrt(head_dim)
    out = backend.prefill(plan, query.to(DEVICE), paged.kv_cache, scale)
    for b, pages in enumerate(paged.pages):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        ref = reference(query[rows], paged.kv_cache.cpu(), pages, seq_lens[b])
        assert_close(out[rows], ref, query[rows], paged.kv_cache, seq_lens[b], scale)


def test_prefill_of_a_whole_sequence_is_causal() -> None:
    """q_len == seq_len: query 0 sees only token 0, so it returns V[0] (p = 1 exactly; on
    a GPU, fp32 P V runs on TF32: within the bound of one key)."""
    paged = build([20], page_size=3, kv_heads=2, head_dim=32, dtype="float32", seed=7)
    query = torch.randn(20, 4, 32, device=DEVICE)
    cu = torch.tensor([0, 20], dtype=I32, device=DEVICE)
    backend = TritonBackend()
    plan = backend.plan_prefill(paged.kv_cache, paged.block_table, cu, paged.seq_lens)
    out = backend.prefill(plan, query, paged.kv_cache, 0.2)
    first_page = int(paged.pages[0][0])
    v0 = paged.kv_cache[first_page, 1, 0].repeat_interleave(2, dim=0)  # [Hq, D]
    ref = reference(query.cpu(), paged.kv_cache.cpu(), paged.pages[0], 20, 0.2)
    assert_close(out, ref, query, paged.kv_cache, 20, 0.2)
    assert_close(out[:1], v0[None], query[:1], paged.kv_cache, 1, 0.2)  # token 0's alone


# -- strided caches ----------------------------------------------------------------------


def test_strided_cache_view_gives_the_same_result() -> None:
    """A cache that is a slice of a larger tensor (spare heads and elements, NaN) and a
    query with padded heads: the kernels follow strides and never read the padding."""
    paged = build([9, 30], page_size=4, kv_heads=2, head_dim=24, dtype="float16", seed=3)
    big = torch.full((*paged.kv_cache.shape[:3], 3, 40), float("nan"), dtype=torch.float16)
    big = big.to(DEVICE)
    big[:, :, :, :2, :24] = paged.kv_cache
    view = big[:, :, :, :2, :24]
    assert not view.is_contiguous()
    qbig = torch.randn(2, 8, 40).to(torch.float16).to(DEVICE)
    query = qbig[:, ::2, :24]  # heads at stride 2: [2, 4, 24]
    backend = TritonBackend()
    plan = backend.plan_decode(paged.kv_cache, paged.block_table, paged.seq_lens)
    dense = backend.decode(plan, query.contiguous(), paged.kv_cache, 0.3)
    strided = backend.decode(plan, query, view, 0.3)  # one plan, any view of its geometry
    # the same kernel on the same values through other strides: the same operations, so
    # the same bits (no rounding differs, nothing to bound)
    torch.testing.assert_close(strided, dense, atol=0, rtol=0)


# -- write_kv and copy_pages: exact ------------------------------------------------------


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_write_kv_is_bit_exact_and_skips_negative_slots(dtype: str) -> None:
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(4, 2, 5, 2, 40, generator=gen).to(DTYPES[dtype]).to(DEVICE)
    before = cache.clone()
    key = torch.randn(6, 2, 40, generator=gen).to(DTYPES[dtype]).to(DEVICE)
    value = torch.randn(6, 2, 40, generator=gen).to(DTYPES[dtype]).to(DEVICE)
    slots = torch.tensor([0, -1, 19, 7, -5, 12], dtype=I64, device=DEVICE)
    backend = TritonBackend()
    backend.write_kv(backend.plan_write(cache, slots), cache, key, value)
    expected = before.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot // 5, 0, slot % 5] = key[t]
            expected[slot // 5, 1, slot % 5] = value[t]
    bits = torch.int32 if dtype == "float32" else torch.int16
    assert torch.equal(cache.view(bits), expected.view(bits))


def test_copy_pages_copies_exactly_and_touches_nothing_else() -> None:
    cache = torch.randn(6, 2, 3, 2, 24).to(torch.bfloat16).to(DEVICE)
    cache[5, 0, 1, 1, 3] = float("nan")  # NaN bits copy as they are
    before = cache.clone()
    backend = TritonBackend()
    plan = backend.plan_copy(
        cache,
        torch.tensor([5, 1], dtype=I64, device=DEVICE),
        torch.tensor([0, 3], dtype=I64, device=DEVICE),
    )
    backend.copy_pages(plan, cache)
    expected = before.clone()
    expected[0], expected[3] = before[5], before[1]
    assert torch.equal(cache.view(torch.int16), expected.view(torch.int16))


# -- registry and capabilities ---------------------------------------------------------


def test_registry_gives_the_triton_backend_with_honest_devices() -> None:
    backend = registry.get("triton")
    assert isinstance(backend, TritonBackend)
    assert backend.capabilities.devices == ({"cpu"} if backend.interpreted else {"cuda"})
    assert backend.capabilities.dtypes == set(DTYPES) | set(FP8_MAX)
    assert backend.capabilities.features == FEATURES
    assert backend.capabilities.supports(DEVICE, "bfloat16", 80, 7)
    assert backend.capabilities.supports(DEVICE, "float8_e4m3fn", 576, 64, latent=True)


# -- the shared conformance suite --------------------------------------------------------


class TestTritonConformance(KernelConformance):
    backend = "triton"
    device = DEVICE


@pytest.mark.gpu
def test_decode_on_gpu_matches_reference_at_the_benchmark_head_shape() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    paged = build([1, 15, 16, 17, 300], 16, kv_heads=8, head_dim=128, dtype="bfloat16", seed=5)
    query = torch.randn(5, 32, 128, device="cuda").to(torch.bfloat16)
    backend = TritonBackend()
    plan = backend.plan_decode(paged.kv_cache, paged.block_table, paged.seq_lens)
    out = backend.decode(plan, query, paged.kv_cache, 128**-0.5)
    for b, pages in enumerate(paged.pages):
        n = int(paged.seq_lens[b])
        ref = reference(query[b : b + 1].cpu(), paged.kv_cache.cpu(), pages, n)
        assert_close(out[b : b + 1], ref, query[b : b + 1], paged.kv_cache, n, 128**-0.5)
