"""Sessions against a real daemon: attach checks, ownership, namespaces, leases, epochs."""

from __future__ import annotations

import itertools
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import zmq
from kvcore_ipc import messages as msg

from kvcore import Client, KeySpace
from kvcore.daemon_process import DaemonProcess
from kvcore.errors import (
    Forbidden,
    LayoutMismatch,
    LeaseLost,
    SequenceExists,
    StaleEpoch,
    UnknownPool,
    UnknownSequence,
    VersionMismatch,
)
from kvcore.integrations.reconnect import Reconnector
from kvcore.layout import KVLayout

LEASE_S = 1.0
LAYOUT = KVLayout(
    num_layers=2, num_kv_heads=1, head_dim=8, page_size=4, dtype="float16", num_pages=16
)
_names = itertools.count()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    tmp = tmp_path_factory.mktemp("sessions")
    with DaemonProcess(
        "--endpoint",
        f"ipc://{tmp / 'd.sock'}",
        "--events",
        f"ipc://{tmp / 'ev.sock'}",
        "--allow-ephemeral",
        "--lease-timeout",
        str(LEASE_S),
        "--pool",
        "name=fixed,num_layers=1,num_kv_heads=1,head_dim=8,page_size=4,dtype=float16,num_pages=8",
    ) as d:
        yield d


def fresh_pool(daemon: DaemonProcess, namespace: str = "default") -> Client:
    """A Client on a new, empty pool of LAYOUT."""
    return Client.connect(
        daemon.endpoint, pool=f"p{next(_names)}", namespace=namespace, layout=LAYOUT, ephemeral=True
    )


def join(daemon: DaemonProcess, pool: str, namespace: str = "default", **kw: object) -> Client:
    return Client.connect(daemon.endpoint, pool=pool, namespace=namespace, **kw)


def test_attach_checks_pool_layout_and_version(daemon: DaemonProcess) -> None:
    with pytest.raises(UnknownPool):
        Client.connect(daemon.endpoint, pool="nope")
    wrong = KVLayout(1, 1, 8, 8, "float16", 8)  # page size 8, the pool has 4
    with pytest.raises(LayoutMismatch):
        Client.connect(daemon.endpoint, pool="fixed", layout=wrong)
    any_pages = KVLayout(1, 1, 8, 4, "float16", 1)
    with Client.connect(daemon.endpoint, pool="fixed", layout=any_pages, map_memory=False) as c:
        assert c.layout.num_pages == 8  # the client learns the size
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(daemon.endpoint)
    sock.send(msgpack.packb({"id": 5, "body": {"op": "attach", "version": 99, "pool": "fixed"}}))
    assert sock.poll(5000)
    reply = msgpack.unpackb(sock.recv())
    sock.close()
    assert reply["id"] == 5 and reply["error"]["code"] == VersionMismatch.code


def test_ephemeral_pools_need_the_daemon_flag(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path / 'd.sock'}"
    with DaemonProcess("--endpoint", endpoint, "--pool", "num_pages=4"), pytest.raises(Forbidden):
        Client.connect(endpoint, pool="mine", layout=LAYOUT, ephemeral=True)


def test_sequences_belong_to_their_session(daemon: DaemonProcess) -> None:
    with fresh_pool(daemon) as a, join(daemon, a.pool) as b:
        a.allocate(1, [1, 2, 3, 4, 5])
        for call in (
            lambda: b.extend(1, 1),
            lambda: b.commit(1, [1]),
            lambda: b.free(1),
            lambda: b.fork(1, 2),
            lambda: b.block_table(1),
            lambda: b.num_tokens(1),
        ):
            with pytest.raises(Forbidden):
                call()
        with pytest.raises(SequenceExists):
            b.allocate(1, [9])  # ids are per pool, across sessions
        before = a.stats()
        assert before.num_sequences == 1 and before.held_pages == 2  # the refusals changed nothing
        a.fork(1, 2)
        with pytest.raises(Forbidden):
            b.free(2)  # the fork child is a's too
        a.free(1)
        a.free(2)
        with pytest.raises(UnknownSequence):
            a.free(2)  # double free
        taken = b.allocate(1, [9])  # a freed id is free for any session
        assert len(taken.pages) == 1 and taken.num_cached_tokens == 0
        a.check_integrity()


def test_namespaces_share_prefix_hits_across_sessions_only_within(daemon: DaemonProcess) -> None:
    prompt = list(range(13))  # three full pages of 4 tokens, and one token more
    with (
        fresh_pool(daemon, "tenant-a") as a,
        join(daemon, a.pool, "tenant-a") as same,
        join(daemon, a.pool, "tenant-b") as other,
    ):
        a.allocate(1, prompt)
        assert same.lookup(prompt).num_cached_tokens == 0  # nothing is visible before commit
        assert a.commit(1, prompt) == 3
        assert same.lookup(prompt).num_cached_tokens == 12
        assert other.lookup(prompt).num_cached_tokens == 0
        hit = same.allocate(2, prompt)
        assert hit.num_cached_tokens == 12 and hit.pages[:3] == a.block_table(1)[:3]
        assert other.allocate(3, prompt).num_cached_tokens == 0
        assert (
            other.lookup(prompt, KeySpace(namespace="tenant-a")).num_cached_tokens == 12
        )  # a per-call namespace overrides
        a.check_integrity()


def test_detach_frees_everything_the_session_held(daemon: DaemonProcess) -> None:
    with fresh_pool(daemon) as keeper:
        holder = join(daemon, keeper.pool)
        holder.allocate(1, list(range(10)))
        holder.commit(1, list(range(10)))
        holder.fork(1, 2)
        assert keeper.stats().held_pages == 3
        holder.close()
        stats = keeper.stats()
        assert (stats.held_pages, stats.num_sequences, stats.evictable_pages) == (0, 0, 2)
        assert stats.free_pages + stats.evictable_pages == stats.total_pages
        keeper.check_integrity()


CHILD = """
import sys, time
from kvcore import Client
c = Client.connect(sys.argv[1], pool=sys.argv[2], map_memory=False)
c.allocate(1, list(range(30)))
c.fork(1, 2)
print("holding", flush=True)
time.sleep(60)
"""


def test_kill_9_of_a_client_returns_its_pages_within_the_lease(daemon: DaemonProcess) -> None:
    with fresh_pool(daemon) as watcher:
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, daemon.endpoint, watcher.pool],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None and child.stdout.readline().strip() == "holding"
        time.sleep(2 * LEASE_S)  # its heartbeat thread keeps the lease alive meanwhile
        assert watcher.stats().held_pages == 8
        child.send_signal(signal.SIGKILL)
        child.wait()
        killed_at = time.monotonic()
        while watcher.stats().held_pages:
            assert time.monotonic() - killed_at < LEASE_S + 1.0, "lease did not expire in time"
            time.sleep(0.05)
        stats = watcher.stats()
        assert stats.free_pages == stats.total_pages and stats.num_sequences == 0
        watcher.check_integrity()


def test_a_silent_session_expires(daemon: DaemonProcess) -> None:
    """Its process lives, so its pages are fenced until it acknowledges the loss. A
    map-less client (whose page numbers another process's mapping may be using: the
    vLLM scheduler's) acknowledges only when it attaches again or closes."""
    with fresh_pool(daemon) as keeper:
        quiet = join(daemon, keeper.pool, heartbeat=False, map_memory=False)
        quiet.allocate(1, [1, 2, 3])
        time.sleep(LEASE_S + 0.3)
        assert keeper.stats().held_pages == 1  # fenced, not reused
        with pytest.raises(LeaseLost):
            quiet.extend(1, 1)
        with pytest.raises(LeaseLost):
            quiet.num_tokens(1)  # every later call, without a round trip
        assert quiet.lease_lost and keeper.stats().held_pages == 1  # learned; still fenced
        quiet.reconnect()
        assert keeper.stats().held_pages == 0  # acknowledged first: its pages are free
        assert quiet.allocate(1, [1]).num_cached_tokens == 0  # its old seq 1 is gone
        assert quiet.num_tokens(1) == 1
        quiet.close()


def test_a_lost_mapless_session_is_acknowledged_at_close(daemon: DaemonProcess) -> None:
    with fresh_pool(daemon) as keeper:
        quiet = join(daemon, keeper.pool, heartbeat=False, map_memory=False)
        quiet.allocate(1, [1, 2, 3])
        time.sleep(LEASE_S + 0.3)
        with pytest.raises(LeaseLost):
            quiet.extend(1, 1)
        assert keeper.stats().held_pages == 1
        quiet.close()
        assert keeper.stats().held_pages == 0


def test_a_pool_whose_memory_is_gone_is_stale_epoch_and_leaves_no_session(
    tmp_path: Path,
) -> None:
    """The segment the daemon describes at attach is gone by the time the client maps it
    (here: unlinked; in life, the daemon restarted between attach and map): StaleEpoch,
    a KVCoreError like every other way the daemon can be gone, never an OSError; the
    session just attached is detached and the client is left unattached (epoch 0), so
    nothing takes the epoch for a mapped one. Reconnector.ready() turns it into a quiet
    period, its attachment still the last one that worked."""
    endpoint = f"ipc://{tmp_path / 'd.sock'}"
    with DaemonProcess("--endpoint", endpoint, "--pool", "num_layers=1,num_pages=8"):
        client = Client.connect(endpoint, timeout_s=5, name="mapper")
        rec = Reconnector.of(client, retry_s=60.0, what="test")
        first = rec.attachment
        memory = client.attach_info.memory
        assert isinstance(memory, msg.HostMemory)
        Path("/dev/shm", memory.name).unlink()
        rec.stale()  # e.g. a vLLM worker saw a plan of a newer daemon
        assert not rec.ready()  # the attach failed: no exception, a quiet period
        assert rec.quiet() and rec.attachment == first
        assert client.epoch == client.session == 0 and client.kv_caches == []
        with pytest.raises(StaleEpoch, match="cannot map pool"):
            client.reconnect()  # the Client's own error: a KVCoreError
        assert client.epoch == client.session == 0
        with Client.connect(endpoint, map_memory=False, heartbeat=False) as watcher:
            mine = [s for s in watcher.daemon_stats().sessions if s.name == "mapper"]
            assert len(mine) == 1, mine  # the first session (live): the failed ones went
        client.close()


def test_daemon_restart_gives_stale_epoch_then_reconnect_works(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path / 'd.sock'}"
    args = ("--endpoint", endpoint, "--pool", "num_layers=1,num_kv_heads=1,head_dim=8,num_pages=8")
    with DaemonProcess(*args):
        client = Client.connect(endpoint, timeout_s=5)
        client.allocate(1, [1, 2, 3])
        old_epoch = client.epoch
    with DaemonProcess(*args):
        with pytest.raises(StaleEpoch):
            client.extend(1, 1)
        with pytest.raises(StaleEpoch):
            client.block_table(1)  # never an old page id
        client.reconnect()
        assert client.epoch != old_epoch
        with pytest.raises(UnknownSequence):
            client.num_tokens(1)  # the new daemon's pool is empty
        assert client.allocate(1, [1, 2, 3]).pages == [0]
        assert client.kv_caches[0].shape == (8, 2, 16, 1, 8)
        client.close()


def test_reconnect_to_a_daemon_restarted_with_another_layout_is_a_layout_mismatch(
    tmp_path: Path,
) -> None:
    """A client attached without an expected layout still keeps the first one across
    reconnects: its engine's views and page tables assume it, so another page size
    or head count after a restart is refused (an integration stays in misses), and
    the same geometry with another page count is accepted."""
    endpoint = f"ipc://{tmp_path / 'd.sock'}"
    base = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "page_size": 16, "num_pages": 8}

    def daemon(**changes: object) -> DaemonProcess:
        pool = ",".join(f"{k}={v}" for k, v in {**base, **changes}.items())
        return DaemonProcess("--endpoint", endpoint, "--pool", pool)

    with daemon():
        client = Client.connect(endpoint, timeout_s=5, map_memory=False)
    for other in ({"page_size": 32}, {"num_kv_heads": 2}, {"dtype": "float32"}):
        with daemon(**other), pytest.raises(LayoutMismatch):
            client.reconnect()
    with daemon(num_pages=16):
        client.reconnect()
        assert client.layout.page_size == 16 and client.layout.num_pages == 16
    client.close()


def test_a_second_daemon_cannot_take_a_stopped_daemons_socket(tmp_path: Path) -> None:
    """A daemon too busy to answer (here: stopped) still owns its ipc:// endpoint."""
    import os

    args = ("--endpoint", f"ipc://{tmp_path / 'd.sock'}", "--pool", "num_pages=8")
    with DaemonProcess(*args) as first:
        assert first.proc is not None
        os.kill(first.proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(RuntimeError, match="already serves"):
                DaemonProcess(*args).start()
        finally:
            os.kill(first.proc.pid, signal.SIGCONT)
    with DaemonProcess(*args):  # the lock went with the first daemon
        pass
    assert sorted(os.listdir(tmp_path)) == []
