"""The metrics endpoint: a real daemon scraped over HTTP on loopback, its figures held
against ``stats``; /health follows the loop; errors by code include failed batch ops;
the daemon's logs (attach, detach, refusals; JSON lines)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvcore import Client
from kvcore.config import PoolConfig, ServiceConfig
from kvcore.daemon.serve import Daemon
from kvcore.daemon_process import DaemonProcess
from kvcore.errors import BadRequest, QuotaExceeded, UnknownSequence

POOL = (
    "name=default,num_layers=2,num_kv_heads=2,head_dim=16,page_size=4,num_pages=64,"
    "session_max_sequences=3"
)


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with DaemonProcess.private("--pool", POOL, "--metrics-port", "0", "--log-format", "json") as d:
        yield d


def _url(daemon: DaemonProcess) -> str:
    line = next(ln for ln in daemon.lines if ln.startswith("  metrics: "))
    return line.split()[1].removesuffix("/metrics").rstrip(",")


def scrape(base: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of one scrape: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_scrape_matches_stats(daemon: DaemonProcess) -> None:
    base = _url(daemon)
    assert base.startswith("http://127.0.0.1:")  # loopback by default
    prompt = list(range(40))
    with Client.connect(daemon.endpoint, namespace="app", map_memory=False) as client:
        client.allocate(1, prompt)
        client.commit(1, prompt)
        client.free(1)
        client.allocate(2, prompt)  # a hit: 36 tokens of 10 pages
        client.fork(2, 3)
        with pytest.raises(UnknownSequence):
            client.free(99)
        with pytest.raises(UnknownSequence), client.batch() as step:
            step.extend(2, 1)
            step.free(98)  # fails inside the batch: counted too
        stats = client.daemon_stats()
        m = scrape(base)
    pool = stats.pools[0]
    lab = (("pool", "default"),)
    for state, want in (
        ("free", pool.free_pages),
        ("evictable", pool.evictable_pages),
        ("held", pool.held_pages),
    ):
        assert m["kvcore_pool_pages", (*lab, ("state", state))] == want
    assert m["kvcore_pool_capacity_pages", lab] == pool.total_pages == 64
    assert m["kvcore_pool_cached_pages", lab] == pool.cached_pages
    assert m["kvcore_pool_sequences", lab] == pool.num_sequences == 2
    assert m["kvcore_pool_usage_ratio", lab] == pytest.approx(pool.held_pages / 64)
    assert m["kvcore_prefix_cache_queries_tokens_total", lab] == pool.query_tokens == 80
    assert m["kvcore_prefix_cache_hits_tokens_total", lab] == pool.hit_tokens == 36
    assert m["kvcore_evictions_pages_total", lab] == pool.evictions
    assert m["kvcore_errors_total", (("code", "unknown_sequence"),)] == 2
    assert stats.counters.errors == 2  # the failed op inside the batch counts too
    assert m["kvcore_lease_expiries_total", ()] == stats.counters.expired_sessions
    ns = (("namespace", "app"), ("pool", "default"))
    assert m["kvcore_sessions", ns] == 1
    assert m["kvcore_namespace_sequences", ns] == 2
    assert m["kvcore_namespace_pages", ns] == 11 + 10  # seq 2: 41 tokens (extended); 3: 40
    assert m["kvcore_request_duration_seconds_count", (("op", "allocate"),)] >= 2
    assert m["kvcore_daemon_info", (("epoch", f"{stats.counters.epoch:x}"), ("version", "1"))]
    with urllib.request.urlopen(f"{base}/health", timeout=10) as reply:
        assert reply.status == 200


def test_logs_are_json_lines_with_attach_detach_and_refusals(daemon: DaemonProcess) -> None:
    with Client.connect(daemon.endpoint, map_memory=False, name="logged") as client:
        for seq in range(3):
            client.allocate(seq, [1, 2, 3])
        with pytest.raises(QuotaExceeded):
            client.allocate(3, [1, 2, 3])
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not any("detached" in ln for ln in daemon.lines):
        time.sleep(0.05)
    records = [json.loads(ln) for ln in daemon.lines if ln.startswith("{")]
    messages = [r["message"] for r in records]
    assert any("pool 'default' created" in m for m in messages)
    assert any("attached" in m and "'logged'" in m for m in messages)
    assert any("detached" in m for m in messages)
    assert any(r["level"] == "WARNING" and "quota_exceeded" in r["message"] for r in records)
    assert {"time", "level", "logger", "message"} <= records[0].keys()


def test_health_fails_when_the_loop_is_stuck(tmp_path: Path) -> None:
    """An in-process daemon whose loop never turns: /health goes 503 past the bound,
    and 200 again once the loop ticks."""
    config = ServiceConfig(
        endpoint=f"ipc://{tmp_path}/k.sock",
        metrics_port=0,
        pools=[PoolConfig(num_layers=1, num_pages=8)],
    )
    daemon = Daemon(config)
    try:
        assert daemon.metrics_server is not None
        daemon.metrics_server.stale_after_s = 0.2
        base = daemon.metrics_server.url
        time.sleep(0.3)
        with pytest.raises(urllib.error.HTTPError) as stuck:
            urllib.request.urlopen(f"{base}/health", timeout=10)
        assert stuck.value.code == 503
        daemon.tick()
        with urllib.request.urlopen(f"{base}/health", timeout=10) as reply:
            assert reply.status == 200
    finally:
        daemon.close()


def test_a_taken_metrics_port_is_refused_by_name(tmp_path: Path) -> None:
    pools = [PoolConfig(num_layers=1, num_pages=8)]
    first = Daemon(ServiceConfig(endpoint=f"ipc://{tmp_path}/a.sock", metrics_port=0, pools=pools))
    try:
        assert first.metrics_server is not None
        port = first.metrics_server.port
        taken = ServiceConfig(endpoint=f"ipc://{tmp_path}/b.sock", metrics_port=port, pools=pools)
        with pytest.raises(BadRequest, match=f"--metrics-port {port} on 127.0.0.1"):
            Daemon(taken)
    finally:
        first.close()
