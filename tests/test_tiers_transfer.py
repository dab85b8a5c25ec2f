"""Pool <-> tier page copies (kvcore.tiers.transfer) keep every byte, for any page set.

On a CPU pool, promotion and scatter copy raw bytes (one memmove per page and
layer, split over threads) when views and pages are contiguous page by page, and
go through torch copies otherwise: both must put exactly the source bytes into
exactly the named pages (fp8 NaN and infinity patterns included) and leave every
other byte of the pool alone.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from page_bytes import byte_pages, same_bytes

from kvcore.errors import BadRequest
from kvcore.layout import KVLayout
from kvcore.prefix import PrefixKey
from kvcore.tiers import HostTier, gather_pages, layout_fingerprint, scatter_pages, tier_keys
from kvcore.tiers.transfer import promote_rows, take_rows

NUM_PAGES = 12
LAYOUTS = [
    KVLayout(3, 2, 8, 2, "float8_e4m3fn", NUM_PAGES),
    KVLayout(2, 1, 8, 2, "float8_e5m2", NUM_PAGES),
    KVLayout(2, 1, 24, 2, "bfloat16", NUM_PAGES, kind="latent"),
    KVLayout(1, 2, 4, 2, "float16", NUM_PAGES),
    KVLayout(2, 1, 4, 1, "float32", NUM_PAGES),
]


def _strided(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values in a non-contiguous tensor of the same shape (every
    other element of a wider last dimension)."""
    strided = torch.zeros((*tensor.shape[:-1], 2 * tensor.shape[-1]), dtype=tensor.dtype)[..., ::2]
    _raw_copy(strided, tensor)
    return strided


def _raw_copy(target: torch.Tensor, source: torch.Tensor) -> None:
    """``target[...] = source`` by bytes (float8 through uint8: no conversion)."""
    if source.element_size() == 1:
        target.view(torch.uint8).copy_(source.view(torch.uint8))
    else:
        target.copy_(source)


def _pool(layout: KVLayout, kind: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A pool filled with known bytes and its layer views: KVLayout.layer_views of one
    tensor (``one``), one separate tensor per layer (``apart``), or non-contiguous
    views (``strided``: the torch-copy path)."""
    memory = byte_pages(layout, NUM_PAGES, salt=99).view(torch.uint8).reshape(-1).clone()
    views = layout.layer_views(memory)
    if kind == "apart":
        views = [v.clone() for v in views]
    elif kind == "strided":
        views = [_strided(v) for v in views]
    return memory, views


def _expected(views: list[torch.Tensor], ids: list[int], pages: torch.Tensor) -> list[torch.Tensor]:
    """The views after ``views[l][ids[i]] = pages[i, l]``, computed one page at a time."""
    out = [v.clone() for v in views]
    for i, page in enumerate(ids):
        for layer, view in enumerate(out):
            _raw_copy(view[page], pages[i, layer])
    return out


page_sets = st.lists(st.integers(0, NUM_PAGES - 1), unique=True, max_size=NUM_PAGES)


@settings(max_examples=60, deadline=None)
@given(
    layout=st.sampled_from(LAYOUTS),
    ids=page_sets,
    kind=st.sampled_from(["one", "apart", "strided"]),
    strided_source=st.booleans(),
    data=st.data(),
)
def test_promote_and_scatter_write_exactly_the_named_pages(
    layout: KVLayout, ids: list[int], kind: str, strided_source: bool, data: st.DataObject
) -> None:
    store = byte_pages(layout, NUM_PAGES, salt=3)
    if strided_source:
        store = _strided(store)
    rows = data.draw(st.lists(st.integers(0, NUM_PAGES - 1), min_size=len(ids), max_size=len(ids)))
    _, views = _pool(layout, kind)
    want = _expected(views, ids, store[rows])
    promote_rows(views, ids, store, rows)
    assert all(same_bytes(v, w) for v, w in zip(views, want, strict=True))
    assert not ids or same_bytes(gather_pages(views, ids), store[rows])

    _, views = _pool(layout, kind)
    pages = byte_pages(layout, len(ids), salt=11)
    if strided_source and ids:
        pages = _strided(pages)
    scatter_pages(views, ids, pages)
    want = _expected(_pool(layout, kind)[1], ids, pages)
    assert all(same_bytes(v, w) for v, w in zip(views, want, strict=True))


@settings(max_examples=25, deadline=None)
@given(layout=st.sampled_from(LAYOUTS), start=st.integers(0, NUM_PAGES - 1), data=st.data())
def test_host_promotion_of_adjacent_pages_keeps_bytes(
    layout: KVLayout, start: int, data: st.DataObject
) -> None:
    """HostTier.promote of consecutive slots into consecutive pool pages (the case a
    random page set rarely draws) writes them and no byte around them."""
    count = data.draw(st.integers(1, NUM_PAGES - start))
    keys = tier_keys(layout_fingerprint(layout), [PrefixKey(bytes([i]) * 32) for i in range(count)])
    pages = byte_pages(layout, count, salt=start)
    host = HostTier(layout, count)
    host.put_many(keys, pages)
    memory, views = _pool(layout, "one")
    before = memory.clone()
    assert host.promote(keys, views, list(range(start, start + count))) == count
    assert same_bytes(gather_pages(views, list(range(start, start + count))), pages)
    untouched = [p for p in range(NUM_PAGES) if not start <= p < start + count]
    assert same_bytes(
        gather_pages(views, untouched), gather_pages(layout.layer_views(before), untouched)
    )


def test_promote_rows_rejects_bad_input() -> None:
    layout = LAYOUTS[0]
    _, views = _pool(layout, "one")
    store = byte_pages(layout, 2)
    with pytest.raises(BadRequest):
        promote_rows(views, [NUM_PAGES], store, [0])
    with pytest.raises(BadRequest):
        promote_rows(views, [-1], store, [0])
    with pytest.raises(BadRequest):
        promote_rows(views, [0], store.view(torch.uint8), [0])
    with pytest.raises(BadRequest):
        promote_rows(views, [0], store[:, :1], [0])


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.dtype)
def test_copies_split_over_threads_keep_bytes(
    layout: KVLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same copies split over three threads (any size is worth a split here)."""
    from kvcore.tiers import transfer

    monkeypatch.setattr(transfer, "_SPLIT_BYTES", 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        generator = torch.Generator().manual_seed(len(layout.dtype))
        ids = torch.randperm(NUM_PAGES, generator=generator)[:7].tolist()
        rows = torch.randint(0, NUM_PAGES, (7,), generator=generator).tolist()
        store = byte_pages(layout, NUM_PAGES, salt=5)
        _, views = _pool(layout, "one")
        want = _expected(views, ids, store[rows])
        promote_rows(views, ids, store, rows)
        assert all(same_bytes(v, w) for v, w in zip(views, want, strict=True))
        _, views = _pool(layout, "apart")
        scatter_pages(views, ids, store[rows])
        assert all(same_bytes(v, w) for v, w in zip(views, want, strict=True))
        out = torch.zeros((9, *store.shape[1:]), dtype=store.dtype)
        got = take_rows(store, rows, out)
        assert got.data_ptr() == out.data_ptr() and same_bytes(got, store[rows])
        assert same_bytes(gather_pages(views, ids), store[rows])
    finally:
        torch.set_num_threads(threads)
