"""TieredManager's one-page chains (SGLang's storage): random traffic of allocate_pages
(write the fresh pages, read the hits), commit_pages, free and lookup_pages over a tiny
pool with host and disk tiers below it, under every eviction policy and several pool
orders. Every hit holds exactly the bytes its first writer wrote, ``media`` says where
it was, the Manager's and every tier's invariants hold after each step, and events name
the medium. Manager.adopt_pages on its own: what it pins and what it refuses."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiered_helpers import LAYOUT, PAGE, tiered

from kvcore.daemon.tiering import TieredManager
from kvcore.errors import BadRequest, OutOfPages
from kvcore.eviction import POLICIES
from kvcore.manager import Manager
from kvcore.prefix import PageRemoved, PageStored
from kvcore.tiers import HostTier, TierStack

ORDERS = ["LPKTH", "PKTLH", "PKLTH", "PKHTL"]  # layer-major and SGLang's page-major ones


def value(chain: tuple[int, ...], layer: int) -> float:
    """What the first writer of one-page chain ``chain`` writes into ``layer``."""
    return float(hash((chain, layer)) % 1_000_003)


@pytest.mark.parametrize("eviction", list(POLICIES))
@pytest.mark.parametrize("host_pages", [0, 3])
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_pages_below_the_pool_come_back_with_their_bytes(
    host_pages: int, eviction: str, data: st.DataObject, tmp_path_factory: pytest.TempPathFactory
) -> None:
    directory = tmp_path_factory.mktemp("disk") / "tier"
    layout = dataclasses.replace(LAYOUT, order=data.draw(st.sampled_from(ORDERS)))
    pool = tiered(layout, host_pages, eviction, directory)
    manager, stack, views = pool.manager, pool.stack, pool.views
    chains = st.lists(st.tuples(st.integers(0, 5), st.integers(0, 1)), min_size=1, max_size=4)
    written: set[tuple[int, ...]] = set()  # chains committed at least once
    try:
        for step in range(data.draw(st.integers(5, 25))):
            pages = data.draw(chains)
            tokens = [t for chain in pages for t in chain]
            if data.draw(st.integers(0, 3)) == 0:
                found = manager.lookup_pages(tokens)
                assert all(found[i] <= (c in written) for i, c in enumerate(pages))
                manager.check_integrity()
                continue
            try:
                got = manager.allocate_pages(step, tokens)
            except OutOfPages:
                continue
            assert not got.media or len(got.media) == len(pages)
            for i, (chain, page, hit) in enumerate(zip(pages, got.pages, got.hits, strict=True)):
                medium = got.media[i] if got.media else ("pool" if hit else "")
                assert medium == "" if not hit else medium in ("pool", "host", "disk")
                for layer, view in enumerate(views):
                    if hit:  # whoever wrote it first, and whichever tier kept it since
                        assert chain in written
                        assert float(view[page].flatten()[0]) == value(chain, layer)
                    else:
                        view[page].fill_(value(chain, layer))
            manager.commit_pages(step, tokens)
            written.update(pages)
            manager.free(step)
            manager.check_integrity()
            for event in manager.take_events():
                if isinstance(event, PageStored):
                    assert event.medium in ("", "host", "disk")
                elif isinstance(event, PageRemoved):
                    assert event.medium == ("host" if host_pages else "disk")
    finally:
        stack.close()


def test_a_page_pushed_down_comes_back_from_the_host_tier() -> None:
    """A chain evicted into the host tier is a hit of allocate_pages again, from "host",
    with its bytes; a chain no tier holds stays fresh."""
    layout = dataclasses.replace(LAYOUT, order="PKTLH")
    memory = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    views = layout.layer_views(memory)
    stack = TierStack(HostTier(layout, 16))
    manager = TieredManager(layout, memory, stack)
    first = [1, 1, 2, 2]
    got = manager.allocate_pages(0, first)
    for page, chain in zip(got.pages, [(1, 1), (2, 2)], strict=True):
        views[1][page].fill_(value(chain, 1))
    manager.commit_pages(0, first)
    manager.free(0)
    for i in range(3):  # 6 other chains: the pool's 6 pages, the first two pushed down
        other = [10 + i, 10 + i, 20 + i, 20 + i]
        manager.allocate_pages(10 + i, other)
        manager.commit_pages(10 + i, other)
        manager.free(10 + i)
    assert manager.manager.lookup_pages(first) == [False, False]  # not in the pool
    again = manager.allocate_pages(1, [*first, 7, 7])
    assert again.hits == [True, True, False] and again.media == ["host", "host", ""]
    assert [float(views[1][p].flatten()[0]) for p in again.pages[:2]] == [
        value((1, 1), 1),
        value((2, 2), 1),
    ]
    assert stack.stats()["host"].hits == 2
    assert manager.hits.namespaces["default"].lower == {"host": 2 * PAGE}
    manager.free(1)
    manager.check_integrity()


def test_adopt_pages_pins_the_calls_pages_and_refuses_indexed_chains() -> None:
    manager = Manager(dataclasses.replace(LAYOUT, num_pages=3))
    manager.allocate_pages(0, [1, 1, 2, 2])
    manager.commit_pages(0, [1, 1, 2, 2])
    manager.free(0)  # two cached, evictable pages; one free
    tokens = [1, 1, 3, 3, 4, 4, 2, 2]
    with pytest.raises(BadRequest):
        manager.adopt_pages(tokens, [0])  # (1, 1) is indexed
    with pytest.raises(BadRequest):
        manager.adopt_pages(tokens, [1, 1])
    with pytest.raises(BadRequest):
        manager.adopt_pages(tokens, [4])
    # room for one beside the call's two pinned pages: the first chain asked for
    assert len(manager.adopt_pages(tokens, [2, 1], medium="host")) == 1
    assert manager.lookup_pages(tokens) == [True, False, True, True]
    assert manager.stats().evictions == 0
    manager.check_integrity()
