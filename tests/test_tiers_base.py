"""Tier keys, layout fingerprints, the entry codec and the pool <-> batch copies."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvcore.errors import BadRequest
from kvcore.layout import KVLayout
from kvcore.prefix import KeySpace, page_key, root_key
from kvcore.tiers import gather_pages, layout_fingerprint, prefix_of, scatter_pages, tier_key
from kvcore.tiers.base import check_keys
from kvcore.tiers.codec import HEADER_BYTES, check_entry, encode_header, header_names
from kvcore.tiers.transfer import byte_view

LAYOUT = KVLayout(
    num_layers=3, num_kv_heads=2, head_dim=8, page_size=4, dtype="float16", num_pages=16
)


def test_fingerprint_ignores_pool_size_only() -> None:
    base = layout_fingerprint(LAYOUT)
    assert layout_fingerprint(dataclasses.replace(LAYOUT, num_pages=999)) == base
    for change in (
        {"num_layers": 4},
        {"num_kv_heads": 1},
        {"head_dim": 16},
        {"page_size": 8},
        {"dtype": "bfloat16"},
        {"dtype": "float32"},
        {"order": "PLKTH"},
        {"order": "LPHKT"},
    ):
        assert layout_fingerprint(dataclasses.replace(LAYOUT, **change)) != base, change


def test_tier_keys_keep_layouts_and_namespaces_apart() -> None:
    tokens = bytes(4 * LAYOUT.page_size)
    a, b = page_key(root_key(KeySpace("a")), tokens), page_key(root_key(KeySpace("b")), tokens)
    fp = layout_fingerprint(LAYOUT)
    other = layout_fingerprint(dataclasses.replace(LAYOUT, head_dim=16))
    assert len({tier_key(fp, a), tier_key(fp, b), tier_key(other, a)}) == 3
    assert prefix_of(tier_key(fp, a)) == a
    with pytest.raises(BadRequest):
        check_keys(fp, [tier_key(other, a)])
    with pytest.raises(BadRequest):
        tier_key(fp, a[:31])  # type: ignore[arg-type]


@given(payload=st.binary(min_size=1, max_size=64), flip=st.integers(min_value=0))
def test_codec_detects_any_flipped_byte(payload: bytes, flip: int) -> None:
    key = tier_key(layout_fingerprint(LAYOUT), root_key(KeySpace("ns")))
    header = encode_header(key, payload)
    assert len(header) == HEADER_BYTES
    assert check_entry(key, header, payload, len(payload))
    assert header_names(header, len(payload)) == key
    entry = bytearray(header + payload)
    entry[flip % len(entry)] ^= 0x01
    assert not check_entry(key, entry[:HEADER_BYTES], entry[HEADER_BYTES:], len(payload))


def test_codec_refuses_another_key_or_length() -> None:
    fp = layout_fingerprint(LAYOUT)
    key, other = tier_key(fp, root_key(KeySpace("a"))), tier_key(fp, root_key(KeySpace("b")))
    header = encode_header(key, b"x" * 8)
    assert not check_entry(other, header, b"x" * 8, 8)
    assert not check_entry(key, header, b"x" * 8, 16)
    assert not check_entry(key, header, b"x" * 7, 8)  # torn
    assert header_names(header, 16) is None


def _pool(order: str = "LPKTH") -> torch.Tensor:
    layout = dataclasses.replace(LAYOUT, order=order)
    flat = torch.randn(layout.total_bytes // layout.dtype_size).to(torch.float16)
    return layout.pages_view(flat)


@pytest.mark.parametrize("order", ["LPKTH", "PLKTH", "LPHKT"])
@given(ids=st.lists(st.integers(0, LAYOUT.num_pages - 1), unique=True, max_size=LAYOUT.num_pages))
def test_gather_then_scatter_moves_exact_pages(order: str, ids: list[int]) -> None:
    layout = dataclasses.replace(LAYOUT, order=order)
    rows = _pool(order)
    pages = gather_pages(rows, ids)
    assert pages.shape == (len(ids), *layout.stored_page_shape)
    assert pages.is_contiguous()
    for i, page in enumerate(ids):
        assert torch.equal(pages[i], rows[page])
    target = _pool(order)
    untouched = [p for p in range(LAYOUT.num_pages) if p not in ids]
    before = target[untouched].clone()
    scatter_pages(target, ids, pages)
    assert torch.equal(target[ids], rows[ids])
    assert torch.equal(target[untouched], before)


def test_transfer_rejects_bad_input() -> None:
    rows = _pool()
    with pytest.raises(BadRequest):
        gather_pages(rows, [LAYOUT.num_pages])
    pages = gather_pages(rows, [0, 1])
    with pytest.raises(BadRequest):
        scatter_pages(rows, [2, 2], pages)
    with pytest.raises(BadRequest):
        scatter_pages(rows, [2], pages)
    with pytest.raises(BadRequest):
        scatter_pages(rows, [2, 3], pages.float())


def test_byte_view_is_zero_copy() -> None:
    tensor = torch.zeros(4, dtype=torch.float32)
    view = byte_view(tensor)
    assert len(view) == 16
    view[0:4] = torch.tensor([1.5], dtype=torch.float32).view(torch.uint8).numpy().tobytes()
    assert tensor[0].item() == 1.5
