"""A pool's physical order (KVLayout.order): every order's views name the elements the
spec's formula names (spec/protocol.md, "Memory"), zero-copy, and two orders never
share a tier fingerprint."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.errors import BadRequest
from kvcore.layout import AXES, KVLayout
from kvcore.tiers.base import layout_fingerprint

ORDERS = ["".join(p) for p in itertools.permutations(AXES)]


@st.composite
def layouts(draw: st.DrawFn) -> KVLayout:
    kind = draw(st.sampled_from(["kv", "latent"]))
    return KVLayout(
        num_layers=draw(st.integers(1, 3)),
        num_kv_heads=1 if kind == "latent" else draw(st.integers(1, 3)),
        head_dim=draw(st.integers(1, 5)),
        page_size=draw(st.integers(1, 4)),
        dtype="float32",
        num_pages=draw(st.integers(1, 4)),
        kind=kind,
        order=draw(st.sampled_from(ORDERS)),
    )


def spec_offset(layout: KVLayout, index: tuple[int, ...]) -> int:
    """The element at logical (l, p, k, t, h, d), by spec/protocol.md's formula alone."""
    size = {"L": layout.num_layers, "P": layout.num_pages, "K": layout.parts}
    size |= {"T": layout.page_size, "H": layout.num_kv_heads}
    stride, step = {}, layout.head_dim
    for axis in reversed(layout.order):
        stride[axis], step = step, step * size[axis]
    return sum(i * stride[a] for i, a in zip(index, AXES, strict=False)) + index[-1]


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_layer_views_follow_the_spec_formula(layout: KVLayout) -> None:
    pool = torch.arange(layout.total_bytes // 4, dtype=torch.float32)
    views = layout.layer_views(pool)
    for index in itertools.product(*(range(n) for n in (layout.num_layers, *layout.layer_shape))):
        assert views[index[0]][index[1:]].item() == spec_offset(layout, index)
    for view in views:  # zero-copy, whatever the order
        assert view.untyped_storage().data_ptr() == pool.untyped_storage().data_ptr()


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_a_pages_row_holds_that_page_in_the_pool_order(layout: KVLayout) -> None:
    pool = torch.arange(layout.total_bytes // 4, dtype=torch.float32)
    rows = layout.pages_view(pool)
    assert rows.shape == (layout.num_pages, *layout.stored_page_shape)
    views = layout.layer_views(pool)
    for page in range(layout.num_pages):
        mine = set(rows[page].flatten().tolist())
        want = set(torch.stack([v[page] for v in views]).flatten().tolist())
        assert mine == want
        if layout.page_major:  # one run: the page's bytes, all layers, side by side
            assert rows[page].is_contiguous()
            assert rows[page].flatten()[0].item() == page * layout.page_bytes // 4


def test_orders_are_checked_and_named() -> None:
    for bad in ("LPKT", "LPKTHH", "LPKTX", "lpkth", ""):
        with pytest.raises(BadRequest, match="permutation"):
            KVLayout(1, 1, 8, 4, "float16", 4, order=bad)
    layout = KVLayout(2, 4, 8, 16, "float16", 10, order="PLHKT")
    strided = torch.zeros(2 * layout.total_bytes, dtype=torch.uint8)[::2]
    with pytest.raises(BadRequest, match="contiguous"):  # views of a copy would write nothing
        layout.pages_view(strided)
    with pytest.raises(BadRequest, match="contiguous"):
        layout.layer_views(strided)
    assert layout.to_dict()["order"] == "PLHKT"
    assert layout.stored_page_shape == (2, 4, 2, 16, 8)
    assert (
        KVLayout.for_budget(
            layout.total_bytes,
            num_layers=2,
            num_kv_heads=4,
            head_dim=8,
            page_size=16,
            dtype="float16",
            order="PLHKT",
        )
        == layout
    )


def test_each_order_has_its_own_tier_fingerprint() -> None:
    prints = {layout_fingerprint(KVLayout(2, 2, 8, 4, "float16", 4, order=o)) for o in ORDERS}
    assert len(prints) == len(ORDERS)
    # layer-major keeps the fingerprint it had before orders (a little-endian host):
    # tiers written before stay readable
    old = "53e8fc100e956975bcf968df9a1a9cd6"
    assert layout_fingerprint(KVLayout(2, 2, 8, 4, "float16", 99, order="LPKTH")).hex() == old


def test_the_spec_test_vector() -> None:
    """spec/protocol.md, "Memory": the worked example, for both orders it names."""
    for order, strides, element in (
        ("PLHKT", {"L": 32, "P": 64, "K": 8, "T": 4, "H": 16, "D": 1}, 187),
        ("LPKTH", {"L": 96, "P": 32, "K": 16, "T": 8, "H": 4, "D": 1}, 183),
    ):
        layout = KVLayout(2, 2, 4, 2, "float32", 3, order=order)
        assert layout.strides == strides
        pool = torch.arange(layout.total_bytes // 4, dtype=torch.float32)
        assert layout.layer_views(pool)[1][2, 1, 0, 1, 3].item() == element
