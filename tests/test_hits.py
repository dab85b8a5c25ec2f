"""Where hits come from: the HitBook's bounds and sums (hypothesis, against a plain model),
a TieredManager's allocation naming the tier that brought each run of pages up, and a
real daemon with a host tier answering it on the wire, in ``stats`` (per namespace, as
far as a grant sees) and on /metrics (hit tokens by medium, promotion latency)."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from kvcore import Client
from kvcore.daemon.tiering import TieredManager
from kvcore.daemon_process import DaemonProcess
from kvcore.hits import BUSIEST, MAX_NAMESPACES, OTHER_NAMESPACE, HitBook
from kvcore.layout import KVLayout
from kvcore.prefix import KeySpace, PrefixKey
from kvcore.tiers import DiskTier, HostTier, TierStack

PAGE = 2
LAYOUT = KVLayout(
    num_layers=2, num_kv_heads=1, head_dim=4, page_size=PAGE, dtype="float32", num_pages=6
)


# -- the book ------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 80), st.integers(0, 40), st.integers(0, 30)), max_size=120)
)
def test_the_book_adds_up_and_stays_bounded(records: list[tuple[int, int, int]]) -> None:
    """Totals are exact; the first MAX_NAMESPACES namespaces are exact by name, the
    rest add up under OTHER_NAMESPACE; at most BUSIEST prefixes are kept."""
    book = HitBook()
    first_seen: list[str] = []
    exact: dict[str, list[int]] = {}
    for ns_id, query, key_id in records:
        ns, hit = f"ns{ns_id}", min(query, key_id)
        book.record(ns, query, hit, PrefixKey(key_id.to_bytes(32, "big")) if hit else None)
        if ns not in first_seen:
            first_seen.append(ns)
        row = exact.setdefault(ns, [0, 0])
        row[0] += query
        row[1] += hit
        book.check_integrity()
    assert book.query_tokens == sum(q for q, _ in exact.values())
    named = first_seen[:MAX_NAMESPACES]
    for ns in named:
        count = book.namespaces[ns]
        assert [count.query_tokens, count.hit_tokens] == exact[ns]
    rest = [exact[ns] for ns in first_seen[MAX_NAMESPACES:] if ns != OTHER_NAMESPACE]
    if rest:
        other = book.namespaces[OTHER_NAMESPACE]
        assert other.query_tokens == sum(q for q, _ in rest)
    assert len(book.busiest) <= BUSIEST


def test_the_busiest_prefix_stays_on_top_of_many_one_off_hits() -> None:
    book = HitBook()
    hot = PrefixKey(b"\x01" * 32)
    for i in range(10 * BUSIEST):
        book.record("a", 8, 4, hot)
        book.record("b", 8, 2, PrefixKey(i.to_bytes(32, "big")))  # each once: churn
    assert len(book.busiest) == BUSIEST
    top = max(book.busiest.items(), key=lambda kv: kv[1].hit_tokens)
    assert top[0] == hot and top[1].hits == 10 * BUSIEST and top[1].namespace == "a"


# -- a TieredManager -------------------------------------------------------------------


def _serve(manager: TieredManager, seq: int, tokens: list[int]) -> list[tuple[str, int]]:
    """Allocate, commit and free; the allocation's sources (num_cached checked against them)."""
    got = manager.allocate(seq, tokens)
    if got.sources:
        assert sum(n for _, n in got.sources) == got.num_cached_tokens
    manager.commit(seq, tokens)
    manager.free(seq)
    return got.sources


@pytest.mark.parametrize("medium", ["host", "disk"])
def test_an_allocation_names_the_tier_that_brought_its_pages_up(
    tmp_path: Path, medium: str
) -> None:
    memory = torch.zeros(LAYOUT.total_bytes, dtype=torch.uint8)
    if medium == "host":
        stack = TierStack(HostTier(LAYOUT, 16, eviction="lru"))
    else:
        stack = TierStack(disk=DiskTier(LAYOUT, tmp_path / "disk", 16 * (LAYOUT.page_bytes + 80)))
    # LRU: the adaptive default would rightly keep the twice-hit prompt in the pool
    manager = TieredManager(LAYOUT, memory, stack, eviction="lru")
    first = list(range(1, 2 * PAGE + 2))  # two full pages and one token
    try:
        assert _serve(manager, 0, first) == []  # a miss
        assert _serve(manager, 1, first) == []  # a pool hit: no tier involved
        for i in range(LAYOUT.num_pages):  # push the first prompt's pages out of the pool
            _serve(manager, 10 + i, [100 + i] * (2 * PAGE + 1))
        assert _serve(manager, 2, first) == [("pool", 0), (medium, 2 * PAGE)]
        split = manager.hits.namespaces["default"].by_medium()
        assert split[medium] == 2 * PAGE and split["pool"] == 2 * PAGE
        took = manager.promotions[medium]
        assert sum(took.counts) == 1 and took.sum_s > 0
        manager.check_integrity()
    finally:
        stack.close()


# -- a real daemon ---------------------------------------------------------------------

DAEMON_POOL = (
    "num_layers=2,num_kv_heads=1,head_dim=8,page_size=4,dtype=float32,num_pages=8,eviction=lru,"
    f"host_tier={64 * 2 * 2 * 4 * 8 * 4}"
)


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with DaemonProcess.private("--pool", DAEMON_POOL, "--metrics-port", "0") as d:
        yield d


def _scrape(daemon: DaemonProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    line = next(ln for ln in daemon.lines if ln.startswith("  metrics: "))
    base = line.split()[1].removesuffix("/metrics").rstrip(",")
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_a_daemon_reports_hits_by_tier_on_the_wire_in_stats_and_on_metrics(
    daemon: DaemonProcess,
) -> None:
    prompt = [7 + t for t in range(3 * 4 + 1)]  # three full pages and one token
    with Client.connect(daemon.endpoint, namespace="app", map_memory=False) as client:
        for seq in (1, 2):
            client.allocate(seq, prompt)
            client.commit(seq, prompt)
            client.free(seq)
        for i in range(8):  # the pool's 8 pages over: the prompt's go to the host tier
            other = [1000 * (i + 1) + t for t in range(3 * 4 + 1)]
            client.allocate(10 + i, other, KeySpace("other"))
            client.commit(10 + i, other)
            client.free(10 + i)
        again = client.allocate(3, prompt)
        assert again.num_cached_tokens == 12
        assert again.sources == [("pool", 0), ("host", 12)]
        stats = client.daemon_stats()
    (pool,) = stats.pools
    rows = {row.namespace: row for row in pool.namespaces}
    assert rows["app"].hit_tokens == {"pool": 12, "host": 12}
    assert rows["app"].query_tokens == 3 * len(prompt)
    assert rows["other"].hit_tokens == {}
    assert pool.busiest and pool.busiest[0].namespace == "app" and pool.busiest[0].hits == 2
    (host,) = pool.tiers
    assert (
        sum(host.promote_counts) == 1 and len(host.promote_counts) == len(host.promote_bounds_s) + 1
    )
    samples = _scrape(daemon)
    app = (("namespace", "app"), ("pool", "default"))
    for medium in ("host", "pool"):
        assert samples["kvcore_hits_tokens_total", (("medium", medium), *app)] == 12
    assert samples["kvcore_namespace_queries_tokens_total", app] == 3 * len(prompt)
    count = ("kvcore_tier_promotion_seconds_count", (("medium", "host"), ("pool", "default")))
    assert samples[count] == 1
