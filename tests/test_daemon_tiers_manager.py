"""TieredManager in-process: random engine traffic (allocate, write, extend, commit, fork,
lookup, free) over a tiny pool with host and disk tiers below it, under every eviction
policy. Every page a hit hands out holds exactly the bytes its first writer wrote, the
Manager's and every tier's invariants hold after each step, and events name the medium."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from page_bytes import BYTE_LAYOUTS, byte_pages, same_bytes
from tiered_helpers import LAYOUT, PAGE, tiered

from kvcore.daemon.tiering import TieredManager
from kvcore.errors import OutOfPages
from kvcore.eviction import POLICIES
from kvcore.layout import KVLayout
from kvcore.prefix import PageRemoved, PageStored
from kvcore.tiers import DiskTier, HostTier, TierStack, gather_pages, scatter_pages

ORDERS = ["LPKTH", "PLKTH", "PLHKT"]  # layer-major, page-major, head-outer page-major


def pattern(tokens: list[int], page: int, layer: int) -> float:
    """What the first writer of a page (content = the tokens up to its end) writes."""
    return float(hash((tuple(tokens[: (page + 1) * PAGE]), layer)) % 1_000_003)


@pytest.mark.parametrize("eviction", list(POLICIES))
@pytest.mark.parametrize("host_pages", [0, 3])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_hits_below_the_pool_return_the_written_bytes(
    host_pages: int, eviction: str, data: st.DataObject, tmp_path_factory: pytest.TempPathFactory
) -> None:
    directory = tmp_path_factory.mktemp("disk") / "tier"
    layout = dataclasses.replace(LAYOUT, order=data.draw(st.sampled_from(ORDERS)))
    pool = tiered(layout, host_pages, eviction, directory)
    manager, stack, views = pool.manager, pool.stack, pool.views
    prompts = st.lists(st.integers(0, 2), min_size=1, max_size=9)
    live: dict[int, list[int]] = {}
    try:
        for step in range(data.draw(st.integers(5, 25))):
            action = data.draw(st.sampled_from(["run", "run", "lookup", "extend"]))
            tokens = data.draw(prompts)
            if action == "lookup":
                manager.lookup(tokens)
            elif action == "extend" and live:
                seq = data.draw(st.sampled_from(sorted(live)))
                try:
                    manager.extend(seq, 1)
                    live[seq].append(0)
                except OutOfPages:
                    pass
            else:
                try:
                    got = manager.allocate(step, tokens)
                except OutOfPages:
                    continue
                cached = got.num_cached_tokens // PAGE
                if got.sources:  # the pool's run first, then the tiers' runs, adding up
                    assert got.sources[0][0] == "pool"
                    assert {m for m, _ in got.sources[1:]} <= {"host", "disk"}
                    assert sum(n for _, n in got.sources) == got.num_cached_tokens
                for n, page in enumerate(got.pages):
                    for layer, view in enumerate(views):
                        if n < cached:
                            assert float(view[page].flatten()[0]) == pattern(tokens, n, layer)
                        else:
                            view[page].fill_(pattern(tokens, n, layer))
                manager.commit(step, tokens)
                if data.draw(st.booleans()):
                    manager.free(step)
                else:
                    live[step] = list(tokens)
            manager.check_integrity()
            for event in manager.take_events():
                if isinstance(event, PageStored):
                    assert event.medium in ("", "host", "disk")
                elif isinstance(event, PageRemoved):
                    assert event.medium == ("host" if host_pages else "disk")
    finally:
        stack.close()


@pytest.mark.parametrize("medium", ["host", "disk"])
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(LAYOUT, id="float32"),
        *BYTE_LAYOUTS,
        *(pytest.param(dataclasses.replace(LAYOUT, order=o), id=o) for o in ORDERS[1:]),
        pytest.param(KVLayout(2, 2, 8, 4, "float8_e5m2", 8, order="PLHKT"), id="e5m2-PLHKT"),
    ],
)
def test_a_spilled_page_comes_back_from_a_lower_tier(
    tmp_path: Path, layout: KVLayout, medium: str
) -> None:
    """Byte for byte, every byte value (fp8 NaN and infinity patterns, latent pages), in
    every order (page-major, head-outer)."""
    memory = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    pool = layout.pages_view(memory)
    if medium == "host":
        stack = TierStack(HostTier(layout, 16))
    else:
        stack = TierStack(disk=DiskTier(layout, tmp_path / "disk", 16 * (layout.page_bytes + 80)))
    manager = TieredManager(layout, memory, stack)
    full = 2 * layout.page_size  # tokens of the two full pages a prompt commits
    first = list(range(1, full + 2))
    got = manager.allocate(0, first)
    written = byte_pages(layout, 2)
    scatter_pages(pool, got.pages[:2], written)
    manager.commit(0, first)
    manager.free(0)
    for i in range(layout.num_pages):  # push the first prompt's pages out of the pool
        manager.allocate(10 + i, [100 + i] * (full + 1))
        manager.commit(10 + i, [100 + i] * (full + 1))
        manager.free(10 + i)
    assert manager.lookup(first).num_cached_tokens == full
    again = manager.allocate(1, first)
    assert again.num_cached_tokens == full
    assert same_bytes(gather_pages(pool, again.pages[:2]), written)
    assert manager.tier_stats()[medium].hits == 2
    manager.check_integrity()
    stack.close()


def _served(layout: KVLayout, disk: Path, tokens: list[int]) -> int:
    """Tokens a fresh TieredManager of ``layout`` over disk tier ``disk`` finds cached for
    ``tokens``, after serving and closing (its pages written back to disk) once."""
    memory = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    stack = TierStack(disk=DiskTier(layout, disk, 16 * (layout.page_bytes + 80)))
    manager = TieredManager(layout, memory, stack)
    try:
        hit = manager.lookup(tokens).num_cached_tokens
        manager.allocate(0, tokens)
        manager.commit(0, tokens)
        manager.free(0)
    finally:
        manager.close()
    return hit


def test_pages_written_under_one_order_are_a_miss_for_another(tmp_path: Path) -> None:
    """The tier fingerprint holds the order: a page-major pool never reads the pages a
    layer-major pool left on a shared disk tier (its bytes are in another order)."""
    page_major = dataclasses.replace(LAYOUT, order="PLKTH")
    tokens = list(range(2 * PAGE + 1))
    assert _served(LAYOUT, tmp_path / "d", tokens) == 0
    assert _served(page_major, tmp_path / "d", tokens) == 0  # not the layer-major pages
    assert _served(LAYOUT, tmp_path / "d", tokens) == 2 * PAGE
    assert _served(page_major, tmp_path / "d", tokens) == 2 * PAGE  # its own, from before


def test_a_lookup_brings_pages_up_and_changes_no_sequence() -> None:
    memory = torch.zeros(LAYOUT.total_bytes, dtype=torch.uint8)
    manager = TieredManager(LAYOUT, memory, TierStack(HostTier(LAYOUT, 16)))
    first = [1, 2, 3, 4, 5]
    manager.allocate(0, first)
    manager.commit(0, first)
    manager.free(0)
    for i in range(3):  # push the first prompt's pages out of the pool
        manager.allocate(10 + i, [100 + i] * 5)
        manager.commit(10 + i, [100 + i] * 5)
        manager.free(10 + i)
    live = manager.allocate(20, [7])  # one live sequence, holding one page
    manager.take_events()
    before = manager.stats()
    assert manager.lookup(first).num_cached_tokens == 4  # promoted from the host tier
    after = manager.stats()
    assert manager.block_table(20) == live.pages and manager.num_tokens(20) == 1
    assert (after.held_pages, after.num_sequences) == (before.held_pages, 1)
    assert (after.query_tokens, after.hit_tokens) == (before.query_tokens, before.hit_tokens)
    promoted = [e for e in manager.take_events() if isinstance(e, PageStored)]
    assert [e.medium for e in promoted] == ["host", "host"]
    manager.check_integrity()


def test_metrics_name_each_tier_of_each_pool() -> None:
    from kvcore_ipc import messages as msg

    from kvcore.daemon.tiering import tier_metric_families

    layout = msg.PoolLayout(**LAYOUT.to_dict())
    pool = msg.PoolStats(
        name="p",
        device="cpu",
        layout=layout,
        total_pages=6,
        free_pages=6,
        evictable_pages=0,
        held_pages=0,
        cached_pages=0,
        num_sequences=0,
        query_tokens=0,
        hit_tokens=0,
        evictions=0,
        num_sessions=0,
        tiers=[
            msg.TierStats(medium="host", pages=3, hits=5, corrupt=0),
            msg.TierStats(medium="disk", pages=7, corrupt=2, evicted=4),
        ],
    )
    families = list(tier_metric_families([pool], {"p": "lru"}))
    samples = {(s.name, s.labels["medium"]): s.value for f in families for s in f.samples}
    evicted = [
        s for f in families for s in f.samples if s.name == "kvcore_tier_evicted_pages_total"
    ]
    assert {(s.labels["medium"], s.labels["policy"], s.value) for s in evicted} == {
        ("host", "lru", 0),
        ("disk", "lru", 4),
    }
    assert samples[("kvcore_tier_pages", "host")] == 3
    assert samples[("kvcore_tier_pages", "disk")] == 7
    assert samples[("kvcore_tier_hits_pages_total", "host")] == 5
    assert samples[("kvcore_tier_corrupt_pages_total", "disk")] == 2
