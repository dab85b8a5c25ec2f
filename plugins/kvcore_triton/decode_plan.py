"""The launch shape of a split-KV decode (:mod:`~kvcore_triton.decode`): tiles, warps and
the split count, from host values only (no device read).

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
* MLA (a latent cache: V is the first ``v_head_dim`` elements of K, all query
  heads on one KV head): K is read as two pieces, ``HEAD_DIM = v_head_dim``
  (512, also V's tile) and ``ROPE_DIM = D - v_head_dim`` (64), so no tile is
  padded to 1024; the heads run in blocks of ``BLOCK_H = 16`` (the grid's head
  axis has ``cdiv(Hq, 16)`` blocks), 16-token blocks, 8 warps. At 512 + 64
  (bf16; tests/test_triton_compile.py builds it): 122 registers, no spills,
  75 KB of shared memory, two K buffers: ``MLA_CTAS_PER_SM = 2`` resident. The
  merge runs 8 warps at D = 512 (a [64, 512] fp32 tile is 255 registers at 4).
* A sliding window bounds the tokens a sequence reads to ``window_left + 1``:
  the split count is planned over that many.

Under ``TRITON_INTERPRET=1`` (CPU) the plan uses 16-token blocks and a small
virtual SM count, so that small test shapes still run several splits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from kvcore.layout import cdiv

MAX_SPLITS = 64  # bounds the merge tile (BLOCK_S) and the scratch buffer
CTAS_PER_SM = 5  # resident split CTAs per SM, 16-bit caches (shared-memory bound)
CTAS_PER_SM_D256 = 4  # the same at BLOCK_D = 256 (50 KB of shared memory)
NUM_STAGES = 3  # page-id load, K/V load, compute: two K/V buffers in flight
TILE_ELEMENTS = 4096  # BLOCK_N * BLOCK_D: fp32 K and V tiles without register spills
INTERPRETER_SMS = 2  # virtual SMs under TRITON_INTERPRET (programs run one by one anyway)
MLA_BLOCK_H = 16  # query heads per program on a latent cache (tl.dot's least M)
MLA_CTAS_PER_SM = 2  # the same at BLOCK_D = 512, 8 warps (register bound)


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """Launch shape of one decode call; host-only arithmetic, no device sync."""

    page_size: int  # tokens per page (constexpr PAGE_SIZE)
    head_dim: int  # elements of K's first piece, and of V and the output (HEAD_DIM)
    block_d: int  # next power of two >= head_dim, >= 16
    rope_dim: int  # elements of K's second piece (MLA's rope part; 0: none)
    block_r: int  # next power of two >= rope_dim, >= 16
    latent: bool  # V is K's first piece (MLA): no V load
    group: int  # query heads per KV head (constexpr QUERY_GROUP)
    block_h: int  # query heads per program: power of two >= 16 (tl.dot needs M >= 16)
    block_n: int  # tokens per loop iteration
    num_splits: int  # splits per (sequence, KV head); 1..MAX_SPLITS
    tokens_per_split: int  # tokens, a multiple of block_n
    num_warps: int
    num_stages: int
    merge_warps: int = 4
    window: bool = False  # a sliding window (window_left >= 0)
    soft_cap: bool = False  # logits soft-capped
    sinks: bool = False  # one sink logit per query head joins the merge's denominator

    @property
    def head_blocks(self) -> int:
        """Programs per KV head along the grid's head axis."""
        return cdiv(self.group, self.block_h)

    def split_constexprs(self) -> dict[str, int]:
        """The constexpr arguments of ``_decode_split_kernel``."""
        return {
            "PAGE_SIZE": self.page_size,
            "HEAD_DIM": self.head_dim,
            "BLOCK_D": self.block_d,
            "ROPE_DIM": self.rope_dim,
            "BLOCK_R": self.block_r,
            "LATENT": self.latent,
            "QUERY_GROUP": self.group,
            "BLOCK_H": self.block_h,
            "HEAD_BLOCKS": self.head_blocks,
            "BLOCK_N": self.block_n,
            "WINDOW": self.window,
            "SOFT_CAP": self.soft_cap,
        }

    def merge_constexprs(self) -> dict[str, int]:
        """The constexpr arguments of ``_decode_merge_kernel``."""
        return {
            "HEAD_DIM": self.head_dim,
            "BLOCK_D": self.block_d,
            "BLOCK_S": triton.next_power_of_2(self.num_splits),
            "SINKS": self.sinks,
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
    v_head_dim: int | None = None,
    window_left: int = -1,
    soft_cap: bool = False,
    sinks: bool = False,
) -> DecodePlan:
    """Choose tiles and the split count (the module docstring gives the reasons).

    ``head_dim`` is the cache's D (elements); ``v_head_dim`` (MLA, latent caches
    only) splits it into V's ``v_head_dim`` and a rope part. ``max_tokens`` is an
    upper bound of every seq_len (max_pages * page_size, tokens); ``sm_count`` the
    device's multiprocessors; ``num_splits`` forces a split count (clamped to
    1..MAX_SPLITS and to the number of token blocks).
    """
    latent = v_head_dim is not None
    main = head_dim if v_head_dim is None else v_head_dim
    rope = head_dim - main
    block_d = max(16, triton.next_power_of_2(main))
    if window_left >= 0:
        max_tokens = min(max_tokens, window_left + 1)
    # Interpreted: 16-token blocks, so tiny test shapes still run several splits.
    block_n = 16 if interpreted else max(16, min(64, TILE_ELEMENTS // block_d))
    blocks = max(1, cdiv(max_tokens, block_n))
    block_h = max(16, triton.next_power_of_2(group))
    if latent:
        block_h = MLA_BLOCK_H
    if num_splits is None:
        ctas_per_sm = CTAS_PER_SM_D256 if block_d >= 256 else CTAS_PER_SM
        ctas_per_sm = MLA_CTAS_PER_SM if latent else ctas_per_sm
        programs = batch * num_kv_heads * cdiv(group, block_h)
        num_splits = _fill_waves(programs, ctas_per_sm * sm_count)
    num_splits = max(1, min(num_splits, blocks, MAX_SPLITS))
    tokens_per_split = cdiv(blocks, num_splits) * block_n
    num_splits = max(1, cdiv(max_tokens, tokens_per_split))  # drop splits left empty
    return DecodePlan(
        page_size=page_size,
        head_dim=main,
        block_d=block_d,
        rope_dim=rope,
        block_r=max(16, triton.next_power_of_2(max(rope, 1))),
        latent=latent,
        group=group,
        block_h=block_h,
        block_n=block_n,
        num_splits=num_splits,
        tokens_per_split=tokens_per_split,
        num_warps=8 if block_d >= 512 else 4,
        num_stages=NUM_STAGES,
        merge_warps=8 if block_d >= 512 else 4,
        window=window_left >= 0,
        soft_cap=soft_cap,
        sinks=sinks,
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
    """Multiprocessors of a CUDA device (cached per device index)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in SM_COUNTS:
        SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return SM_COUNTS[index]
