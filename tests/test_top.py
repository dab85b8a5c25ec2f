"""``kvcore top``: the rates between two stats replies are exact (hit rate over the
interval, evictions/s, tier bandwidth, promotion latency, the per-namespace split by
source); against a real daemon serving two namespaces, ``--once`` prints a frame a pipe
can read; with no daemon it says so in one line and exits 1; live, it survives the
daemon going away and exits 0 on Ctrl-C."""

from __future__ import annotations

import io
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvcore_ipc import messages as msg
from rich.console import Console

from kvcore import Client
from kvcore.daemon_process import DaemonProcess
from kvcore.top import render
from kvcore.top_rates import Frame, NamespaceSessions, PrefixRow, ProcessRow, frame

LAYOUT = msg.PoolLayout(
    num_layers=2, num_kv_heads=2, head_dim=16, page_size=4, dtype="bfloat16", num_pages=64
)
POOL = (
    "name=default,num_layers=2,num_kv_heads=2,head_dim=16,page_size=4,num_pages=16,host_tier=64KiB"
)
TOP = [sys.executable, "-m", "kvcore.cli", "top"]


def reply(
    *,
    uptime_s: float,
    requests: int,
    query: int,
    hit: int,
    evictions: int,
    tier: msg.TierStats,
    namespaces: list[msg.NamespaceHits],
    busiest: list[msg.PrefixHeat],
    epoch: int = 0xABC,
) -> msg.StatsOk:
    pool = msg.PoolStats(
        name="default",
        device="cpu",
        layout=LAYOUT,
        total_pages=64,
        free_pages=16,
        evictable_pages=32,
        held_pages=16,
        cached_pages=40,
        num_sequences=3,
        query_tokens=query,
        hit_tokens=hit,
        evictions=evictions,
        num_sessions=3,
        tiers=[tier],
        namespaces=namespaces,
        busiest=busiest,
    )
    sessions = [
        msg.SessionStats("default", "alpha", 10, "eng", 2, 5),
        msg.SessionStats("default", "beta", 10, "eng", 1, 50),
        msg.SessionStats("default", "alpha", 11, "other", 0, 1000),
    ]
    counters = msg.ServerCounters(epoch, 2, uptime_s, requests, 1, 0, 2)
    return msg.StatsOk([pool], sessions, counters)


A, B, C, D = (bytes([n]) * 32 for n in (0xAA, 0xBB, 0xCC, 0xDD))
# Over the 2 s between them: alpha asked 400 tokens, hit 100 in the pool and 200 brought up
# from host; beta asked 300, hit 150 from disk; gamma (new) asked 100, hit none. The pool:
# 800 asked, 450 hit; 20 pages evicted; the host tier read 8 pages back (8 KiB) and
# spilled 4 (4 KiB), and 3 promotions took 0.75 s together.
PREV = reply(
    uptime_s=10.0,
    requests=100,
    query=1000,
    hit=400,
    evictions=10,
    tier=msg.TierStats(
        "host",
        pages=6,
        bytes_used=6144,
        hits=2,
        stored=6,
        bytes_in=6144,
        bytes_out=2048,
        promote_bounds_s=[0.1, 1.0],
        promote_counts=[1, 0, 0],
        promote_s=0.5,
    ),
    namespaces=[
        msg.NamespaceHits("alpha", 600, {"pool": 200, "host": 100}),
        msg.NamespaceHits("beta", 400, {"pool": 100}),
    ],
    busiest=[
        msg.PrefixHeat("alpha", D, 200, 10),
        msg.PrefixHeat("alpha", A, 80, 5),
        msg.PrefixHeat("beta", B, 32, 2),
    ],
)
CUR = reply(
    uptime_s=12.0,
    requests=300,
    query=1800,
    hit=850,
    evictions=30,
    tier=msg.TierStats(
        "host",
        pages=9,
        bytes_used=9216,
        hits=10,
        stored=10,
        bytes_in=10240,
        bytes_out=10240,
        corrupt=1,
        promote_bounds_s=[0.1, 1.0],
        promote_counts=[2, 2, 0],
        promote_s=1.25,
    ),
    namespaces=[
        msg.NamespaceHits("alpha", 1000, {"pool": 300, "host": 300}),
        msg.NamespaceHits("beta", 700, {"pool": 100, "disk": 150}),
        msg.NamespaceHits("gamma", 100, {}),
    ],
    # A hit 4 more times, D not at all; C is new to the list; B's slot went to another
    # prefix and back. The daemon lists them by hit tokens since start.
    busiest=[
        msg.PrefixHeat("alpha", D, 200, 10),
        msg.PrefixHeat("alpha", A, 144, 9),
        msg.PrefixHeat("beta", C, 48, 3),
        msg.PrefixHeat("beta", B, 16, 1),
    ],
)


def test_rates_over_the_interval_are_exact() -> None:
    f = frame("ipc:///x", PREV, CUR, 2.0)
    assert f.seconds == 2.0 and f.header.requests_per_s == 100.0
    (pool,) = f.pools
    assert pool.hit_rate == 450 / 800 == 0.5625
    assert pool.hit_rate_since_start == 850 / 1800
    assert (pool.evictions_per_s, pool.query_tokens_per_s) == (10.0, 400.0)
    assert (pool.free, pool.evictable, pool.held, pool.total) == (16, 32, 16, 64)
    (tier,) = f.tiers
    assert (tier.medium, tier.pages, tier.bytes_used) == ("host", 9, 9216)
    assert (tier.hits_per_s, tier.stored_per_s) == (4.0, 2.0)  # pages per s
    assert (tier.read_bytes_per_s, tier.write_bytes_per_s) == (4096.0, 2048.0)
    assert tier.promote_mean_s == 0.75 / 3 == 0.25
    assert (tier.corrupt, tier.timeouts) == (1, 0)
    split = {n.namespace: (n.query_tokens, n.hit_tokens, n.hit_rate) for n in f.namespaces}
    assert split == {
        "alpha": (400, {"pool": 100, "host": 200}, 0.75),
        "beta": (300, {"disk": 150}, 0.5),
        "gamma": (100, {}, 0.0),
    }
    assert not any(n.since_start for n in f.namespaces)
    assert f.prefixes == [
        PrefixRow("default", "alpha", "aa" * 6, 4, 64, since_start=False),
        PrefixRow("default", "beta", "cc" * 6, 3, 48, since_start=True),
        PrefixRow("default", "beta", "bb" * 6, 1, 16, since_start=True),
        PrefixRow("default", "alpha", "dd" * 6, 0, 0, since_start=False),
    ]  # busiest first: in the interval, else since start


def test_sessions_are_grouped_by_namespace_and_by_process() -> None:
    f = frame("ipc:///x", PREV, CUR, 2.0)
    assert f.namespace_sessions == [
        NamespaceSessions("default", "alpha", sessions=2, sequences=2, processes=2),
        NamespaceSessions("default", "beta", sessions=1, sequences=1, processes=1),
    ]
    assert f.processes == [
        ProcessRow(10, "eng", ("default/alpha", "default/beta"), 2, 3, idle_ms=5),
        ProcessRow(11, "other", ("default/alpha",), 1, 0, idle_ms=1000),
    ]


def test_a_first_frame_or_a_restarted_daemon_has_no_rates() -> None:
    restarted = msg.StatsOk(CUR.pools, CUR.sessions, msg.ServerCounters(0xDEF, 2, 1.0, 5, 0, 0, 0))
    for f in (frame("ipc:///x", None, CUR, None), frame("ipc:///x", PREV, restarted, 2.0)):
        (pool,) = f.pools
        (tier,) = f.tiers
        assert f.seconds is None and f.header.requests_per_s is None
        assert (pool.hit_rate, pool.evictions_per_s, tier.read_bytes_per_s) == (None, None, None)
        assert tier.promote_mean_s is None
        assert pool.hit_rate_since_start == 850 / 1800
        assert all(n.since_start for n in f.namespaces)
        assert f.namespaces[0].query_tokens == 1000  # since start
        assert all(p.since_start for p in f.prefixes)


def shown(f: Frame) -> str:
    out = io.StringIO()
    Console(file=out, width=160).print(render(f))
    return out.getvalue()


def test_the_frame_shows_the_figures_with_their_units() -> None:
    text = shown(frame("ipc:///x", PREV, CUR, 2.0))
    assert "epoch abc" in text and "100.0 requests/s" in text and "2 lease expiries" in text
    assert "56.2%" in text and "47.2%" in text  # over the interval, since start
    assert "16 (25%)" in text and "32 (50%)" in text
    assert "4.0 KiB/s" in text and "2.0 KiB/s" in text and "250.000 ms" in text
    assert re.search(r"beta\s+300\s+0\s+0\s+150\s+50\.0%", text), text  # pool, host, disk
    assert "aaaaaaaaaaaa" in text and "last 2.0 s" in text and "since start" in text
    first = shown(frame("ipc:///x", None, CUR, None))
    assert "rates: since start" in first and re.search(r"default\s+64\s.*\s-\s", first)


def serve(client: Client, seq: int, i: int) -> None:
    """An engine's request of prompt i: allocate, commit, free (13 tokens: 3 full pages)."""
    tokens = [1000 * (i + 1) + t for t in range(13)]
    client.allocate(seq, tokens)
    client.commit(seq, tokens)
    client.free(seq)


def test_once_against_a_real_daemon_prints_a_frame_a_pipe_can_read() -> None:
    with (
        DaemonProcess.private("--pool", POOL) as daemon,
        Client.connect(daemon.endpoint, namespace="alpha", name="engine-a") as a,
        Client.connect(daemon.endpoint, namespace="beta", name="engine-b") as b,
    ):
        command = [*TOP, "--once", "--interval", "0.2", "--endpoint", daemon.endpoint]
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # 10 prompts of 3 pages cycle through a 16-page pool: hits come up from the host tier
        n, deadline = 0, time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            for client in (a, b):
                serve(client, n, n % 10)
            n += 1
        out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert "\x1b[" not in out and "Traceback" not in err  # plain text in a pipe
    assert f"kvcore top: {daemon.endpoint}" in out and "(rates: last 0." in out
    pool_row = re.search(r"^default\s+16\s.*$", out, re.M)
    assert pool_row is not None and re.search(r"\d+\.\d%\s+\d+\.\d%", pool_row[0]), out
    for namespace in ("alpha", "beta"):
        assert re.search(rf"^default\s+{namespace}\s+\d+.*\d+\.\d%$", out, re.M), out
    assert re.search(r"^default\s+host\s+\d+", out, re.M), out
    assert re.search(rf"^{os.getpid()}\s+engine-a\s+default/alpha", out, re.M), out


def test_no_daemon_is_one_line_and_exit_1(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path / 'nobody.sock'}"
    command = [*TOP, "--once", "--endpoint", endpoint, "--timeout", "0.3"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    assert done.returncode == 1 and done.stdout == ""
    assert (
        done.stderr
        == f"kvcore top: no daemon answers on {endpoint} — start one with `kvcore serve`\n"
    )


def test_live_view_survives_the_daemon_going_away_and_exits_0_on_ctrl_c() -> None:
    daemon = DaemonProcess.private("--pool", POOL).start()
    primary, secondary = pty.openpty()
    command = [*TOP, "--interval", "0.2", "--timeout", "0.3", "--endpoint", daemon.endpoint]
    env = {**os.environ, "COLUMNS": "140", "LINES": "60"}
    proc = subprocess.Popen(
        command,
        stdin=secondary,
        stdout=secondary,
        stderr=secondary,
        env=env,
        # Ctrl-C as a terminal sends it: a shell's background job (CI) starts with SIGINT
        # ignored, and its children would inherit that.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    os.close(secondary)
    seen = bytearray()

    def read_until(needle: bytes, timeout_s: float = 8.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while needle not in seen and time.monotonic() < deadline:
            if select.select([primary], [], [], 0.1)[0]:
                try:
                    seen.extend(os.read(primary, 1 << 16))
                except OSError:  # the child closed the terminal
                    break
        return needle in seen

    try:
        assert read_until(b"busiest prefixes"), seen.decode(errors="replace")
        daemon.stop()
        assert read_until(b"retrying every 0.2 s"), seen.decode(errors="replace")
        assert proc.poll() is None  # still watching
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 0
        read_until(b"\x00", timeout_s=0.2)  # drain what it wrote on the way out
        assert b"Traceback" not in seen
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(primary)
        if daemon.proc is not None and daemon.proc.poll() is None:
            daemon.stop()
