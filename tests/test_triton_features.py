"""The Triton kernels' attention features (issue 30) against a dense fp32 reference
written here: fp8 caches (write_kv's quantization bit for bit against torch's, and
attention over the dequantized cache), sliding windows (with the block-table entries
before every window released to -1), logit soft-capping, attention sinks (through the
split-KV merge under forced split counts) and MLA over a latent cache, in decode and
prefill, alone and combined.

Runs the kernels' launch functions (kvcore_triton.decode / prefill / cache_ops), so it
does not depend on the contract's plan options; tests/test_backend_triton.py runs them
through TritonBackend and the conformance suite. Under TRITON_INTERPRET=1 shapes stay
tiny (<= 40 tokens, <= 2 KV heads) except one MLA case at DeepSeek's 512 + 64.
The file runs past 400 lines because its one reference and one cache builder serve
every feature in both kernels; split, each part would need its own copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from kvcore_triton import cache_ops
from kvcore_triton import decode as triton_decode
from kvcore_triton import prefill as triton_prefill

from kvcore.layout import cdiv
from kvcore.testing import tolerance
from kvcore.testing.kernel_cases import operands

pytestmark = pytest.mark.numeric  # rerun by CI as other CPUs (.ci/run)
I32, I64 = torch.int32, torch.int64
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = DEVICE == "cpu"
FP8 = {"float8_e4m3fn": (torch.float8_e4m3fn, 448.0), "float8_e5m2": (torch.float8_e5m2, 57344.0)}


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """What an fp8 cache holds: x / scale in fp32, saturated, rounded to nearest even."""
    fmax = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-fmax, fmax).to(dtype)


def reference(
    query: torch.Tensor,  # [q, Hq, Dk]
    key: torch.Tensor,  # [L, Hkv, Dk] fp32 (dequantized)
    value: torch.Tensor,  # [L, Hkv, Dv] fp32
    scale: float,
    *,
    window_left: int = -1,
    soft_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bottom-right causal attention of q queries over L tokens in fp32: query i at
    position L - q + i attends max(0, p - window_left) <= j <= p; ``sinks`` [Hq] join
    the denominator only."""
    num_q, num_q_heads, _ = query.shape
    length = key.shape[0]
    group = num_q_heads // key.shape[1]
    k = key.repeat_interleave(group, dim=1)
    v = value.repeat_interleave(group, dim=1)
    logits = torch.einsum("qhd,khd->hqk", query.float(), k) * scale
    if soft_cap > 0:
        logits = soft_cap * torch.tanh(logits / soft_cap)
    pos = length - num_q + torch.arange(num_q)
    j = torch.arange(length)
    allowed = j[None, :] <= pos[:, None]
    if window_left >= 0:
        allowed &= j[None, :] >= pos[:, None] - window_left
    logits = logits.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        column = sinks.float()[:, None, None].expand(num_q_heads, num_q, 1)
        probs = torch.cat([logits, column], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = logits.softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


@dataclass(slots=True)
class Paged:
    """A NaN-poisoned cache (its spare pages and released table entries never read)."""

    kv_cache: torch.Tensor  # [num_pages, parts, page_size, Hkv, D]
    block_table: torch.Tensor  # [B, max_pages] int32
    seq_lens: torch.Tensor  # [B] int32
    key: list[torch.Tensor]  # per sequence [L, Hkv, D] fp32, dequantized as the cache holds it
    value: list[torch.Tensor]  # per sequence [L, Hkv, Dv] fp32


def build(
    seq_lens: list[int],
    *,
    page_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: str,
    seed: int,
    v_head_dim: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    released: list[int] | None = None,
) -> Paged:
    """K/V (or latent vectors when ``v_head_dim`` is set) written through
    cache_ops.write_kv; then the first ``released[b]`` table entries of sequence b are
    set to -1 and their pages poisoned again (a hybrid engine released them)."""
    latent = v_head_dim is not None
    torch_dtype = FP8[dtype][0] if dtype in FP8 else getattr(torch, dtype)
    gen = torch.Generator().manual_seed(seed)
    counts = [cdiv(n, page_size) for n in seq_lens]
    num_pages = sum(counts) + 2
    order = torch.randperm(num_pages, generator=gen)
    parts = 1 if latent else 2
    shape = (num_pages, parts, page_size, kv_heads, head_dim)
    kv_cache = torch.full(shape, float("nan")).to(torch_dtype).to(DEVICE)
    block_table = torch.full((len(seq_lens), max(counts) + 1), -12345, dtype=I32)
    keys, values, start = [], [], 0
    source = torch.float32 if dtype in FP8 else torch_dtype
    for b, (n, count) in enumerate(zip(seq_lens, counts, strict=True)):
        own = order[start : start + count]
        start += count
        block_table[b, :count] = own.to(I32)
        slots = own.repeat_interleave(page_size)[:n] * page_size + torch.arange(n) % page_size
        key = (2 * torch.randn(n, kv_heads, head_dim, generator=gen)).to(source)
        value = None if latent else torch.randn(n, kv_heads, head_dim, generator=gen).to(source)
        cache_ops.write_kv(
            kv_cache,
            key.to(DEVICE),
            None if value is None else value.to(DEVICE),
            slots.to(I64).to(DEVICE),
            k_scale=k_scale,
            v_scale=v_scale,
        )
        if dtype in FP8:
            key = quantize(key, torch_dtype, k_scale).float() * k_scale
            if value is not None:
                value = quantize(value, torch_dtype, v_scale).float() * v_scale
        keys.append(key.float())
        values.append(key[..., :v_head_dim].float() if value is None else value.float())
    for b, count in enumerate(released or []):
        kv_cache[block_table[b, :count].long()] = float("nan")
        block_table[b, :count] = -1
    return Paged(
        kv_cache, block_table.to(DEVICE), torch.tensor(seq_lens, dtype=I32).to(DEVICE), keys, values
    )


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
) -> None:
    """``actual`` (the kernel) within tolerance.attention's bound of ``expected`` (the fp32
    reference over the same dequantized ``key``/``value`` [L, Hkv, D] and rounded
    ``query``): only the order of the sums, the kernel's dot operands
    (kernel_cases.operands) and the output's rounding differ."""
    ops = operands("triton", DEVICE, tolerance.format_name(query.dtype))
    keys = key.shape[0]
    bound = tolerance.attention(query, key, value, scale, keys=keys, operands=ops)
    tolerance.assert_close(actual, expected, bound, "the Triton kernel vs the fp32 reference")


def query_dtype(dtype: str) -> torch.dtype:
    """The cache's dtype; over fp8 caches fp32 (e4m3fn) or fp16 (e5m2) queries."""
    return {"float8_e4m3fn": torch.float32, "float8_e5m2": torch.float16}.get(
        dtype, getattr(torch, dtype, torch.float32)
    )


# -- write_kv: fp8 quantization bit for bit, latent rows -----------------------------------


@pytest.mark.parametrize("dtype", sorted(FP8))
def test_write_kv_quantizes_to_fp8_as_torch_does(dtype: str) -> None:
    """Every tie between neighbouring fp8 values (round to even), values past the largest
    (saturated, not NaN), subnormals, signed zeros and random values, divided by the
    scale in fp32: the cache's bytes equal torch's ``(x / scale).clamp(...).to(fp8)``."""
    fp8, fmax = FP8[dtype]
    grid = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    grid = torch.sort(grid[grid.isfinite()]).values  # -max .. max (+-0 both)
    ties = (grid[1:] + grid[:-1]) / 2
    gen = torch.Generator().manual_seed(0)
    extra = torch.tensor([0.0, -0.0, fmax * 1.5, -fmax * 4, 1e-30, -1e-30, float(2**-10)])
    values = torch.cat([grid, ties, extra, torch.randn(200, generator=gen) * 30])
    for scale in (1.0, 0.37):
        x = (values * scale).reshape(-1, 1, 1)  # x / scale lands on the grid, ties included
        n = x.shape[0]
        cache = torch.zeros(n, 2, 1, 1, 1, dtype=fp8, device=DEVICE)
        slots = torch.arange(n, dtype=I64, device=DEVICE)
        cache_ops.write_kv(
            cache, x.to(DEVICE), (-x).to(DEVICE), slots, k_scale=scale, v_scale=scale
        )
        bits = cache.view(torch.uint8).cpu()
        assert torch.equal(
            bits[:, 0].flatten(), quantize(x, fp8, scale).view(torch.uint8).flatten()
        )
        assert torch.equal(
            bits[:, 1].flatten(), quantize(-x, fp8, scale).view(torch.uint8).flatten()
        )


def test_write_kv_of_bf16_rows_into_fp8_and_latent_rows() -> None:
    """bf16 keys/values quantize from their fp32 values; a latent cache (one part)
    takes its vectors as the key, no value, and skips negative slots."""
    gen = torch.Generator().manual_seed(2)
    key = torch.randn(5, 2, 24, generator=gen).to(torch.bfloat16)
    value = torch.randn(5, 2, 24, generator=gen).to(torch.bfloat16)
    cache = torch.zeros(3, 2, 2, 2, 24, dtype=torch.float8_e4m3fn, device=DEVICE)
    slots = torch.tensor([4, 0, -1, 5, 2], dtype=I64)
    cache_ops.write_kv(
        cache, key.to(DEVICE), value.to(DEVICE), slots.to(DEVICE), k_scale=0.5, v_scale=2.0
    )
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        got = cache[slot // 2, :, slot % 2].cpu().view(torch.uint8)
        assert torch.equal(got[0], quantize(key[t], torch.float8_e4m3fn, 0.5).view(torch.uint8))
        assert torch.equal(got[1], quantize(value[t], torch.float8_e4m3fn, 2.0).view(torch.uint8))

    latent = torch.randn(3, 1, 40, generator=gen).to(torch.float16)
    cache16 = torch.zeros(2, 1, 4, 1, 40, dtype=torch.float16, device=DEVICE)
    cache_ops.write_kv(cache16, latent.to(DEVICE), None, torch.tensor([7, -3, 1]).to(DEVICE))
    assert torch.equal(cache16[1, 0, 3].cpu(), latent[0])
    assert torch.equal(cache16[0, 0, 1].cpu(), latent[2])
    assert int((cache16 != 0).any(-1).sum()) == 2


# -- decode ------------------------------------------------------------------------------

# (dtype, window_left, soft_cap, sinks, forced splits): each feature alone, then together.
DECODE_CASES = [
    ("float8_e4m3fn", -1, 0.0, False, None),
    ("float8_e5m2", -1, 0.0, False, 2),
    ("bfloat16", 5, 0.0, False, None),
    ("float16", 0, 0.0, False, None),
    ("float32", -1, 1.5, False, 3),
    ("float32", -1, 0.0, True, 3),
    ("bfloat16", -1, 0.0, True, 1),
    ("float8_e4m3fn", 9, 2.0, True, 2),
]


@pytest.mark.parametrize(("dtype", "window", "cap", "use_sinks", "splits"), DECODE_CASES)
def test_decode_features_match_reference(
    dtype: str, window: int, cap: float, use_sinks: bool, splits: int | None
) -> None:
    """Two sequences of 37 and 11 tokens over 4-token pages; with a window the pages
    entirely before it are released (table entries -1, pages NaN) and never read."""
    seq_lens, page_size = [37, 11], 4
    released = [max(0, n - 1 - window) // page_size for n in seq_lens] if window >= 0 else None
    k_scale, v_scale = (0.5, 0.25) if dtype in FP8 else (1.0, 1.0)
    paged = build(
        seq_lens,
        page_size=page_size,
        kv_heads=2,
        head_dim=24,
        dtype=dtype,
        seed=len(dtype) + window,
        k_scale=k_scale,
        v_scale=v_scale,
        released=released,
    )
    gen = torch.Generator().manual_seed(9)
    query = torch.randn(2, 6, 24, generator=gen).to(query_dtype(dtype))
    sinks = torch.randn(6, generator=gen) * 2 if use_sinks else None
    out = triton_decode.decode(
        query.to(DEVICE),
        paged.kv_cache,
        paged.block_table,
        paged.seq_lens,
        0.3,
        interpreted=INTERPRETED,
        num_splits=splits,
        window_left=window,
        soft_cap=cap,
        sinks=None if sinks is None else sinks.to(DEVICE),
        k_scale=k_scale,
        v_scale=v_scale,
    )
    assert out.dtype == query.dtype and out.shape == query.shape
    for b in range(2):
        q, key, value = query[b : b + 1], paged.key[b], paged.value[b]
        ref = reference(q, key, value, 0.3, window_left=window, soft_cap=cap, sinks=sinks)
        assert_close(out[b : b + 1], ref, q, key, value, 0.3)


@pytest.mark.parametrize(
    ("dtype", "head_dim", "v_head_dim", "heads", "splits"),
    [("bfloat16", 40, 32, 20, 2), ("float8_e4m3fn", 40, 32, 4, None), ("float16", 576, 512, 16, 1)],
)
def test_mla_decode_over_a_latent_cache_matches_reference(
    dtype: str, head_dim: int, v_head_dim: int, heads: int, splits: int | None
) -> None:
    """K is the whole latent vector, V its first v_head_dim elements; every query head on
    the one latent head (20 heads: two head blocks of 16, the second part padding);
    D = 40 and DeepSeek's 576 = 512 + 64, neither a power of two."""
    k_scale = 0.5 if dtype in FP8 else 1.0
    paged = build(
        [19, 6],
        page_size=8,
        kv_heads=1,
        head_dim=head_dim,
        dtype=dtype,
        seed=head_dim,
        v_head_dim=v_head_dim,
        k_scale=k_scale,
    )
    gen = torch.Generator().manual_seed(4)
    query = torch.randn(2, heads, head_dim, generator=gen).to(query_dtype(dtype))
    out = triton_decode.decode(
        query.to(DEVICE),
        paged.kv_cache,
        paged.block_table,
        paged.seq_lens,
        head_dim**-0.5,
        interpreted=INTERPRETED,
        num_splits=splits,
        v_head_dim=v_head_dim,
        k_scale=k_scale,
        v_scale=k_scale,  # one vector: V is K's first elements, one scale
    )
    assert out.shape == (2, heads, v_head_dim)
    for b in range(2):
        q, key, value = query[b : b + 1], paged.key[b], paged.value[b]
        ref = reference(q, key, value, head_dim**-0.5)
        assert_close(out[b : b + 1], ref, q, key, value, head_dim**-0.5)


# -- prefill -----------------------------------------------------------------------------

PREFILL_CASES = [  # (dtype, window_left, soft_cap, sinks)
    ("float8_e4m3fn", -1, 0.0, False),
    ("bfloat16", 6, 0.0, False),
    ("float32", -1, 1.5, False),
    ("float16", -1, 0.0, True),
    ("float8_e5m2", 3, 2.5, True),
]


@pytest.mark.parametrize(("dtype", "window", "cap", "use_sinks"), PREFILL_CASES)
def test_prefill_features_match_reference(
    dtype: str, window: int, cap: float, use_sinks: bool
) -> None:
    """Queries of 9 and 13 tokens after cached prefixes (30 and 13 tokens in all); with a
    window the pages before the first query's window are released."""
    seq_lens, q_lens, page_size = [30, 13], [9, 13], 4
    released = None
    if window >= 0:
        released = [
            max(0, n - q - window) // page_size for n, q in zip(seq_lens, q_lens, strict=True)
        ]
    k_scale, v_scale = (2.0, 0.5) if dtype in FP8 else (1.0, 1.0)
    paged = build(
        seq_lens,
        page_size=page_size,
        kv_heads=2,
        head_dim=16,
        dtype=dtype,
        seed=3 + window,
        k_scale=k_scale,
        v_scale=v_scale,
        released=released,
    )
    gen = torch.Generator().manual_seed(5)
    query = torch.randn(sum(q_lens), 4, 16, generator=gen).to(query_dtype(dtype))
    sinks = torch.randn(4, generator=gen) if use_sinks else None
    cu = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=I32)
    out = triton_prefill.prefill(
        query.to(DEVICE),
        paged.kv_cache,
        paged.block_table,
        cu.to(DEVICE),
        paged.seq_lens,
        0.25,
        max_q_len=max(q_lens),
        interpreted=INTERPRETED,
        window_left=window,
        soft_cap=cap,
        sinks=None if sinks is None else sinks.to(DEVICE),
        k_scale=k_scale,
        v_scale=v_scale,
    )
    for b in range(2):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        q, key, value = query[rows], paged.key[b], paged.value[b]
        ref = reference(q, key, value, 0.25, window_left=window, soft_cap=cap, sinks=sinks)
        assert_close(out[rows], ref, q, key, value, 0.25)


@pytest.mark.parametrize(("dtype", "heads"), [("bfloat16", 20), ("float8_e5m2", 3)])
def test_mla_prefill_over_a_latent_cache_matches_reference(dtype: str, heads: int) -> None:
    k_scale = 0.5 if dtype in FP8 else 1.0
    paged = build(
        [14, 5],
        page_size=4,
        kv_heads=1,
        head_dim=40,
        dtype=dtype,
        seed=8,
        v_head_dim=32,
        k_scale=k_scale,
    )
    gen = torch.Generator().manual_seed(6)
    q_lens = [6, 5]
    query = torch.randn(11, heads, 40, generator=gen).to(query_dtype(dtype))
    cu = torch.tensor([0, 6, 11], dtype=I32)
    out = triton_prefill.prefill(
        query.to(DEVICE),
        paged.kv_cache,
        paged.block_table,
        cu.to(DEVICE),
        paged.seq_lens,
        40**-0.5,
        max_q_len=max(q_lens),
        interpreted=INTERPRETED,
        v_head_dim=32,
        k_scale=k_scale,
        v_scale=k_scale,
    )
    assert out.shape == (11, heads, 32)
    for b in range(2):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        q, key, value = query[rows], paged.key[b], paged.value[b]
        ref = reference(q, key, value, 40**-0.5)
        assert_close(out[rows], ref, q, key, value, 40**-0.5)


def test_soft_cap_saturates_without_overflow() -> None:
    """Logits far beyond the cap (|scale q.k| ~ 1e4) give cap * +-1, not NaN: the
    query's largest logit wins by exactly exp(0) vs exp(cap * tanh(..)) of the rest."""
    paged = build([3], page_size=4, kv_heads=1, head_dim=16, dtype="float32", seed=1)
    query = torch.full((1, 1, 16), 300.0)
    out = triton_decode.decode(
        query.to(DEVICE),
        paged.kv_cache,
        paged.block_table,
        paged.seq_lens,
        1.0,
        interpreted=INTERPRETED,
        soft_cap=5.0,
    )
    key, value = paged.key[0], paged.value[0]
    ref = reference(query, key, value, 1.0, soft_cap=5.0)
    assert out.isfinite().all()
    assert_close(out, ref, query, key, value, 1.0)
    assert math.isfinite(float(ref.sum()))


# -- through TritonBackend: plan options, run keywords, released pages --------------------


def test_backend_plans_every_feature_and_runs_them_on_a_latent_fp8_cache() -> None:
    """MLA on an fp8 latent cache with a window, a soft cap and sinks, all through the
    backend: write_kv(latent, None, k_scale=), the plans' Attention, table entries
    before every window at -1 (not validated, not read), decode and prefill."""
    from kvcore_triton import TritonBackend

    from kvcore.backend import Attention

    backend = TritonBackend()
    gen = torch.Generator().manual_seed(11)
    page_size, n, d, dv, heads, k_scale = 4, 23, 40, 32, 5, 0.5
    cache = torch.full((8, 1, page_size, 1, d), float("nan")).to(torch.float8_e4m3fn)
    cache = cache.to(DEVICE)
    pages = torch.tensor([6, 2, 0, 5, 1, 3], dtype=I32)
    latent = torch.randn(n, 1, d, generator=gen).to(torch.bfloat16)
    slots = (pages.long().repeat_interleave(page_size)[:n] * page_size) + torch.arange(n) % 4
    backend.write_kv(
        backend.plan_write(cache, slots.to(DEVICE)), cache, latent.to(DEVICE), None, k_scale=k_scale
    )
    key = quantize(latent, torch.float8_e4m3fn, k_scale).float() * k_scale
    attention = Attention(window_left=6, logits_soft_cap=3.0, sinks=True, v_head_dim=dv)
    sinks = torch.randn(heads, generator=gen)
    q_len = 4
    table = pages[None].clone()
    table[0, : (n - q_len - 6) // page_size] = -1  # released before the first query's window
    table, lens = table.to(DEVICE), torch.tensor([n], dtype=I32, device=DEVICE)
    cu = torch.tensor([0, q_len], dtype=I32, device=DEVICE)
    decode_plan = backend.plan_decode(cache, table, lens, attention=attention)
    prefill_plan = backend.plan_prefill(cache, table, cu, lens, attention=attention)
    for rows in (1, q_len):
        query = torch.randn(rows, heads, d, generator=gen).to(torch.bfloat16)
        q, s_h = query.to(DEVICE), sinks.to(DEVICE)
        if rows == 1:
            out = backend.decode(decode_plan, q, cache, 0.2, k_scale=k_scale, sinks=s_h)
        else:
            out = backend.prefill(prefill_plan, q, cache, 0.2, k_scale=k_scale, sinks=s_h)
        assert out.shape == (rows, heads, dv) and out.dtype == torch.bfloat16
        ref = reference(query, key, key[..., :dv], 0.2, window_left=6, soft_cap=3.0, sinks=sinks)
        assert_close(out, ref, query, key, key[..., :dv], 0.2)
