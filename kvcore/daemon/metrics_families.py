"""What one :class:`~kvcore.daemon.metrics.Snapshot` is exported as: the metric families.

Names are in the ``kvcore_`` namespace with their unit in the name (``_pages``,
``_tokens``, ``_seconds``); counters end in ``_total`` (prometheus_client adds it).
Namespaces appear only as the ``namespace`` label of ``kvcore_sessions``,
``kvcore_namespace_pages`` and ``kvcore_namespace_sequences``, which
``namespace_labels=False`` drops (docs/deploy.md). Pure functions of the snapshot:
the HTTP thread calls them, never the loop.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvcore_ipc import messages as msg
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .metrics import Snapshot
from .tiering import tier_metric_families


def snapshot_families(snap: Snapshot, *, namespace_labels: bool = True) -> Iterator[Metric]:
    """Every family of one snapshot. Without ``namespace_labels`` no sample names a
    namespace: sessions are counted by pool, and the per-namespace families are left out."""
    yield from _daemon_families(snap)
    yield from _pool_families(snap.stats.pools, snap.eviction)
    yield from tier_metric_families(snap.stats.pools, snap.eviction)  # the pools' lower tiers
    yield from _session_families(snap, namespace_labels)
    yield from _hit_families(snap.stats.pools, namespace_labels)


def _daemon_families(snap: Snapshot) -> Iterator[Metric]:
    c = snap.stats.counters
    info = GaugeMetricFamily(
        "kvcore_daemon_info",
        "The daemon's protocol version and epoch (hex)",
        labels=["version", "epoch"],
    )
    info.add_metric([str(c.version), f"{c.epoch:x}"], 1)
    yield info
    yield GaugeMetricFamily(
        "kvcore_uptime_seconds", "Seconds since the daemon started", value=c.uptime_s
    )
    yield CounterMetricFamily("kvcore_requests", "Requests answered", value=c.requests)
    errors = CounterMetricFamily(
        "kvcore_errors",
        "Requests answered with an error, and failed ops inside batches, by error code",
        labels=["code"],
    )
    for code, count in sorted(snap.errors.items()):
        errors.add_metric([code], count)
    yield errors
    yield CounterMetricFamily(
        "kvcore_dropped_frames",
        "Frames of a shape the daemon cannot answer, dropped",
        value=c.dropped_frames,
    )
    yield CounterMetricFamily(
        "kvcore_lease_expiries", "Sessions whose lease ran out", value=c.expired_sessions
    )


def _session_families(snap: Snapshot, namespace_labels: bool) -> Iterator[Metric]:
    """Live sessions by pool (and namespace); what each namespace holds, if labelled."""
    if not namespace_labels:
        by_pool = GaugeMetricFamily("kvcore_sessions", "Live sessions, by pool", labels=["pool"])
        pools: dict[str, int] = {}
        for s in snap.stats.sessions:
            pools[s.pool] = pools.get(s.pool, 0) + 1
        for pool, count in sorted(pools.items()):
            by_pool.add_metric([pool], count)
        yield by_pool
        return
    sessions = GaugeMetricFamily(
        "kvcore_sessions", "Live sessions, by pool and namespace", labels=["pool", "namespace"]
    )
    counts: dict[tuple[str, str], int] = {}
    for s in snap.stats.sessions:
        counts[s.pool, s.namespace] = counts.get((s.pool, s.namespace), 0) + 1
    for (pool, namespace), count in sorted(counts.items()):
        sessions.add_metric([pool, namespace], count)
    yield sessions
    ns_pages = GaugeMetricFamily(
        "kvcore_namespace_pages",
        "Page references held by a namespace's sequences (what quotas count)",
        labels=["pool", "namespace"],
    )
    ns_seqs = GaugeMetricFamily(
        "kvcore_namespace_sequences", "Live sequences of a namespace", labels=["pool", "namespace"]
    )
    for u in snap.namespaces:
        ns_pages.add_metric([u.pool, u.namespace], u.pages)
        ns_seqs.add_metric([u.pool, u.namespace], u.sequences)
    yield ns_pages
    yield ns_seqs


def _pool_families(pools: list[msg.PoolStats], eviction: dict[str, str]) -> Iterator[Metric]:
    labels = ["pool"]
    pages = GaugeMetricFamily(
        "kvcore_pool_pages",
        "Pages of a pool by state: free, evictable "
        "(cached, unreferenced), held (referenced by sequences), withheld (after a "
        "restart, until the last daemon's clients let go)",
        labels=["pool", "state"],
    )
    capacity = GaugeMetricFamily("kvcore_pool_capacity_pages", "Pages in the pool", labels=labels)
    cached = GaugeMetricFamily(
        "kvcore_pool_cached_pages", "Pages in the prefix index", labels=labels
    )
    usage = GaugeMetricFamily(
        "kvcore_pool_usage_ratio",
        "Held pages / pages (as vLLM's kv_cache_usage counts: evictable pages are free to take)",
        labels=labels,
    )
    seqs = GaugeMetricFamily("kvcore_pool_sequences", "Live sequences", labels=labels)
    queries = CounterMetricFamily(
        "kvcore_prefix_cache_queries_tokens",
        "Prompt tokens looked up by successful allocations (vLLM's prefix_cache_queries)",
        labels=labels,
    )
    hits = CounterMetricFamily(
        "kvcore_prefix_cache_hits_tokens",
        "Of those, tokens served from the prefix cache (vLLM's prefix_cache_hits)",
        labels=labels,
    )
    evictions = CounterMetricFamily(
        "kvcore_evictions_pages",
        "Cached pages evicted to make room, by the pool's eviction policy",
        labels=["pool", "policy"],
    )
    for p in pools:
        for state, count in (
            ("free", p.free_pages),
            ("evictable", p.evictable_pages),
            ("held", p.held_pages),
            ("withheld", p.withheld_pages),
        ):
            pages.add_metric([p.name, state], count)
        capacity.add_metric([p.name], p.total_pages)
        cached.add_metric([p.name], p.cached_pages)
        usage.add_metric([p.name], p.held_pages / p.total_pages if p.total_pages else 0.0)
        seqs.add_metric([p.name], p.num_sequences)
        queries.add_metric([p.name], p.query_tokens)
        hits.add_metric([p.name], p.hit_tokens)
        evictions.add_metric([p.name, eviction.get(p.name, "")], p.evictions)
    yield from (pages, capacity, cached, usage, seqs, queries, hits, evictions)


def _hit_families(pools: list[msg.PoolStats], namespace_labels: bool) -> Iterator[Metric]:
    """Prompt tokens asked per namespace, and hit tokens by where their pages were
    (medium: pool, host, disk, remote); without ``namespace_labels`` summed per pool."""
    ns = ["namespace"] if namespace_labels else []
    queries = CounterMetricFamily(
        "kvcore_namespace_queries_tokens",
        "Prompt tokens looked up by successful allocations, by namespace",
        labels=["pool", *ns],
    )
    hits = CounterMetricFamily(
        "kvcore_hits_tokens",
        "Prompt tokens served from the cache, by where their pages were when asked: "
        "the pool, or the lower tier that brought them up (host, disk, remote)",
        labels=["pool", *ns, "medium"],
    )
    for pool in pools:
        asked: dict[tuple[str, ...], int] = {}
        served: dict[tuple[str, ...], int] = {}
        for row in pool.namespaces:
            key = (pool.name, row.namespace) if namespace_labels else (pool.name,)
            asked[key] = asked.get(key, 0) + row.query_tokens
            for medium, tokens in row.hit_tokens.items():
                served[(*key, medium)] = served.get((*key, medium), 0) + tokens
        for labels, tokens in asked.items():
            queries.add_metric(list(labels), tokens)
        for labels, tokens in sorted(served.items()):
            hits.add_metric(list(labels), tokens)
    yield queries
    yield hits
