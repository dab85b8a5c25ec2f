"""What the kernel conformance suite draws: profiles, tolerances, cases and their tensors.

A :class:`Case` is a small, hashable description (dtype, head dim, page size,
heads, sequence lengths, how block tables are built, the cache's strides or the
pool order it is a layer of, a seed); :func:`build` turns it into tensors on a
device. Hypothesis shrinks the
description, so a failure reports a readable configuration.

Only configurations the backend's :class:`~kvcore.backend.Capabilities` declare
are drawn. Units: ``seq_lens`` / ``q_lens`` are tokens, ``page_size`` is
tokens per page, ``head_dim`` is elements.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from kvcore.backend import ALL_ORDERS, MAX_HEAD_DIM, MAX_PAGE_SIZE, NAMED_ORDERS, Capabilities
from kvcore.layout import DEFAULT_ORDER, FP8_DTYPES, KVLayout, cdiv
from kvcore.testing.tolerance import Tolerance, attention, cache_parts

DTYPES = ("float32", "float16", "bfloat16")

# -- tolerances: derived (kvcore.testing.tolerance.attention) --------------------------
# Outputs compared against the oracle, against dense attention, or against the backend
# itself under a change of layout are held to tolerance.attention's bound, computed from
# the case's own tensors (head dim, keys per query, |q|, |k|, |v|). What a kernel may
# round besides fp32 arithmetic, by backend, device and query dtype: a 16-bit query's P
# for P V (FlashAttention's tensor-core dots; granted to every backend), and fp32 tl.dot
# operands on a GPU, which run on TF32 tensor cores.
OPERANDS: dict[tuple[str, str, str], str] = {("triton", "cuda", "float32"): "tf32"}


def operands(backend: str, device: str, dtype: str) -> str | None:
    """The format ``backend`` on a ``device`` type may round its dot operands to, for
    queries of ``dtype`` (tolerance.attention's ``operands``)."""
    if dtype in ("float16", "bfloat16"):
        return dtype
    return OPERANDS.get((backend, device, dtype))


def tolerance(
    backend: str,
    device: str,
    case: Case,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    *,
    itself: bool = False,
    same_qk: bool = False,
) -> Tolerance:
    """tolerance.attention for ``backend`` against another fp32 computation of ``case``
    with ``query`` over ``kv_cache``: the oracle or dense attention, or (``itself``) the
    backend again, with the same Q and K rounded alike when ``same_qk`` (the same kernel
    under another page order, page size or layout)."""
    key, value = cache_parts(kv_cache)
    return attention(
        query,
        key,
        value,
        case.scale,
        keys=max(case.seq_lens),
        operands=operands(backend, device, case.dtype),
        sides=2 if itself else 1,
        same_qk=same_qk,
    )


# -- profiles ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Profile:
    """Shape limits of one run. ``examples`` is per property (KVCORE_CONFORMANCE_EXAMPLES
    overrides it). Head dims and page sizes are intersected with the capabilities."""

    name: str
    examples: int
    head_dims: tuple[int, ...]
    page_sizes: tuple[int, ...]
    max_batch: int
    max_tokens: int  # per sequence
    kv_heads: tuple[int, ...]
    groups: tuple[int, ...]  # query heads per kv head (1 = MHA, Hkv = 1 is MQA)
    # MLA's (v_head_dim = kv_lora_rank, rope dims): a latent vector has their sum
    mla_dims: tuple[tuple[int, int], ...] = ((12, 8), (24, 12), (40, 4))


PROFILES: dict[str, Profile] = {
    # Tiny: runs under TRITON_INTERPRET=1 on a CPU in seconds per property.
    "quick": Profile(
        name="quick",
        examples=20,
        head_dims=(16, 32, 64),
        page_sizes=(1, 2, 3, 4, 5, 8, 16),
        max_batch=4,
        max_tokens=64,
        kv_heads=(1, 2),
        groups=(1, 2, 4),
    ),
    # The grid: head dims 64..256, page sizes 1..128 incl. non-powers of two.
    "full": Profile(
        name="full",
        examples=60,
        head_dims=(64, 80, 96, 128, 256),
        page_sizes=(1, 2, 3, 7, 8, 15, 16, 17, 31, 32, 48, 64, 100, 127, 128),
        max_batch=8,
        max_tokens=2048,
        kv_heads=(1, 2, 4, 8),
        groups=(1, 2, 4, 8),
        mla_dims=((512, 64), (128, 64), (96, 32), (40, 4)),  # DeepSeek's: 576, V 512
    ),
}


def profile(name: str | None = None) -> Profile:
    """The named profile (default: $KVCORE_CONFORMANCE_PROFILE or "quick"), with
    $KVCORE_CONFORMANCE_EXAMPLES applied."""
    name = name or os.environ.get("KVCORE_CONFORMANCE_PROFILE", "quick")
    if name not in PROFILES:
        raise ValueError(f"unknown conformance profile {name!r}; one of {sorted(PROFILES)}")
    base = PROFILES[name]
    examples = os.environ.get("KVCORE_CONFORMANCE_EXAMPLES")
    if examples:
        from dataclasses import replace

        return replace(base, examples=max(1, int(examples)))
    return base


def _declared(wanted: tuple[int, ...], declared: frozenset[int] | None, bound: int) -> list[int]:
    """``wanted`` ∩ declared; if that is empty, the smallest declared values."""
    if declared is None:
        return [x for x in wanted if x <= bound]
    hit = [x for x in wanted if x in declared]
    return hit or sorted(declared)[:2]


def head_dims(prof: Profile, caps: Capabilities) -> list[int]:
    return _declared(prof.head_dims, caps.head_dims, MAX_HEAD_DIM)


def page_sizes(prof: Profile, caps: Capabilities) -> list[int]:
    return _declared(prof.page_sizes, caps.page_sizes, MAX_PAGE_SIZE)


def dtypes(caps: Capabilities) -> list[str]:
    return [d for d in DTYPES if d in caps.dtypes]


# -- cases ------------------------------------------------------------------------

TABLE_MODES = ("distinct", "shared_prefix", "with_replacement")
# distinct: every sequence owns its pages, scattered over the pool in random order;
# shared_prefix: sequences share leading pages of sequence 0 (as the prefix cache does);
# with_replacement: every entry drawn from the pool, so pages repeat within and across rows.
LAYOUTS = ("contiguous", "kv_split", "padded", "pool")
# contiguous: [num_pages, 2, page_size, Hkv, D] dense; kv_split: K and V live in two
# separate pools (a stride permutation); padded: each page row has spare heads and
# elements (a slice of a larger tensor); pool: the middle layer of a real pool of
# POOL_LAYERS layers in the case's order (KVLayout(..., order).layer_views), so
# page-major pools interleave other layers between pages and head-outer ones put
# H outside K and T. The last dim is contiguous in all four.
POOL_LAYERS = 3
FP8_NAN = 0x7F  # a NaN byte in both float8 formats


@dataclass(frozen=True, slots=True)
class Case:
    dtype: str
    head_dim: int
    page_size: int
    num_kv_heads: int
    group: int
    seq_lens: tuple[int, ...]
    q_lens: tuple[int, ...]  # prefill queries per sequence, 1 <= q_len <= seq_len
    table_mode: str
    layout: str
    pad_cols: int  # extra block-table columns past the longest sequence
    pad_value: str  # what unused table entries hold: "minus_one", "past_end", "valid"
    seed: int
    scale_factor: float = 1.0  # the softmax scale is scale_factor / sqrt(head_dim)
    order: str = DEFAULT_ORDER  # the pool's order (KVLayout.order), layout "pool" only

    @property
    def num_q_heads(self) -> int:
        return self.num_kv_heads * self.group

    @property
    def scale(self) -> float:
        """The scale passed to decode/prefill: a backend that ignores it fails."""
        return self.scale_factor / math.sqrt(self.head_dim)

    def pages_of(self, seq_len: int) -> int:
        return cdiv(seq_len, self.page_size)


@st.composite
def seq_len_st(draw: st.DrawFn, page_size: int, max_tokens: int) -> int:
    """A length in tokens, biased to the page edges and to the longest allowed."""
    edges = [1, page_size - 1, page_size, page_size + 1, 2 * page_size + 1, max_tokens]
    edges = [n for n in edges if 1 <= n <= max_tokens]
    return draw(st.one_of(st.sampled_from(edges), st.integers(1, max_tokens)))


@st.composite
def layout_st(draw: st.DrawFn, caps: Capabilities) -> tuple[str, str]:
    """A cache layout and its pool order (:data:`DEFAULT_ORDER` unless "pool"). A
    backend that reads any strides (``caps.orders`` None) gets a pool half the time,
    of a named order or any permutation; one that declares orders gets pools of those
    only (the other layouts fit no order or not its)."""
    if caps.orders is not None:
        return "pool", draw(st.sampled_from(sorted(caps.orders)))
    layout = draw(st.one_of(st.just("pool"), st.sampled_from(LAYOUTS[:-1])))
    if layout != "pool":
        return layout, DEFAULT_ORDER
    return layout, draw(st.one_of(st.sampled_from(NAMED_ORDERS), st.sampled_from(ALL_ORDERS)))


@st.composite
def case_st(
    draw: st.DrawFn,
    prof: Profile,
    caps: Capabilities,
    *,
    page_size: int | None = None,
    table_modes: tuple[str, ...] = TABLE_MODES,
) -> Case:
    ps = page_size if page_size is not None else draw(st.sampled_from(page_sizes(prof, caps)))
    batch = draw(st.integers(1, prof.max_batch))
    lens = tuple(draw(seq_len_st(ps, prof.max_tokens)) for _ in range(batch))
    q_lens = tuple(draw(st.sampled_from(sorted({1, n, max(1, n // 2)}))) for n in lens)
    layout, order = draw(layout_st(caps))
    return Case(
        dtype=draw(st.sampled_from(dtypes(caps))),
        head_dim=draw(st.sampled_from(head_dims(prof, caps))),
        page_size=ps,
        num_kv_heads=draw(st.sampled_from(prof.kv_heads)),
        group=draw(st.sampled_from(prof.groups)),
        seq_lens=lens,
        q_lens=q_lens,
        table_mode=draw(st.sampled_from(table_modes)),
        layout=layout,
        pad_cols=draw(st.integers(0, 2)),
        pad_value=draw(st.sampled_from(("minus_one", "past_end", "valid"))),
        seed=draw(st.integers(0, 2**31 - 1)),
        scale_factor=draw(st.sampled_from((1.0, 0.25, 2.0))),
        order=order,
    )


# -- tensors ----------------------------------------------------------------------


def pool_layer(layout: KVLayout, device: torch.device) -> torch.Tensor:
    """The middle layer's view of a NaN-filled pool of ``layout`` (fp8: the NaN byte
    0x7F), [num_pages, parts, page_size, Hkv, D] with the order's strides; the pool's
    other layers are the view's storage too, NaN, so a write that strays shows."""
    if layout.dtype in FP8_DTYPES:
        pool = torch.full((layout.total_bytes,), FP8_NAN, dtype=torch.uint8, device=device)
    else:
        size = layout.total_bytes // layout.dtype_size
        pool = torch.full((size,), float("nan"), dtype=layout.torch_dtype(), device=device)
    return layout.layer_views(pool)[layout.num_layers // 2]


def whole_storage(t: torch.Tensor) -> torch.Tensor:
    """Every element of the storage ``t`` views, flat in ``t``'s dtype: padding and a
    pool's other layers included (what "nothing else written" counts)."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage())


def empty_cache(case: Case, num_pages: int, device: torch.device) -> torch.Tensor:
    """A NaN-filled cache [num_pages, 2, page_size, Hkv, D] with the case's strides."""
    dtype = getattr(torch, case.dtype)
    ps, h, d = case.page_size, case.num_kv_heads, case.head_dim
    nan = float("nan")
    if case.layout == "pool":
        layout = KVLayout(POOL_LAYERS, h, d, ps, case.dtype, num_pages, "kv", case.order)
        return pool_layer(layout, device)
    if case.layout == "kv_split":
        return torch.full((2, num_pages, ps, h, d), nan, dtype=dtype, device=device).transpose(0, 1)
    if case.layout == "padded":
        big = torch.full((num_pages, 2, ps, h + 1, d + 3), nan, dtype=dtype, device=device)
        return big[:, :, :, 1:, :d]
    return torch.full((num_pages, 2, ps, h, d), nan, dtype=dtype, device=device)


def block_table(case: Case, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """block_table [B, max_pages] int32 (CPU) and the pool size in pages.

    Unused entries (past each sequence's pages) hold the case's pad value: -1, an
    index past the pool, or a valid page; none of them may be read.
    """
    used = [case.pages_of(n) for n in case.seq_lens]
    max_pages = max(used) + case.pad_cols
    num_pages = sum(used) + 3  # spare pages no sequence names
    perm = torch.randperm(num_pages, generator=gen).tolist()
    rows: list[list[int]] = []
    taken = 0
    for b, n in enumerate(used):
        if case.table_mode == "with_replacement":
            row = torch.randint(0, num_pages, (n,), generator=gen).tolist()
        elif case.table_mode == "shared_prefix" and b > 0:
            shared = int(torch.randint(0, min(n, used[0]) + 1, (), generator=gen))
            row = rows[0][:shared] + perm[taken : taken + n - shared]
            taken += n - shared
        else:
            row = perm[taken : taken + n]
            taken += n
        rows.append(row)
    pad = {"minus_one": -1, "past_end": num_pages + 7}.get(case.pad_value)
    table = torch.empty(len(used), max_pages, dtype=torch.int32)
    for b, row in enumerate(rows):
        if pad is None:
            table[b] = torch.randint(0, num_pages, (max_pages,), generator=gen)
        else:
            table[b] = pad
        table[b, : len(row)] = torch.tensor(row, dtype=torch.int32)
    return table, num_pages


def token_slots(row: torch.Tensor, seq_len: int, page_size: int) -> torch.Tensor:
    """Slots (page * page_size + offset) of tokens 0..seq_len-1 of one block-table row."""
    t = torch.arange(seq_len, device=row.device)
    return row[t // page_size].long() * page_size + t % page_size


def used_slots(case: Case, table: torch.Tensor) -> torch.Tensor:
    """Every slot some sequence reads, in sequence then token order; int64, may repeat."""
    return torch.cat(
        [token_slots(table[b], n, case.page_size) for b, n in enumerate(case.seq_lens)]
    )


def fill_slots(kv_cache: torch.Tensor, slots: torch.Tensor, gen: torch.Generator) -> None:
    """Write random N(0, 1) K and V into ``slots``; every other slot keeps its NaN."""
    ps = kv_cache.shape[2]
    values = torch.randn((slots.numel(), 2, *kv_cache.shape[3:]), generator=gen)
    page, off = slots // ps, slots % ps
    kv_cache[page.to(kv_cache.device), :, off.to(kv_cache.device)] = values.to(
        kv_cache.device, kv_cache.dtype
    )


@dataclass(slots=True)
class Built:
    """The tensors of one case on the device under test."""

    kv_cache: torch.Tensor
    block_table: torch.Tensor  # [B, max_pages] int32
    seq_lens: torch.Tensor  # [B] int32
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    decode_query: torch.Tensor  # [B, Hq, D]
    prefill_query: torch.Tensor  # [sum(q_lens), Hq, D]
    scale: float


def build(case: Case, device: torch.device) -> Built:
    """A NaN-poisoned cache where exactly the slots the sequences read hold values."""
    gen = torch.Generator().manual_seed(case.seed)
    table, num_pages = block_table(case, gen)
    cache = empty_cache(case, num_pages, device)
    fill_slots(cache, used_slots(case, table), gen)
    dtype = getattr(torch, case.dtype)
    hq, d = case.num_q_heads, case.head_dim
    cu = [0]
    for q in case.q_lens:
        cu.append(cu[-1] + q)
    return Built(
        kv_cache=cache,
        block_table=table.to(device),
        seq_lens=torch.tensor(case.seq_lens, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        decode_query=torch.randn(len(case.seq_lens), hq, d, generator=gen).to(device, dtype),
        prefill_query=torch.randn(cu[-1], hq, d, generator=gen).to(device, dtype),
        scale=case.scale,
    )
