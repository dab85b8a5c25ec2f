"""kvcore_cupy's attention features (kvcore.backend.Attention options, fp8 caches),
run on the CPU through tests/cupy_emulation (the same .cu sources, compiled by g++)
and held to kvcore_torch, the reference, through the public plan/run API.

Per feature: decode (several splits: the emulated backend plans short splits) and
prefill over a cached prefix, and the fp8 paths (quantization bit-exact against
kvcore_torch.quantize, every fp8 byte decoded exactly); MLA refused by name.
A window's released pages hold -1 in the block table and NaN in the cache, so a
kernel that read either would fail. Shapes stay small: the emulation runs every
CUDA thread as a fiber.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from kvcore_cupy import kernels
from kvcore_torch import TorchBackend, quantize

from kvcore.backend import Attention, Backend
from kvcore.errors import Unsupported
from kvcore.layout import cdiv
from kvcore.testing import tolerance
from kvcore.testing.kernel_cases import operands

pytestmark = [
    pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found (emulation)"),
    pytest.mark.numeric,  # rerun by CI as other CPUs (.ci/run)
]

I32, I64 = torch.int32, torch.int64
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _emulated() -> Backend:
    from cupy_emulation import EmulatedCupyBackend

    return EmulatedCupyBackend()


def test_declared_features() -> None:
    from kvcore_cupy import CupyBackend

    caps = CupyBackend.capabilities
    assert caps.features == frozenset({"fp8", "window", "soft_cap", "sinks"})
    assert {"float8_e4m3fn", "float8_e5m2"} <= caps.dtypes
    assert set(kernels.C_TYPES) >= kernels.FP8_DTYPES


class Paged:
    """A NaN-poisoned paged cache holding ``lens`` tokens per sequence on shuffled pages.

    ``window`` >= 0: each sequence's pages before its first query's window (``q_lens``
    queries) are released: -1 in the block table, their cache pages left NaN.
    """

    def __init__(
        self,
        lens: list[int],
        q_lens: list[int],
        *,
        page_size: int,
        hkv: int,
        d: int,
        dtype: torch.dtype,
        window: int = -1,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        need = [cdiv(n, page_size) for n in lens]
        num_pages = sum(need) + 2
        byte = torch.uint8 if dtype in FP8 else dtype
        fill = 0x7F if dtype in FP8 else float("nan")  # 0x7f: NaN in both fp8 formats
        self.cache = torch.full((num_pages, 2, page_size, hkv, d), fill, dtype=byte)
        self.cache = self.cache.view(dtype)
        self.table = torch.full((len(lens), max(need)), 12345, dtype=I32)  # padding: garbage
        order = torch.randperm(num_pages, generator=gen).tolist()
        at = 0
        for b, (n, q_len, p) in enumerate(zip(lens, q_lens, need, strict=True)):
            first = max(0, n - q_len - window) // page_size if window >= 0 else 0
            kv = torch.randn(2, p * page_size, hkv, d, generator=gen) * 2
            for j in range(p):
                if j < first:  # released: never read, not even its table entry
                    self.table[b, j] = -1
                    continue
                page = order[at]
                at += 1
                self.table[b, j] = page
                lo, hi = j * page_size, min((j + 1) * page_size, n)
                rows = kv[:, lo:hi]
                if dtype in FP8:
                    scales = torch.tensor([k_scale, v_scale]).view(2, 1, 1, 1)
                    self.cache[page, :, : hi - lo] = (rows / scales).to(dtype)
                else:
                    self.cache[page, :, : hi - lo] = rows.to(dtype)
        self.seq_lens = torch.tensor(lens, dtype=I32)
        self.cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=I32)


CASES = [
    # (cache dtype, query dtype, attention, hq, hkv, page size)
    (torch.bfloat16, torch.bfloat16, Attention(window_left=9), 8, 2, 4),
    (torch.float32, torch.float32, Attention(window_left=0), 4, 4, 3),
    (torch.bfloat16, torch.bfloat16, Attention(logits_soft_cap=5.0), 8, 2, 16),
    (torch.float32, torch.float32, Attention(sinks=True), 12, 1, 5),
    (torch.float8_e4m3fn, torch.bfloat16, Attention(), 8, 2, 8),
    (torch.float8_e5m2, torch.float32, Attention(), 4, 1, 16),
    # everything at once (gpt-oss / Gemma-2-like options on an fp8 cache)
    (
        torch.float8_e4m3fn,
        torch.float32,
        Attention(window_left=21, logits_soft_cap=30.0, sinks=True),
        8,
        2,
        4,
    ),
]


@pytest.mark.parametrize(("dtype", "qdtype", "attention", "hq", "hkv", "page_size"), CASES)
def test_features_match_the_reference(
    dtype: torch.dtype,
    qdtype: torch.dtype,
    attention: Attention,
    hq: int,
    hkv: int,
    page_size: int,
) -> None:
    """Decode (several splits, windows inside and across them) and prefill (ragged
    q_lens over cached prefixes) against kvcore_torch with the same options."""
    backend, oracle = _emulated(), TorchBackend()
    d = 64
    lens, q_lens = [1, 13, 40, 77], [1, 5, 1, 30]
    fp8 = dtype in FP8
    k_scale, v_scale = (0.5, 3.0) if fp8 else (1.0, 1.0)
    gen = torch.Generator().manual_seed(hq * 31 + page_size)
    sinks = torch.randn(hq, generator=gen) * 2 if attention.sinks else None
    scales = {"k_scale": k_scale, "v_scale": v_scale} if fp8 else {}
    scale = d**-0.5

    def close(got: torch.Tensor, want: torch.Tensor, query: torch.Tensor, pages: Paged) -> None:
        """tolerance.attention's bound: both read the same query and stored (fp8:
        dequantized in fp32) K/V; the order of the sums and the CUDA kernels' dot operands
        (kernel_cases.operands: a 16-bit query's P) differ."""
        key, value = tolerance.cache_parts(pages.cache, k_scale=k_scale, v_scale=v_scale)
        ops = operands("cupy", "cuda", tolerance.format_name(qdtype))
        bound = tolerance.attention(query, key, value, scale, keys=max(lens), operands=ops)
        tolerance.assert_close(got, want, bound, "the CUDA kernels vs kvcore_torch")

    # decode: one query per sequence (the window counts from its last token)
    dec = Paged(lens, [1] * 4, page_size=page_size, hkv=hkv, d=d, dtype=dtype,
                window=attention.window_left, k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    q = torch.randn(len(lens), hq, d, generator=gen).to(qdtype)
    got, want = (
        b.decode(
            b.plan_decode(dec.cache, dec.table, dec.seq_lens, attention=attention),
            q, dec.cache, scale, sinks=sinks, **scales,
        )
        for b in (backend, oracle)
    )  # fmt: skip
    assert got.dtype == qdtype and got.shape == q.shape
    assert not got.isnan().any()
    close(got, want, q, dec)

    pre = Paged(lens, q_lens, page_size=page_size, hkv=hkv, d=d, dtype=dtype,
                window=attention.window_left, k_scale=k_scale, v_scale=v_scale, seed=1)  # fmt: skip
    qp = torch.randn(sum(q_lens), hq, d, generator=gen).to(qdtype)
    got, want = (
        b.prefill(
            b.plan_prefill(pre.cache, pre.table, pre.cu, pre.seq_lens, attention=attention),
            qp, pre.cache, scale, sinks=sinks, **scales,
        )
        for b in (backend, oracle)
    )  # fmt: skip
    assert got.dtype == qdtype and not got.isnan().any()
    close(got, want, qp, pre)


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_write_quantizes_like_the_reference(dtype: torch.dtype) -> None:
    """write_kv on an fp8 cache stores exactly kvcore_torch.quantize(x, dtype, scale):
    saturation (inf, beyond max), round to nearest even at every ties of normal and
    subnormal steps, signed zeros, NaN; from fp32 and bf16 keys."""
    backend = _emulated()
    gen = torch.Generator().manual_seed(7)
    fmax = torch.finfo(dtype).max
    # every fp8 value, and the midpoints between neighbours (ties), and random values
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    grid = grid[grid.isfinite()].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    edge = torch.tensor([0.0, -0.0, fmax * 1.01, -fmax * 3, float("inf"), -float("inf"),
                         float("nan"), 1e-30, -1e-12])  # fmt: skip
    values = torch.cat([grid, mids, edge, torch.randn(500, generator=gen) * fmax / 8])
    d = 64
    n = cdiv(values.numel(), d)
    values = torch.cat([values, torch.zeros(n * d - values.numel())])
    key = values.view(n, 1, d)
    value = -key.flip(0)
    cache = torch.zeros(cdiv(n, 4) + 1, 2, 4, 1, d, dtype=dtype)
    slots = torch.arange(n, dtype=I64) + 4  # from page 1 on
    for k_scale, v_scale, src in ((1.0, 1.0, torch.float32), (0.25, 8.0, torch.float32),
                                  (2.0, 0.5, torch.bfloat16)):  # fmt: skip
        k, v = key.to(src), value.to(src)
        cache.view(torch.uint8).fill_(0)
        backend.write_kv(backend.plan_write(cache, slots), cache, k, v,
                         k_scale=k_scale, v_scale=v_scale)  # fmt: skip
        flat = cache.view(torch.uint8)[1:].reshape(-1, 2, 4 * d)
        got_k = flat[:, 0].reshape(-1)[: n * d]
        got_v = flat[:, 1].reshape(-1)[: n * d]
        want_k = quantize(k, dtype, k_scale).view(torch.uint8).reshape(-1)
        want_v = quantize(v, dtype, v_scale).view(torch.uint8).reshape(-1)
        assert torch.equal(got_k, want_k), (k_scale, src)
        assert torch.equal(got_v, want_v), (v_scale, src)
        assert not cache.view(torch.uint8)[0].any()  # page 0 untouched


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_every_byte_decodes_exactly(dtype: torch.dtype) -> None:
    """A one-token sequence's decode output is its V row times v_scale: every one of the
    256 byte values (subnormals, max, NaN; e5m2's inf) comes out as torch's fp8 -> fp32."""
    backend = _emulated()
    d = 64
    cache = torch.zeros(4, 2, 1, 1, d, dtype=torch.uint8)
    cache[:, 1, 0, 0] = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(4, d)
    cache = cache.view(dtype)
    table = torch.arange(4, dtype=I32).view(4, 1)
    q = torch.randn(4, 1, d)
    out = backend.decode(
        backend.plan_decode(cache, table, torch.ones(4, dtype=I32)), q, cache, 0.1, v_scale=2.0
    )
    want = cache[:, 1, 0].float() * 2.0
    torch.testing.assert_close(out, want, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_mla_is_unsupported_by_name(dtype: torch.dtype) -> None:
    """Latent caches are refused in every plan, naming the feature and the backend
    (kvcore_cupy's docstring says why MLA does not fit these kernels)."""
    backend = _emulated()
    cache = torch.zeros(4, 1, 16, 1, 128, dtype=dtype)
    table, lens = torch.zeros(1, 1, dtype=I32), torch.ones(1, dtype=I32)
    match = r"'cupy-emulated' does not declare feature mla"
    with pytest.raises(Unsupported, match=match):
        backend.plan_decode(cache, table, lens, attention=Attention(v_head_dim=64))
    with pytest.raises(Unsupported, match=match):
        backend.plan_prefill(cache, table, torch.tensor([0, 1], dtype=I32), lens,
                             attention=Attention(v_head_dim=64))  # fmt: skip
    with pytest.raises(Unsupported, match=match):
        backend.plan_write(cache, torch.zeros(1, dtype=I64))
