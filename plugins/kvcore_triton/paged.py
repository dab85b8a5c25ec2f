# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (Triton device functions: @triton.jit is untyped, and their arguments take no annotations.)
"""What decode.py and prefill.py share (``@triton.jit`` device functions, inlined into
each kernel by Triton): the paged-row walk, and the logit soft-cap.

Token t of sequence b lives in page ``block_table[b, t // PAGE_SIZE]`` at offset
``t % PAGE_SIZE``; each token's page is looked up on its own, so page sizes need
not be powers of two and K/V need not be contiguous across pages. Both kernels
walk a range of tokens in blocks of ``BLOCK_N``::

    page = tl.load(bt_row + (first + offs_n) // PAGE_SIZE, mask=first + offs_n < end, other=0)
    for t0 in range(first, end, BLOCK_N):
        tok = t0 + offs_n
        mask_n = tok < end
        row, page = paged.block_rows(bt_row, page, tok, end, ...)
        k = tl.load(k_base + row[:, None] + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :])

Page ids run one block ahead: block i's K/V addresses come from ids loaded in
iteration i - 1, so the K/V loads of block i + 1 depend only on values of
iteration i, and Triton's software pipeliner (``num_stages = 3``: id load, K/V
load, compute) double-buffers them in shared memory while block i computes.
With the id load in the same iteration as its K/V loads it keeps one buffer at
any num_stages; tests/test_triton_compile.py asserts the buffers of both kernels.

Offsets are int64 elements from the kv head's base (``kv_ptr + kv_head *
stride_kv_head``); the D dim is contiguous. A walk may start anywhere (a sliding
window starts at ``max(0, p - window_left)``): pages before its first token are
never looked up, so their block-table entries may hold anything (-1 included). Tokens >= ``end`` are masked out:
their page ids read as 0 and their K/V are never loaded, so unused block-table
entries and unused slots of a page (possibly NaN) never matter.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def page_ids(bt_row, tok, end, PAGE_SIZE: tl.constexpr):
    """The page ids (int32, shaped like ``tok``) of tokens ``tok`` from the sequence's
    block-table row ``bt_row``; 0 (never used) for tokens >= ``end``."""
    return tl.load(bt_row + tok // PAGE_SIZE, mask=tok < end, other=0)


@triton.jit
def block_rows(
    bt_row,  # the sequence's block-table row (int32 pointer)
    page,  # [BLOCK_N] int32: the page ids of ``tok``, loaded one iteration earlier
    tok,  # [BLOCK_N] token indices of this block
    end,  # tokens: the walk stops before it
    stride_kv_page,
    stride_kv_tok,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The block's row offsets ``row`` [BLOCK_N] (int64 elements from the kv head's base
    to element 0 of each token's K; V adds ``stride_kv_kv``; the caller adds its D
    offsets) and the next block's page ids, issued here, before the caller's K/V loads
    of this block, so that those of the next block wait on nothing of their own
    iteration."""
    row = page.to(tl.int64) * stride_kv_page + (tok % PAGE_SIZE).to(tl.int64) * stride_kv_tok
    next_page = page_ids(bt_row, tok + BLOCK_N, end, PAGE_SIZE)
    return row, next_page


@triton.jit
def soft_cap(s, cap_log2):
    """``cap * tanh(x)`` in log2 units (``cap_log2 = cap * log2(e)``) of ``s = x``, the
    scaled logits already divided by the cap. tanh through exp2, exactly +-1 for large
    |x| (exp(2x) clamped at 2^126 rather than overflowing, or underflowing to 0)."""
    e = tl.exp2(tl.minimum(s * 2.8853900817779268, 126.0))  # exp(2x); 2 * log2(e)
    return cap_log2 * (1.0 - 2.0 / (e + 1.0))
