"""Launch planning on the host: pure integer arithmetic, no cupy, no torch.

Units: tokens for lengths and splits, pages for page counts, CTAs for grid sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcore.layout import cdiv
from kvcore_cupy.kernels import GROUP_TILES

#: CTAs per SM a decode launch aims for (a few resident CTAs hide load latency)
CTAS_PER_SM = 4
#: no split is shorter than this many tokens (the merge costs about one split)
MIN_SPLIT_TOKENS = 256
#: split lengths are rounded up to this many tokens (a multiple of every kBlock * 4 warps)
SPLIT_ALIGN = 64


@dataclass(frozen=True, slots=True)
class FastDivisor:
    """Magic numbers for ``n // d == (umulhi(n, mul) + n) >> shift``, 0 <= n < 2**31."""

    d: int
    mul: int
    shift: int

    def div(self, n: int) -> int:
        """The kernel's arithmetic, in Python (for tests)."""
        assert 0 <= n < 1 << 31, n
        return (((n * self.mul) >> 32) + n) >> self.shift


def fast_divisor(d: int) -> FastDivisor:
    """Divisor ``d`` in 1..2**31 as (mul, shift); mul < 2**32, so it fits a u32."""
    assert 1 <= d <= 1 << 31, d
    shift = (d - 1).bit_length()  # ceil(log2(d))
    mul = ((1 << 32) * ((1 << shift) - d)) // d + 1
    assert 0 < mul < 1 << 32
    return FastDivisor(d, mul, shift)


@dataclass(frozen=True, slots=True)
class GroupTiling:
    """How the ``group`` query heads of one kv head are cut: n_chunks chunks of ``tile``."""

    tile: int
    n_chunks: int


def group_tiling(group: int) -> GroupTiling:
    """The smallest compiled tile >= group, else the largest tile and several chunks.

    A chunk past the group's end is masked in the kernel (e.g. group 3 -> tile 4).
    """
    assert group >= 1, group
    for tile in GROUP_TILES:
        if tile >= group:
            return GroupTiling(tile, 1)
    tile = GROUP_TILES[-1]
    return GroupTiling(tile, cdiv(group, tile))


@dataclass(frozen=True, slots=True)
class SplitPlan:
    """Decode splits: ``num_splits`` CTAs per (sequence, head chunk), ``split_len`` tokens each."""

    num_splits: int
    split_len: int


def split_plan(
    max_tokens: int,
    base_ctas: int,
    num_sms: int,
    *,
    min_split: int = MIN_SPLIT_TOKENS,
    align: int = SPLIT_ALIGN,
) -> SplitPlan:
    """Choose splits so that base_ctas * num_splits fills ~CTAS_PER_SM CTAs per SM.

    ``max_tokens`` bounds every sequence's length (max_pages * page_size: no device
    sync needed); ``base_ctas`` = B * Hkv * n_chunks. Splits never go below
    ``min_split`` tokens (so short contexts run with one split and no merge) and are
    a multiple of ``align`` tokens.
    """
    assert max_tokens >= 1 and base_ctas >= 1 and num_sms >= 1 and min_split >= 1 and align >= 1
    want = cdiv(CTAS_PER_SM * num_sms, base_ctas)
    most = max(1, max_tokens // min_split)
    splits = max(1, min(want, most))
    split_len = cdiv(max_tokens, splits)
    split_len = cdiv(split_len, align) * align
    splits = cdiv(max_tokens, split_len)  # after rounding up, fewer may suffice
    return SplitPlan(splits, split_len)
