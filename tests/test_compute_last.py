"""``compute_last=False``: a caller that computes nothing (a storage backend moving
whole pages, kvcore.integrations.sglang) may hit every full page, the last token's
included, so an allocate of exactly a cached page's tokens pins it and takes no
page. The default keeps the engine's rule: a hit never covers the last token. The
hypothesis state machine (kvcore.testing.manager) draws both for every subject."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvcore import Client
from kvcore.daemon.tiering import TieredManager
from kvcore.daemon_process import DaemonProcess
from kvcore.layout import KVLayout
from kvcore.manager import Manager
from kvcore.tiers import HostTier, TierStack

PAGE = 4
LAYOUT = KVLayout(1, 1, 4, PAGE, "float32", 8)
TWO_PAGES = list(range(10, 10 + 2 * PAGE))  # exactly two full pages, no token after


def stored(manager: Manager | TieredManager | Client, seq: int, tokens: list[int]) -> None:
    manager.allocate(seq, tokens)
    manager.commit(seq, tokens)
    manager.free(seq)


def test_a_store_pins_exactly_the_cached_pages_and_takes_none() -> None:
    manager = Manager(LAYOUT)
    stored(manager, 1, TWO_PAGES)
    free_before = manager.stats().free_pages
    assert manager.lookup(TWO_PAGES).num_cached_tokens == PAGE  # the engine's rule
    assert manager.lookup(TWO_PAGES, compute_last=False).num_cached_tokens == 2 * PAGE
    engine = manager.allocate(2, TWO_PAGES)
    assert engine.num_cached_tokens == PAGE and len(engine.pages) == 2  # one fresh page
    manager.free(2)
    store = manager.allocate(3, TWO_PAGES, compute_last=False)
    assert store.num_cached_tokens == 2 * PAGE
    assert manager.stats().free_pages == free_before  # pinned the two, took nothing
    assert manager.stats().evictable_pages == 0  # pinned pages are off the LRU
    manager.free(3)
    assert manager.stats().evictable_pages == 2
    manager.check_integrity()


def test_a_store_misses_like_an_engine_where_nothing_is_cached() -> None:
    manager = Manager(LAYOUT)
    fresh = manager.allocate(1, TWO_PAGES, compute_last=False)
    assert fresh.num_cached_tokens == 0 and len(fresh.pages) == 2
    manager.commit(1, TWO_PAGES)
    manager.free(1)
    partial = TWO_PAGES[:PAGE] + [99] * PAGE  # first page cached, second not
    hit = manager.allocate(2, partial, compute_last=False)
    assert hit.num_cached_tokens == PAGE and len(hit.pages) == 2
    manager.free(2)
    manager.check_integrity()


def test_a_store_brings_pages_back_from_a_lower_tier() -> None:
    """The tiered pool promotes the last full page too when the caller computes nothing."""
    small = KVLayout(1, 1, 4, PAGE, "float32", 2)
    memory = torch.zeros(small.total_bytes, dtype=torch.uint8)
    manager = TieredManager(small, memory, TierStack(HostTier(small, 8)))
    stored(manager, 1, TWO_PAGES)
    stored(manager, 2, [500] * (2 * PAGE))  # pushes both pages into the host tier
    assert manager.manager.lookup(TWO_PAGES, compute_last=False).num_cached_tokens == 0
    assert manager.lookup(TWO_PAGES, compute_last=False).num_cached_tokens == 2 * PAGE
    stored(manager, 3, [600] * (2 * PAGE))  # and out again
    got = manager.allocate(4, TWO_PAGES, compute_last=False)
    assert got.num_cached_tokens == 2 * PAGE and len(got.pages) == 2
    manager.free(4)
    manager.check_integrity()
    manager.close()


POOL = f"name=default,num_layers=1,num_kv_heads=1,head_dim=4,page_size={PAGE},dtype=float32,num_pages=8"


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with DaemonProcess.private("--pool", POOL) as d:
        yield d


def test_compute_last_over_the_wire(daemon: DaemonProcess) -> None:
    with Client.connect(daemon.endpoint, map_memory=False) as writer:
        stored(writer, 1, TWO_PAGES)
    with Client.connect(daemon.endpoint, map_memory=False) as reader:
        assert reader.lookup(TWO_PAGES).num_cached_tokens == PAGE
        assert reader.lookup(TWO_PAGES, compute_last=False).num_cached_tokens == 2 * PAGE
        batch = reader.batch()
        batch.allocate(2, TWO_PAGES, compute_last=False)
        batch.lookup(TWO_PAGES, compute_last=False)
        got, hit = batch.run()
        assert got.num_cached_tokens == 2 * PAGE and hit.num_cached_tokens == 2 * PAGE
        reader.free(2)
