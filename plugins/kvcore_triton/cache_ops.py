# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (Triton kernels: @triton.jit is untyped, and kernel arguments take no annotations.)
"""Cache writes: scatter new K/V into slots (write_kv) and copy whole pages (copy_pages).

Data movement: values are stored bit for bit in the cache's dtype (no fp32 round
trip is needed; a K/V of another float dtype is converted on store). fp8 caches
hold ``x / scale`` quantized as vLLM does: saturated to the format's largest
finite value (448 for float8_e4m3fn, 57344 for float8_e5m2), rounded to nearest
even (:func:`_round_fp8`, exact in the interpreter too, whose fp32 -> fp8 cast
rounds ties away and carries no mantissa overflow into the exponent). A latent
cache (MLA, one part) takes one vector per token and no value.

* ``_write_kv_kernel``, grid ``(T,)``: token t writes its ``[Hkv, D]`` key and
  value rows to page ``slot // PAGE_SIZE``, offset ``slot % PAGE_SIZE``; a
  negative slot writes nothing (its address is clamped to slot 0 and the store
  masked off, so no out-of-range address is ever formed).
* ``_copy_pages_kernel``, grid ``(N, parts, PAGE_SIZE)``: program (i, kv, t) copies
  the ``[Hkv, D]`` row of part kv (K or V; the latent vector) at offset t of page ``src[i]`` to page
  ``dst[i]``. dst pages are distinct and disjoint from src (copy-on-write
  gives fresh pages), so programs never race.

Both tiles are ``[BLOCK_H, BLOCK_D]`` (next powers of two of Hkv and D),
masked to ``[Hkv, HEAD_DIM]``; with HEAD_DIM a constexpr the rows move in
16-byte vectors. Offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_FORMATS = {  # torch dtype name: (largest finite value, mantissa bits, least normal exponent)
    "float8_e4m3fn": (448.0, 3, -6),
    "float8_e5m2": (57344.0, 2, -14),
}


@triton.jit
def _round_fp8(x, FP8_MAX: tl.constexpr, MANTISSA: tl.constexpr, EXP_MIN: tl.constexpr):
    """fp32 ``x`` saturated to +-FP8_MAX and rounded to nearest even on the fp8 grid
    (``MANTISSA`` bits, normal exponents >= ``EXP_MIN``, subnormals below): an fp32
    value the fp8 format holds exactly, so any later cast to it is exact."""
    x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
    bits = x.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, EXP_MIN)  # of |x|; subnormals: EXP_MIN
    # The fp8 spacing at |x| and its inverse: powers of two, so both products are exact.
    ulp = ((exponent - MANTISSA + 127) << 23).to(tl.float32, bitcast=True)
    inv_ulp = ((127 - exponent + MANTISSA) << 23).to(tl.float32, bitcast=True)
    steps = tl.abs(x) * inv_ulp  # < 2^(MANTISSA + 1)
    steps = (steps + 8388608.0) - 8388608.0  # round to nearest even: fp32 addition at 2^23
    return tl.where(bits < 0, -(steps * ulp), steps * ulp)  # bits < 0: the sign, -0 included


@triton.jit
def _write_kv_kernel(
    kv_ptr,  # [num_pages, 2 (1: latent), PAGE_SIZE, Hkv, D] cache, last dim contiguous
    key_ptr,  # [T, Hkv, D] (latent: the latent vectors)
    value_ptr,  # [T, Hkv, D] (HAS_VALUE only)
    slots_ptr,  # [T] int64: page * PAGE_SIZE + offset; < 0 means skip
    num_kv_heads,
    k_scale,  # fp32: fp8 caches hold key / k_scale (FP8_MAX > 0 only)
    v_scale,  # fp32: and value / v_scale
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_kv_page,
    stride_kv_kv,
    stride_kv_tok,
    stride_kv_head,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_VALUE: tl.constexpr,  # False: a latent cache, part 0 only
    FP8_MAX: tl.constexpr,  # 0.0: not an fp8 cache; else FP8_FORMATS' figures
    MANTISSA: tl.constexpr,
    EXP_MIN: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    # A skipped token masks every head: comparing against a head count of 0 (rather
    # than and-ing a scalar into the mask, which the interpreter mistypes as int32).
    heads_kept = tl.where(slot >= 0, num_kv_heads, 0)
    slot = tl.where(slot >= 0, slot, 0)
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < heads_kept) & (offs_d[None, :] < HEAD_DIM)
    heads = offs_h.to(tl.int64)[:, None]

    key = tl.load(key_ptr + t * stride_key_t + heads * stride_key_h + offs_d[None, :], mask=mask)
    if FP8_MAX > 0:  # x / scale in fp32 with IEEE division (as the torch reference), rounded
        key = tl.math.fdiv(key.to(tl.float32), k_scale, ieee_rounding=True)
        key = _round_fp8(key, FP8_MAX, MANTISSA, EXP_MIN)
    dst = kv_ptr + page * stride_kv_page + offset * stride_kv_tok + heads * stride_kv_head
    elem = kv_ptr.dtype.element_ty
    tl.store(dst + offs_d[None, :], key.to(elem), mask=mask)
    if HAS_VALUE:
        value = tl.load(
            value_ptr + t * stride_value_t + heads * stride_value_h + offs_d[None, :], mask=mask
        )
        if FP8_MAX > 0:
            value = tl.math.fdiv(value.to(tl.float32), v_scale, ieee_rounding=True)
            value = _round_fp8(value, FP8_MAX, MANTISSA, EXP_MIN)
        tl.store(dst + stride_kv_kv + offs_d[None, :], value.to(elem), mask=mask)


@triton.jit
def _copy_pages_kernel(
    kv_ptr,  # [num_pages, parts, PAGE_SIZE, Hkv, D] cache, last dim contiguous
    src_ptr,  # [N] int64 source pages
    dst_ptr,  # [N] int64 destination pages
    num_kv_heads,
    stride_kv_page,
    stride_kv_kv,
    stride_kv_tok,
    stride_kv_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i = tl.program_id(0)
    kv = tl.program_id(1).to(tl.int64)
    tok = tl.program_id(2).to(tl.int64)
    src_page = tl.load(src_ptr + i).to(tl.int64)
    dst_page = tl.load(dst_ptr + i).to(tl.int64)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < HEAD_DIM)
    row = kv * stride_kv_kv + tok * stride_kv_tok
    offs = row + offs_h.to(tl.int64)[:, None] * stride_kv_head + offs_d[None, :]
    data = tl.load(kv_ptr + src_page * stride_kv_page + offs, mask=mask)
    tl.store(kv_ptr + dst_page * stride_kv_page + offs, data, mask=mask)


def _unit_last_dim(t: torch.Tensor) -> bool:
    """The kernels index the last dim with unit stride (any stride is fine for size 1)."""
    return t.shape[-1] == 1 or t.stride(-1) == 1


def _tile(num_kv_heads: int, head_dim: int) -> tuple[int, int]:
    return triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(head_dim)


def write_kv(
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor | None,
    slots: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Scatter key/value [T, Hkv, D] into ``slots`` [T] (int64, tokens); slot < 0 skipped.
    A latent cache (one part) takes its vectors as ``key`` and ``value`` None. An fp8
    cache gets ``key / k_scale`` and ``value / v_scale``, saturated and rounded.

    Validated by the caller: every non-negative slot < num_pages * page_size,
    distinct non-negative slots, last dims contiguous.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert (value is None) == (kv_cache.shape[1] == 1), "a value exactly for two-part caches"
    rows = (key, kv_cache) if value is None else (key, value, kv_cache)
    assert all(_unit_last_dim(t) for t in rows), "last dims must be contiguous"
    block_h, block_d = _tile(num_kv_heads, head_dim)
    fp8_max, mantissa, exp_min = FP8_FORMATS.get(
        str(kv_cache.dtype).removeprefix("torch."), (0, 0, 0)
    )
    value = key if value is None else value  # never read without a value
    _write_kv_kernel[(num_tokens,)](
        kv_cache,
        key,
        value,
        slots.to(torch.int64),
        num_kv_heads,
        k_scale,
        v_scale,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        PAGE_SIZE=kv_cache.shape[2],
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        HAS_VALUE=kv_cache.shape[1] == 2,
        FP8_MAX=float(fp8_max),
        MANTISSA=mantissa,
        EXP_MIN=exp_min,
        num_warps=4,
    )


def copy_pages(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy page ``src[i]`` to page ``dst[i]`` (every part and slot) for each i.

    Validated by the caller: pages in range, ``dst`` distinct and disjoint from ``src``.
    """
    num_copies = src.shape[0]
    if num_copies == 0:
        return
    assert _unit_last_dim(kv_cache), "last dim must be contiguous"
    _, parts, page_size, num_kv_heads, head_dim = kv_cache.shape
    block_h, block_d = _tile(num_kv_heads, head_dim)
    _copy_pages_kernel[(num_copies, parts, page_size)](
        kv_cache,
        src.to(torch.int64),
        dst.to(torch.int64),
        num_kv_heads,
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4,
    )
