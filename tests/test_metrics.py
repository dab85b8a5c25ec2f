"""The metrics endpoint: a real daemon scraped over HTTP on loopback, its figures held
against ``stats``; /health follows the loop; errors by code include failed batch ops;
the daemon's logs (attach, detach, refusals; JSON lines). The HTTP side's bounds (a
deadline per connection, a bound on connections, one snapshot per interval) and what
keeps the figures from other users (a bearer token, a private unix socket, no
namespace labels)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvcore_ipc import messages as msg
from prometheus_client.parser import text_string_to_metric_families

from kvcore import Client
from kvcore.config import PoolConfig, ServiceConfig
from kvcore.daemon import metrics_server
from kvcore.daemon.metrics import (
    SCRAPE_WAIT_S,
    SNAPSHOT_MIN_INTERVAL_S,
    Exchange,
    Snapshot,
)
from kvcore.daemon.metrics_http import HttpLimits, read_token
from kvcore.daemon.metrics_server import MetricsServer
from kvcore.daemon.serve import Daemon
from kvcore.daemon_process import DaemonProcess
from kvcore.errors import BadRequest, QuotaExceeded, UnknownSequence
from kvcore.eviction import DEFAULT as DEFAULT_EVICTION

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
        ("withheld", pool.withheld_pages),
    ):
        assert m["kvcore_pool_pages", (*lab, ("state", state))] == want
    assert m["kvcore_pool_capacity_pages", lab] == pool.total_pages == 64
    assert m["kvcore_pool_cached_pages", lab] == pool.cached_pages
    assert m["kvcore_pool_sequences", lab] == pool.num_sequences == 2
    assert m["kvcore_pool_usage_ratio", lab] == pytest.approx(pool.held_pages / 64)
    assert m["kvcore_prefix_cache_queries_tokens_total", lab] == pool.query_tokens == 80
    assert m["kvcore_prefix_cache_hits_tokens_total", lab] == pool.hit_tokens == 36
    policy = (("policy", DEFAULT_EVICTION), ("pool", "default"))  # which policy evicted them
    assert m["kvcore_evictions_pages_total", policy] == pool.evictions
    assert m["kvcore_errors_total", (("code", "unknown_sequence"),)] == 2
    assert stats.counters.errors == 2  # the failed op inside the batch counts too
    assert m["kvcore_lease_expiries_total", ()] == stats.counters.expired_sessions
    ns = (("namespace", "app"), ("pool", "default"))
    assert m["kvcore_sessions", ns] == 1
    assert m["kvcore_namespace_sequences", ns] == 2
    assert m["kvcore_namespace_pages", ns] == 11 + 10  # seq 2: 41 tokens (extended); 3: 40
    assert m["kvcore_request_duration_seconds_count", (("op", "allocate"),)] >= 2
    assert m[
        "kvcore_daemon_info",
        (("epoch", f"{stats.counters.epoch:x}"), ("version", str(msg.PROTOCOL_VERSION))),
    ]
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
        restore=False,  # a throwaway endpoint: keep nothing in /dev/shm
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
    first = Daemon(
        ServiceConfig(
            endpoint=f"ipc://{tmp_path}/a.sock", metrics_port=0, pools=pools, restore=False
        )
    )
    try:
        assert first.metrics_server is not None
        port = first.metrics_server.port
        taken = ServiceConfig(
            endpoint=f"ipc://{tmp_path}/b.sock", metrics_port=port, pools=pools, restore=False
        )
        with pytest.raises(BadRequest, match=f"--metrics-port {port} on 127.0.0.1"):
            Daemon(taken)
    finally:
        first.close()


# --- the HTTP side's bounds, and the options that keep the figures from other users
# (issue 18 point 1; the daemon-level flood is tests/test_security_metrics.py) ---

SHORT = HttpLimits(max_connections=2, deadline_s=0.5)
COUNTERS = msg.ServerCounters(
    epoch=1, version=1, uptime_s=0.0, requests=0, errors=0, dropped_frames=0, expired_sessions=0
)


def _still_open_after(sock: socket.socket, seconds: float) -> bool:
    """Whether the server kept ``sock`` open for ``seconds`` (it closes it: recv is b'')."""
    sock.settimeout(seconds)
    try:
        return sock.recv(1024) != b""
    except TimeoutError:
        return True


@contextlib.contextmanager
def _served(tmp_path: Path, **options: Any) -> Iterator[tuple[Daemon, MetricsServer]]:
    """An in-process daemon serving its loop in a thread, and a metrics server of its
    own started with ``options`` (what the daemon's flags will pass)."""
    config = ServiceConfig(
        endpoint=f"ipc://{tmp_path}/k.sock",
        pools=[PoolConfig(num_layers=1, num_pages=64)],
        restore=False,  # a throwaway endpoint: keep nothing in /dev/shm
    )
    daemon = Daemon(config)
    exchange, daemon.handler.timer, server = metrics_server.start(**options)
    daemon.metrics = exchange
    loop = threading.Thread(target=daemon.serve, daemon=True)
    loop.start()
    try:
        yield daemon, server
    finally:
        server.close()
        daemon.stop()
        loop.join(timeout=10)
        daemon.close()


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return int(reply.status), reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _unix_get(path: str, target: str) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(path)
        s.sendall(f"GET {target} HTTP/1.0\r\nHost: localhost\r\n\r\n".encode())
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_a_partial_request_is_dropped_at_the_deadline(tmp_path: Path) -> None:
    """A request line that never ends, and one sent a byte at a time (each byte well
    within any per-read timeout), are both closed once the connection's deadline passes."""
    with _served(tmp_path, limits=SHORT) as (_, server):
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as idle:
            idle.sendall(b"GET /metr")
            started = time.monotonic()
            assert not _still_open_after(idle, 5.0)
            assert 0.3 < time.monotonic() - started < 3.0
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as drip:
            started = time.monotonic()
            with contextlib.suppress(OSError):  # the server closed it
                for byte in b"GET /metrics HTTP/1.1\r\nHost: x\r\n":
                    drip.send(bytes([byte]))
                    time.sleep(0.1)
            assert not _still_open_after(drip, 5.0)
            assert time.monotonic() - started < 3.0 + 0.1 * 33


def test_connections_past_the_bound_are_closed_at_once(tmp_path: Path) -> None:
    with _served(tmp_path, limits=SHORT) as (_, server):
        address = ("127.0.0.1", server.port)
        held = [socket.create_connection(address, timeout=5) for _ in range(2)]
        try:
            for s in held:
                s.sendall(b"GET /metrics")  # both slots taken, until the deadline
            time.sleep(0.1)
            with socket.create_connection(address, timeout=5) as extra:
                extra.settimeout(2)
                started = time.monotonic()
                assert extra.recv(1024).startswith(b"HTTP/1.1 503")
                assert time.monotonic() - started < 0.3
        finally:
            for s in held:
                s.close()
        deadline = time.monotonic() + 3  # the slots come back as their threads end
        while _get(f"{server.url}/health")[0] != 200:
            assert time.monotonic() < deadline, "the slots did not come back"
            time.sleep(0.05)


def test_scrapes_take_at_most_one_snapshot_per_interval() -> None:
    """However many scrapes, the loop takes a snapshot at most every
    SNAPSHOT_MIN_INTERVAL_S: a scraper cannot make the loop do more work."""
    taken = 0

    def take() -> Snapshot:
        nonlocal taken
        taken += 1
        return Snapshot(msg.StatsOk(pools=[], sessions=[], counters=COUNTERS), {}, [])

    exchange = Exchange()
    stop = time.monotonic() + 1.0

    def scraper() -> None:
        while time.monotonic() < stop:
            exchange.ask(SCRAPE_WAIT_S)

    scrapers = [threading.Thread(target=scraper) for _ in range(4)]
    for t in scrapers:
        t.start()
    while time.monotonic() < stop:  # the loop, ticking every millisecond
        exchange.turn(time.monotonic(), take)
        time.sleep(0.001)
    for t in scrapers:
        t.join(timeout=SCRAPE_WAIT_S + 1)
    exchange.turn(time.monotonic(), take)
    assert 1 <= taken <= 1.0 / SNAPSHOT_MIN_INTERVAL_S + 2


def test_a_bearer_token_guards_the_metrics_but_not_health(tmp_path: Path) -> None:
    token = "t0ken-" + "x" * 20
    with _served(tmp_path, token=token) as (_, server):
        status, body = _get(f"{server.url}/metrics")
        assert status == 401 and "kvcore_" not in body
        assert _get(f"{server.url}/metrics", {"Authorization": "Bearer wrong"})[0] == 401
        status, body = _get(f"{server.url}/metrics", {"Authorization": f"Bearer {token}"})
        assert status == 200 and "kvcore_pool_pages" in body
        assert _get(f"{server.url}/health")[0] == 200


def test_a_token_file_must_be_private_and_long_enough(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("s3cret-" * 4 + "\n")
    path.chmod(0o644)
    with pytest.raises(BadRequest, match="readable by others"):
        read_token(str(path))
    path.chmod(0o600)
    assert read_token(str(path)) == "s3cret-" * 4
    path.write_text("short")
    with pytest.raises(BadRequest, match="at least 16 characters"):
        read_token(str(path))


def test_without_namespace_labels_no_figure_names_a_namespace(tmp_path: Path) -> None:
    with (
        _served(tmp_path, namespace_labels=False) as (daemon, server),
        Client.connect(daemon.server.endpoint, namespace="tenant-secret", map_memory=False),
    ):
        status, body = _get(f"{server.url}/metrics")
    assert status == 200
    assert "tenant-secret" not in body and "namespace=" not in body
    m = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }
    assert m["kvcore_sessions", (("pool", "default"),)] == 1


def test_a_unix_socket_is_private_and_replaces_a_dead_ones(tmp_path: Path) -> None:
    path = str(tmp_path / "metrics.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(path)  # a killed daemon's socket: no one listens
    with _served(tmp_path, unix_path=path) as (_, server):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert server.banner().startswith(f"unix:{path} (curl --unix-socket {path} ")
        reply = _unix_get(path, "/metrics")
        assert reply.startswith(b"HTTP/1.0 200") and b"kvcore_pool_pages" in reply
        assert _unix_get(path, "/health").startswith(b"HTTP/1.0 200")
        with pytest.raises(BadRequest, match="in use"):
            metrics_server.start(unix_path=path)
    assert not os.path.exists(path)  # removed on close


AS_NOBODY = """
import os, socket, sys
os.setgid(65534)
os.setuid(65534)
s = socket.socket(socket.AF_UNIX)
s.settimeout(10)
s.connect(sys.argv[1])
try:
    s.sendall(b"GET /metrics HTTP/1.0\\r\\n\\r\\n")
    print(len(s.recv(65536)))
except (BrokenPipeError, ConnectionResetError):
    print(0)
"""


@pytest.mark.skipif(os.getuid() != 0, reason="needs root, to connect as another uid")
def test_the_unix_socket_serves_no_other_uid(tmp_path: Path) -> None:
    """Even past the file mode (widened here by hand), a peer of another uid is closed
    without a reply: the kernel's SO_PEERCRED decides."""
    base = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        base.chmod(0o711)  # others may pass through, not list or write
        path = str(base / "metrics.sock")
        with _served(tmp_path, unix_path=path):
            os.chmod(path, 0o666)
            out = subprocess.run(
                [sys.executable, "-c", AS_NOBODY, path], capture_output=True, text=True, timeout=30
            )
            assert out.returncode == 0, out.stderr
            assert out.stdout.strip() == "0"  # closed, nothing sent
            assert _unix_get(path, "/health").startswith(b"HTTP/1.0 200")  # its owner is served
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_the_flags_serve_metrics_on_a_private_socket_with_a_token_and_no_namespaces(
    tmp_path: Path,
) -> None:
    """--metrics-socket, --metrics-token-file and --no-metrics-namespace-labels reach the
    daemon: the banner names the socket, a scrape needs the token, no namespace leaks."""
    sock, token = tmp_path / "metrics.sock", tmp_path / "token"
    token.write_text("t" * 32)
    token.chmod(0o600)
    flags = ("--metrics-socket", str(sock), "--metrics-token-file", str(token))
    with DaemonProcess.private("--pool", POOL, *flags, "--no-metrics-namespace-labels") as daemon:
        assert f"metrics: unix:{sock}" in daemon.output
        with Client.connect(daemon.endpoint, namespace="secret-tenant-name") as client:
            client.allocate(1, list(range(20)))
            assert _unix_get(str(sock), "/metrics").startswith(b"HTTP/1.0 401")
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(str(sock))
                s.sendall(
                    f"GET /metrics HTTP/1.0\r\nAuthorization: Bearer {'t' * 32}\r\n\r\n".encode()
                )
                reply = b"".join(iter(lambda: s.recv(65536), b""))
        assert reply.startswith(b"HTTP/1.0 200") and b"kvcore_pool_pages" in reply
        assert b"secret-tenant-name" not in reply


def test_the_request_path_never_imports_prometheus() -> None:
    """The handler and the daemon load prometheus_client only when metrics are on
    (kvcore.daemon.metrics_server.start)."""
    code = (
        "import sys, kvcore.daemon.handler, kvcore.daemon.daemon; "
        "print(sorted(m for m in sys.modules if m.startswith('prometheus_client')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
