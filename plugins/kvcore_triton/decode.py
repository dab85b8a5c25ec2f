# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (Triton kernels: @triton.jit is untyped, and kernel arguments take no annotations.)
"""Paged decode with split-KV (flash-decoding), GQA heads packed into one ``tl.dot`` tile.

One query token per sequence attends that sequence's ``seq_lens[b]`` cached
tokens. Two kernels:

1. ``_decode_split_kernel``, grid ``(B, Hkv, num_splits)``: program (b, g, s)
   takes the ``QUERY_GROUP = Hq / Hkv`` query heads that share KV head g as
   the rows of one tile ``Q [BLOCK_H, BLOCK_D]`` (rows >= QUERY_GROUP are
   zero padding; ``BLOCK_H >= 16`` because ``tl.dot`` needs M >= 16) and runs
   an online softmax over tokens ``[s * tokens_per_split, (s + 1) *
   tokens_per_split) ∩ [0, seq_len)`` in blocks of ``BLOCK_N`` tokens::

       S   = Q Kᵀ          [BLOCK_H, BLOCK_D] x [BLOCK_D, BLOCK_N]   (scores, log2 units)
       m_i = running row max,  l_i = running Σ 2^(S - m_i),  acc = Σ 2^(S - m_i) V

   It writes the split's normalised output ``acc / l_i`` and its log-sum-exp
   ``m_i + log2(l_i)`` (base 2) to fp32 scratch; an empty split writes
   ``lse = -inf`` and a zero output.
2. ``_decode_merge_kernel``, grid ``(B, Hq)``: ``out = Σ_s 2^(lse_s - M) o_s
   / Σ_s 2^(lse_s - M)`` with ``M = max_s lse_s``.

Tokens are found through the block table as :mod:`~kvcore_triton.paged` says
(any page size; only tokens < seq_len are loaded, so unused slots of a page,
possibly NaN, and unused block-table entries never matter). Offsets are
int64; block tables int32; everything loaded is converted to fp32 at once
(the interpreter's bf16 arithmetic is wrong, and fp32 accumulation is what we
want on a GPU too). Scores are pre-scaled by ``scale * log2(e)`` so the
softmax uses ``exp2``.

Launch choices (for an H100/H200-class GPU, 132 SMs; decode is bound by
reading K and V once, so every choice serves memory bandwidth):

* ``PAGE_SIZE`` and ``HEAD_DIM`` are constexprs: ``t // PAGE_SIZE`` becomes a
  shift or a multiply-high, and the D mask ``d < HEAD_DIM`` has known
  constancy, so a row of K (HEAD_DIM contiguous elements) is read with 16-byte
  vector loads even when HEAD_DIM (80, 96) is not a power of two (the PTX
  check in tests/test_triton_compile.py holds it to that).
* ``BLOCK_N x BLOCK_D = 4096`` elements per K/V tile (BLOCK_N 64 at D <= 64,
  32 at D 80..128, 16 at D 256): a multiple or a divisor of every power-of-two
  page size, so a block reads whole pages.
* Page ids are loaded one block ahead of the K/V they address
  (:func:`kvcore_triton.paged.block_rows`), so the K/V loads of block i+1
  depend only on values of iteration i and Triton's software pipeliner
  double-buffers them in shared memory (cp.async) while block i computes. ``num_stages = 3`` (id load, K/V load, compute) gives two
  K/V buffers; with the id load in the same iteration as its K/V loads the
  buffer count stays 1 at any num_stages. Compiled for sm_90 (bf16, D=128,
  group 4, 4 warps; tests/test_triton_compile.py asserts these): 78
  registers, no spills, 43 KB of shared memory, 2 buffers (before the
  look-ahead: 72 registers, 27 KB, 1 buffer).
* ``num_splits``: the grid aims at ``CTAS_PER_SM = 5`` resident programs per
  SM (at 78 registers x 128 threads, 6 fit by registers; at 43 KB + 1 KB
  reserved, 5 by the 228 KB of shared memory; the compile test holds the
  16-bit configurations to it; 4 at D=256, 96 registers and 50 KB; fp32
  caches fit 3 and simply run more waves). The smallest split count that
  fills one wave, ``ceil(5 * SMs / (B * Hkv))``, is raised (up to twice) when that
  makes the last wave fuller; never more splits than token blocks nor than
  ``MAX_SPLITS``. At B=64, Hkv=8 on 132 SMs that is 2 splits of 2048 tokens
  (1024 CTAs over 660 slots); at B=1 it is up to 64 splits, which keeps a
  single long sequence from running on 8 SMs. The split size comes from
  ``block_table.shape[1] * page_size`` (an upper bound of seq_len) or from the
  plan's host lengths, so the launch reads no device value.
* ``num_warps = 4`` (8 warps would halve the CTAs per SM for the same bytes in
  flight).
* The merge reads ``num_splits x D`` fp32 per head, a few percent of the KV
  bytes at the split counts above.

Under ``TRITON_INTERPRET=1`` (CPU) the plan uses 16-token blocks and a small
virtual SM count, so that small test shapes still run several splits.

``_decode_split_kernel`` is one body of about 90 lines on purpose: it reads
top-down as the math above (load the query tile, the online softmax over the
blocks, the normalised store), its state ``m_i``, ``l_i``, ``acc`` carried
through one loop; the paging it shares with prefill is already
:func:`kvcore_triton.paged.block_rows`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvcore.layout import cdiv
from kvcore_triton import paged

LOG2_E = 1.4426950408889634
MAX_SPLITS = 64  # bounds the merge tile (BLOCK_S) and the scratch buffer
CTAS_PER_SM = 5  # resident split CTAs per SM, 16-bit caches (shared-memory bound)
CTAS_PER_SM_D256 = 4  # the same at BLOCK_D = 256 (50 KB of shared memory)
NUM_STAGES = 3  # page-id load, K/V load, compute: two K/V buffers in flight
TILE_ELEMENTS = 4096  # BLOCK_N * BLOCK_D: fp32 K and V tiles without register spills
INTERPRETER_SMS = 2  # virtual SMs under TRITON_INTERPRET (programs run one by one anyway)


@triton.jit
def _decode_split_kernel(
    q_ptr,  # [B, Hq, D] query, any float dtype
    kv_ptr,  # [num_pages, 2, PAGE_SIZE, Hkv, D] cache, last dim contiguous
    block_table_ptr,  # [B, max_pages] int32
    seq_lens_ptr,  # [B] int32, tokens
    part_out_ptr,  # [B, Hq, num_splits, HEAD_DIM] fp32 scratch, contiguous
    part_lse_ptr,  # [B, Hq, num_splits] fp32 scratch (base-2 log-sum-exp), contiguous
    qk_scale,  # fp32: softmax scale * log2(e)
    stride_qb,
    stride_qh,
    stride_kv_page,
    stride_kv_kv,
    stride_kv_tok,
    stride_kv_head,
    stride_bt_b,
    tokens_per_split,  # tokens, a multiple of BLOCK_N
    num_splits,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM (and >= 16)
    QUERY_GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_H: tl.constexpr,  # next power of two >= QUERY_GROUP (and >= 16)
    BLOCK_N: tl.constexpr,  # tokens per iteration
):
    tl.static_assert(BLOCK_D >= HEAD_DIM)
    tl.static_assert(BLOCK_H >= QUERY_GROUP)
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_q_heads = tl.num_programs(1) * QUERY_GROUP

    seq_len = tl.load(seq_lens_ptr + b)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_h = offs_h < QUERY_GROUP
    mask_d = offs_d < HEAD_DIM
    q_head = (kv_head * QUERY_GROUP + offs_h).to(tl.int64)

    q_ptrs = q_ptr + b.to(tl.int64) * stride_qb + q_head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_h[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
    q = q * qk_scale

    # A finite floor instead of -inf keeps (m_i - m_new) free of inf - inf.
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)

    k_base = kv_ptr + kv_head.to(tl.int64) * stride_kv_head
    v_base = k_base + stride_kv_kv
    bt_row = block_table_ptr + b.to(tl.int64) * stride_bt_b
    # Page ids run one block ahead of their K/V (paged.py): the first block's here,
    # each next block's in block_rows. (Through paged.page_ids, this load cost 2
    # registers at D=64 with int64 strides.)
    page = tl.load(bt_row + (start + offs_n) // PAGE_SIZE, mask=start + offs_n < end, other=0)
    for t0 in range(start, end, BLOCK_N):
        tok = t0 + offs_n
        mask_n = tok < end
        kv_offs, page = paged.block_rows(
            bt_row, page, tok, end, offs_d, stride_kv_page, stride_kv_tok, PAGE_SIZE, BLOCK_N
        )
        mask_nd = mask_n[:, None] & mask_d[None, :]

        k = tl.load(k_base + kv_offs, mask=mask_nd, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k))  # [BLOCK_H, BLOCK_N], log2 units
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)  # rescales what was summed under the old max
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        v = tl.load(v_base + kv_offs, mask=mask_nd, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new

    # Empty split (start >= end): l_i == 0 -> lse = -inf, output 0; the merge weighs it 0.
    nonempty = l_i > 0.0
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    o = tl.where(nonempty[:, None], acc / tl.where(nonempty, l_i, 1.0)[:, None], 0.0)

    part_row = (b.to(tl.int64) * num_q_heads + q_head) * num_splits + split  # [BLOCK_H]
    tl.store(part_lse_ptr + part_row, lse, mask=mask_h)
    tl.store(
        part_out_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :],
        o,
        mask=mask_h[:, None] & mask_d[None, :],
    )


@triton.jit
def _decode_merge_kernel(
    part_out_ptr,  # [B, Hq, num_splits, HEAD_DIM] fp32
    part_lse_ptr,  # [B, Hq, num_splits] fp32, base 2
    out_ptr,  # [B, Hq, D] output, the query's dtype
    stride_ob,
    stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # next power of two >= num_splits
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    num_q_heads = tl.num_programs(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < HEAD_DIM

    part_row = (b.to(tl.int64) * num_q_heads + head) * num_splits + offs_s
    lse = tl.load(part_lse_ptr + part_row, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty (seq_len 0): weights 0
    w = tl.exp2(lse - m)  # [BLOCK_S]
    denom = tl.sum(w, 0)
    o = tl.load(
        part_out_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    acc = tl.sum(w[:, None] * o, 0)  # [BLOCK_D]
    out = acc / tl.where(denom > 0.0, denom, 1.0)
    out_ptrs = out_ptr + b.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh + offs_d
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_d)


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """Launch shape of one decode call; host-only arithmetic, no device sync."""

    page_size: int  # tokens per page (constexpr PAGE_SIZE)
    head_dim: int  # elements (constexpr HEAD_DIM)
    block_d: int  # next power of two >= head_dim, >= 16
    group: int  # query heads per KV head (constexpr QUERY_GROUP)
    block_h: int  # next power of two >= group, >= 16 (tl.dot needs M >= 16)
    block_n: int  # tokens per loop iteration
    num_splits: int  # splits per (sequence, KV head); 1..MAX_SPLITS
    tokens_per_split: int  # tokens, a multiple of block_n
    num_warps: int
    num_stages: int

    def split_constexprs(self) -> dict[str, int]:
        """The constexpr arguments of ``_decode_split_kernel``."""
        return {
            "PAGE_SIZE": self.page_size,
            "HEAD_DIM": self.head_dim,
            "BLOCK_D": self.block_d,
            "QUERY_GROUP": self.group,
            "BLOCK_H": self.block_h,
            "BLOCK_N": self.block_n,
        }

    def merge_constexprs(self) -> dict[str, int]:
        """The constexpr arguments of ``_decode_merge_kernel``."""
        return {
            "HEAD_DIM": self.head_dim,
            "BLOCK_D": self.block_d,
            "BLOCK_S": triton.next_power_of_2(self.num_splits),
        }


def plan_decode(
    *,
    batch: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    page_size: int,
    max_tokens: int,
    sm_count: int,
    interpreted: bool,
    num_splits: int | None = None,
) -> DecodePlan:
    """Choose tiles and the split count (the module docstring gives the reasons).

    ``max_tokens`` is an upper bound of every seq_len (max_pages * page_size,
    tokens); ``sm_count`` the device's multiprocessors; ``num_splits`` forces a
    split count (clamped to 1..MAX_SPLITS and to the number of token blocks).
    """
    block_d = max(16, triton.next_power_of_2(head_dim))
    # Interpreted: 16-token blocks, so tiny test shapes still run several splits.
    block_n = 16 if interpreted else max(16, min(64, TILE_ELEMENTS // block_d))
    blocks = max(1, cdiv(max_tokens, block_n))
    if num_splits is None:
        ctas_per_sm = CTAS_PER_SM_D256 if block_d >= 256 else CTAS_PER_SM
        num_splits = _fill_waves(batch * num_kv_heads, ctas_per_sm * sm_count)
    num_splits = max(1, min(num_splits, blocks, MAX_SPLITS))
    tokens_per_split = cdiv(blocks, num_splits) * block_n
    num_splits = max(1, cdiv(max_tokens, tokens_per_split))  # drop splits left empty
    return DecodePlan(
        page_size=page_size,
        head_dim=head_dim,
        block_d=block_d,
        group=group,
        block_h=max(16, triton.next_power_of_2(group)),
        block_n=block_n,
        num_splits=num_splits,
        tokens_per_split=tokens_per_split,
        num_warps=4,
        num_stages=NUM_STAGES,
    )


def _fill_waves(pairs: int, slots: int) -> int:
    """Splits per (sequence, KV head) for ``pairs`` of them on ``slots`` resident CTAs:
    the fewest that fill one wave, or up to twice that where the last wave is fuller
    (each split's work shrinks as the count grows, so a fuller last wave is time saved)."""
    least = cdiv(slots, max(1, pairs))

    def fill(splits: int) -> float:  # busy fraction of the slots over all waves
        ctas = pairs * splits
        return ctas / (cdiv(ctas, slots) * slots)

    return max(range(least, 2 * least + 1), key=lambda n: (round(fill(n), 3), -n))


SM_COUNTS: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in SM_COUNTS:
        SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return SM_COUNTS[index]


def decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    interpreted: bool,
    num_splits: int | None = None,
    max_tokens: int | None = None,
) -> torch.Tensor:
    """out [B, Hq, D] (query's dtype) = softmax(q Kᵀ * scale) V over each sequence's pages.

    ``num_splits`` forces the split count (the backend's plan chooses it once per
    step); ``max_tokens`` bounds every seq_len (tokens; default the table's width
    max_pages * page_size, which needs no device read).

    Inputs are validated by the caller: query [B, Hq, D], kv_cache
    [num_pages, 2, page_size, Hkv, D] with a contiguous last dim, block_table
    [B, max_pages] int32 with in-range pages, seq_lens [B] int32 with
    ``seq_lens[b] <= max_pages * page_size``; Hq a multiple of Hkv.

    Most of its length is the two launches' argument lists, one argument a line.
    """
    batch, num_q_heads, head_dim = query.shape
    _, _, page_size, num_kv_heads, _ = kv_cache.shape
    assert kv_cache.stride(4) == 1 or kv_cache.shape[4] == 1, "last dim must be contiguous"
    assert num_q_heads % num_kv_heads == 0, "Hq must be a multiple of Hkv"
    out = torch.empty(batch, num_q_heads, head_dim, dtype=query.dtype, device=query.device)
    if batch == 0:
        return out
    plan = plan_decode(
        batch=batch,
        num_kv_heads=num_kv_heads,
        group=num_q_heads // num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        max_tokens=block_table.shape[1] * page_size if max_tokens is None else max_tokens,
        sm_count=INTERPRETER_SMS if interpreted else sm_count(query.device),
        interpreted=interpreted,
        num_splits=num_splits,
    )
    part_out = torch.empty(
        batch, num_q_heads, plan.num_splits, head_dim, dtype=torch.float32, device=query.device
    )
    part_lse = torch.empty(
        batch, num_q_heads, plan.num_splits, dtype=torch.float32, device=query.device
    )
    _decode_split_kernel[(batch, num_kv_heads, plan.num_splits)](
        query,
        kv_cache,
        block_table,
        seq_lens,
        part_out,
        part_lse,
        scale * LOG2_E,
        query.stride(0),
        query.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_table.stride(0),
        plan.tokens_per_split,
        plan.num_splits,
        **plan.split_constexprs(),
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
    )
    _decode_merge_kernel[(batch, num_q_heads)](
        part_out,
        part_lse,
        out,
        out.stride(0),
        out.stride(1),
        plan.num_splits,
        **plan.merge_constexprs(),
        num_warps=4,
    )
    return out
