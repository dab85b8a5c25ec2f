"""Pool <-> tier page copies (kvcore.tiers.transfer) keep every byte, for any page set and
any physical order, and move a page-major page as one run.

On a CPU pool every copy is raw bytes, one memmove per run of a row (split over
threads), or torch copies for rows of too many short runs; between devices one gather,
one transfer, one ``index_copy_`` along the page axis (run here on the CPU). Each must
put exactly the source bytes into exactly the named pages (fp8 NaN and infinity
patterns included) and leave every other byte of the pool alone.
"""

from __future__ import annotations

import ctypes
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from page_bytes import byte_pages, same_bytes

from kvcore.errors import BadRequest
from kvcore.layout import KVLayout
from kvcore.prefix import PrefixKey
from kvcore.tiers import (
    HostTier,
    gather_pages,
    layout_fingerprint,
    scatter_pages,
    tier_keys,
    transfer,
)
from kvcore.tiers.transfer import plan_rows, promote_rows, spill_rows, take_rows

NUM_PAGES = 12
LAYOUTS = [
    KVLayout(3, 2, 8, 2, "float8_e4m3fn", NUM_PAGES),
    KVLayout(2, 1, 8, 2, "float8_e5m2", NUM_PAGES),
    KVLayout(2, 1, 24, 2, "bfloat16", NUM_PAGES, kind="latent"),
    KVLayout(1, 2, 4, 2, "float16", NUM_PAGES),
    KVLayout(2, 1, 4, 1, "float32", NUM_PAGES),
]
ORDERS = [
    "LPKTH",  # layer-major: num_layers runs a page
    "PLKTH",  # page-major: one run
    "LPHKT",  # head-outer, layer-major
    "PLHKT",  # head-outer, page-major
    "KLPTH",  # parts outside layers: 2 x num_layers runs
    "HTKLP",  # the page axis innermost: runs of head_dim elements
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


def _pool(layout: KVLayout, kind: str = "one") -> tuple[torch.Tensor, torch.Tensor]:
    """A pool's memory filled with known bytes and its rows: KVLayout.pages_view of it
    (``one``), or a non-contiguous copy of those rows (``strided``: runs of one element)."""
    memory = byte_pages(layout, NUM_PAGES, salt=99).view(torch.uint8).reshape(-1).clone()
    rows = layout.pages_view(memory)
    if kind == "strided":
        rows = _strided(rows)
    return memory, rows


def _expected(rows: torch.Tensor, ids: list[int], pages: torch.Tensor) -> torch.Tensor:
    """The rows after ``rows[ids[i]] = pages[i]``, computed one page at a time."""
    out = rows.clone()
    for i, page in enumerate(ids):
        _raw_copy(out[page], pages[i])
    return out


page_sets = st.lists(st.integers(0, NUM_PAGES - 1), unique=True, max_size=NUM_PAGES)


@settings(max_examples=80, deadline=None)
@given(
    layout=st.sampled_from(LAYOUTS),
    order=st.sampled_from(ORDERS),
    ids=page_sets,
    kind=st.sampled_from(["one", "strided"]),
    strided_source=st.booleans(),
    data=st.data(),
)
def test_every_move_writes_exactly_the_named_pages(
    layout: KVLayout,
    order: str,
    ids: list[int],
    kind: str,
    strided_source: bool,
    data: st.DataObject,
) -> None:
    layout = dataclasses.replace(layout, order=order)
    store = byte_pages(layout, NUM_PAGES, salt=3)
    if strided_source:
        store = _strided(store)
    rows = data.draw(st.lists(st.integers(0, NUM_PAGES - 1), min_size=len(ids), max_size=len(ids)))
    _, pool = _pool(layout, kind)
    want = _expected(pool, ids, store[rows])
    promote_rows(pool, ids, store, rows)
    assert same_bytes(pool, want)
    assert not ids or same_bytes(gather_pages(pool, ids), store[rows])

    _, pool = _pool(layout, kind)
    pages = byte_pages(layout, len(ids), salt=11)
    if strided_source and ids:
        pages = _strided(pages)
    scatter_pages(pool, ids, pages)
    assert same_bytes(pool, _expected(_pool(layout, kind)[1], ids, pages))

    _, pool = _pool(layout, kind)  # pool pages ids -> store rows: spill_rows, the other way
    target = byte_pages(layout, NUM_PAGES, salt=5)
    slots = data.draw(st.permutations(range(NUM_PAGES)))[: len(ids)]
    want = _expected(target, slots, gather_pages(pool, ids))
    spill_rows(pool, ids, target, slots)
    assert same_bytes(target, want)


@pytest.mark.parametrize("order", ORDERS)
def test_the_device_path_writes_the_same_bytes(order: str) -> None:
    """The GPU path's two halves (an index_select, an index_copy_ along the page axis of
    an order's strided rows), run here on the CPU."""
    for layout in LAYOUTS:
        layout = dataclasses.replace(layout, order=order)
        store = byte_pages(layout, NUM_PAGES, salt=7)
        ids, rows = [5, 0, 9, 3], [2, 2, 11, 0]
        _, pool = _pool(layout)
        want = _expected(pool, ids, store[rows])
        transfer._index_copy(pool, ids, transfer._select(store, rows))
        assert same_bytes(pool, want)
        assert same_bytes(transfer._select(pool, ids), store[rows])


@pytest.mark.parametrize(
    "order, runs",
    [("LPKTH", 3), ("LPHKT", 3), ("PLKTH", 1), ("PLHKT", 1), ("KLPTH", 6), ("HTKLP", 24)],
)
def test_a_page_costs_one_run_when_page_major(
    order: str, runs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A promotion from the host tier issues ``plan_rows(...).runs`` memmoves per page:
    one when page-major, one per layer when layer-major (counted, not timed)."""
    layout = dataclasses.replace(LAYOUTS[0], order=order)  # 3 layers, 2 heads, 2 tokens
    keys = tier_keys(layout_fingerprint(layout), [PrefixKey(bytes([i]) * 32) for i in range(5)])
    pages = byte_pages(layout, 5)
    host = HostTier(layout, 5)
    host.put_many(keys, pages)
    _, pool = _pool(layout)
    assert plan_rows(pool, pages).runs == runs
    calls: list[int] = []
    memmove = ctypes.memmove

    def counting(dst: int, src: int, count: int) -> int:
        calls.append(count)
        return memmove(dst, src, count)

    monkeypatch.setattr(ctypes, "memmove", counting)
    assert host.promote(keys, pool, [7, 1, 4, 10, 2]) == 5
    assert len(calls) == 5 * runs and set(calls) == {layout.page_bytes // runs}
    calls.clear()
    spill = HostTier(layout, 5)
    spill.spill_from(keys, pool, [7, 1, 4, 10, 2])
    assert len(calls) == 5 * runs
    monkeypatch.undo()
    assert same_bytes(gather_pages(pool, [7, 1, 4, 10, 2]), pages)
    assert same_bytes(spill.get_many(keys), pages)


@settings(max_examples=25, deadline=None)
@given(
    layout=st.sampled_from(LAYOUTS),
    order=st.sampled_from(ORDERS[:4]),
    start=st.integers(0, NUM_PAGES - 1),
    data=st.data(),
)
def test_host_promotion_of_adjacent_pages_keeps_bytes(
    layout: KVLayout, order: str, start: int, data: st.DataObject
) -> None:
    """HostTier.promote of consecutive slots into consecutive pool pages (the case a
    random page set rarely draws) writes them and no byte around them."""
    layout = dataclasses.replace(layout, order=order)
    count = data.draw(st.integers(1, NUM_PAGES - start))
    keys = tier_keys(layout_fingerprint(layout), [PrefixKey(bytes([i]) * 32) for i in range(count)])
    pages = byte_pages(layout, count, salt=start)
    host = HostTier(layout, count)
    host.put_many(keys, pages)
    memory, pool = _pool(layout)
    before = layout.pages_view(memory.clone())
    assert host.promote(keys, pool, list(range(start, start + count))) == count
    assert same_bytes(gather_pages(pool, list(range(start, start + count))), pages)
    untouched = [p for p in range(NUM_PAGES) if not start <= p < start + count]
    assert same_bytes(gather_pages(pool, untouched), gather_pages(before, untouched))


def test_promote_rows_rejects_bad_input() -> None:
    layout = LAYOUTS[0]
    _, pool = _pool(layout)
    store = byte_pages(layout, 2)
    with pytest.raises(BadRequest):
        promote_rows(pool, [NUM_PAGES], store, [0])
    with pytest.raises(BadRequest):
        promote_rows(pool, [-1], store, [0])
    with pytest.raises(BadRequest):
        promote_rows(pool, [0], store.view(torch.uint8), [0])
    with pytest.raises(BadRequest):
        promote_rows(pool, [0], store[:, :1], [0])
    with pytest.raises(BadRequest):
        promote_rows(pool, [0, 1], store, [0])
    with pytest.raises(BadRequest):
        spill_rows(pool, [0], store, [2])
    wide = KVLayout(2, 3, 8, 4, "float16", NUM_PAGES, order="LPKTH")  # LPHKT: another row shape
    _, rows = _pool(wide)
    with pytest.raises(BadRequest):
        promote_rows(rows, [0], byte_pages(dataclasses.replace(wide, order="LPHKT"), 1), [0])


@pytest.mark.parametrize("order", ORDERS[:2])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.dtype)
def test_copies_split_over_threads_keep_bytes(
    layout: KVLayout, order: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same copies split over three threads (any size is worth a split here), and
    through torch (rows of too many runs)."""
    layout = dataclasses.replace(layout, order=order)
    monkeypatch.setattr(transfer, "_SPLIT_BYTES", 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        generator = torch.Generator().manual_seed(len(layout.dtype))
        ids = torch.randperm(NUM_PAGES, generator=generator)[:7].tolist()
        rows = torch.randint(0, NUM_PAGES, (7,), generator=generator).tolist()
        store = byte_pages(layout, NUM_PAGES, salt=5)
        _, pool = _pool(layout)
        want = _expected(pool, ids, store[rows])
        promote_rows(pool, ids, store, rows)
        assert same_bytes(pool, want)
        out = torch.zeros((9, *store.shape[1:]), dtype=store.dtype)
        got = take_rows(store, rows, out)
        assert got.data_ptr() == out.data_ptr() and same_bytes(got, store[rows])
        assert same_bytes(gather_pages(pool, ids), store[rows])
        monkeypatch.setattr(transfer, "_MAX_RUNS", 0)
        _, pool = _pool(layout)
        scatter_pages(pool, ids, store[rows])
        assert same_bytes(pool, want)
    finally:
        torch.set_num_threads(threads)
