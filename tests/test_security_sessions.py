"""Issue 18, points 6 and 7: what one client process or tenant may make the daemon hold.

* One pidfd per peer process, shared by its sessions and polled with ``poll``:
  ~1,100 attaches from one socket neither exhaust the daemon's descriptors
  nor crash the lease scan (``select()`` failed on descriptors >= 1024).
* Sessions are bounded per peer process and per tenant (not only daemon-wide),
  and a fenced session, watched or not, ends after ``fence_timeout_s``: one
  silent process cannot lock everyone else out.
"""

from __future__ import annotations

import contextlib
import os
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import zmq
from curve_helpers import curve_tenants

from kvcore import Client
from kvcore.daemon.auth import OPERATOR, Grant
from kvcore.daemon.sessions import SessionTable, State
from kvcore.daemon_process import DaemonProcess
from kvcore.errors import BadRequest, QuotaExceeded

POOL = "name=fixed,num_layers=1,num_kv_heads=1,head_dim=8,page_size=4,dtype=float16,num_pages=8"
ALICE = Grant("alice", frozenset({"alice"}), None)

# One DEALER socket sends argv[2] attach requests, counts the answers (at most 60 s),
# prints "ok refused other" and the first refusal, then stays alive and silent until
# its stdin closes.
FLOOD = """
import sys, time, msgpack, zmq
from kvcore_ipc.messages import PROTOCOL_VERSION
n = int(sys.argv[2])
sock = zmq.Context.instance().socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 0)
sock.connect(sys.argv[1])
body = {"op": "attach", "version": PROTOCOL_VERSION, "pool": "fixed"}
for i in range(n):
    sock.send(msgpack.packb({"id": i + 1, "body": body}))
ok, refused, other = 0, [], []
deadline = time.monotonic() + 60
while ok + len(refused) + len(other) < n and time.monotonic() < deadline:
    if sock.poll(1000):
        error = msgpack.unpackb(sock.recv()).get("error")
        if error is None:
            ok += 1
        else:
            (refused if error["code"] == "quota_exceeded" else other).append(error["message"])
print(ok, len(refused), len(other), flush=True)
print(refused[0] if refused else "-", flush=True)
sys.stdin.read()
"""


@contextmanager
def _flood(endpoint: str, n: int) -> Iterator[tuple[subprocess.Popen[str], list[int], str]]:
    """A process that attached ``n`` times on one socket and went quiet; it exits when
    the block ends."""
    proc = subprocess.Popen(
        [sys.executable, "-c", FLOOD, endpoint, str(n)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        counts = [int(x) for x in proc.stdout.readline().split()]
        first_refusal = proc.stdout.readline().strip()
        assert len(counts) == 3, f"the flooding process failed: {counts}"
        yield proc, counts, first_refusal
    finally:
        proc.stdin.close()
        proc.wait(10)


@contextmanager
def _nofile(at_least: int) -> Iterator[None]:
    """Raise this process's soft limit of open files to ``at_least`` (as far as the hard
    limit allows) for the block: a daemon started inside inherits it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = soft if soft >= at_least else at_least
    if hard != resource.RLIM_INFINITY:
        want = min(want, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _pidfds(daemon: DaemonProcess) -> int:
    """How many pidfds the daemon process holds open."""
    assert daemon.proc is not None
    fds = Path(f"/proc/{daemon.proc.pid}/fd")
    links = []
    for fd in os.listdir(fds):
        with contextlib.suppress(FileNotFoundError):  # closed meanwhile
            links.append(os.readlink(fds / fd))
    return sum(1 for link in links if "pidfd" in link)


def _sessions_of(client: Client, pid: int) -> int:
    """Sessions of process ``pid`` the daemon lists (live and fenced; not draining)."""
    return sum(1 for s in client.daemon_stats().sessions if s.pid == pid)


def _alive(daemon: DaemonProcess) -> None:
    assert daemon.proc is not None
    assert daemon.proc.poll() is None, "the daemon exited:\n" + daemon.output[-3000:]


# -- the table alone -------------------------------------------------------------------


def test_sessions_of_one_process_share_one_pidfd_polled_past_fd_1024() -> None:
    """Refcounted watches; exit seen by poll() on a descriptor >= 1024; a watched fenced
    session ends after the fence timeout; check_integrity holds at every step."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the hard limit of open files ({hard}) does not reach 1,024 + room")
    table = SessionTable(1.0, 5.0, 32)

    def check() -> None:
        table.check_integrity({}, lambda pool, seq: False)

    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    filler: list[int] = []
    with _nofile(2048):
        try:
            while len(filler) < 1100:  # so the next descriptors are >= 1024
                filler.append(os.open(os.devnull, os.O_RDONLY))
            mine = [table.open("p", "d", OPERATOR, os.getpid(), True, "", 0.0) for _ in range(3)]
            theirs = [table.open("p", "d", OPERATOR, child.pid, True, "", 0.0) for _ in range(2)]
            check()
            assert table.descriptors == 2 and table.on_process(os.getpid()) == 3
            assert table.on_process(child.pid) == 2
            assert mine[0].peer is mine[2].peer and theirs[0].peer is theirs[1].peer
            assert theirs[0].peer is not None and (theirs[0].peer.fd or 0) >= 1024
            assert child.stdin is not None
            child.stdin.close()
            child.wait(10)
            changed = table.expire(2.0)  # leases over: the child is gone, this process lives
            assert {s.state for s in theirs} == {State.DRAINING}
            assert {s.state for s in mine} == {State.FENCED} and len(changed) == 5
            assert table.descriptors == 1  # the exited process's pidfd closed at once
            check()
            assert {s.id for s in table.finished()} == {s.id for s in theirs}
            check()
            table.pause(10.0)  # deaf time does not count towards a fence
            assert table.expire(16.9) == [] and table.expire(17.1) == mine  # 2 + 5 + 10
            assert {s.id for s in table.finished()} == {s.id for s in mine}
            assert table.descriptors == 0 and len(table) == 0
            check()
        finally:
            for fd in filler:
                os.close(fd)
            child.kill()
            child.wait()
            table.close_all()


def test_sessions_are_bounded_per_process_and_per_tenant() -> None:
    table = SessionTable(1.0, 1.0, 32)
    assert (table.max_sessions_per_process, table.max_sessions_per_tenant) == (28, 28)
    assert SessionTable(1.0, 1.0, 1024).max_sessions_per_process == 64
    assert SessionTable(1.0, 1.0, 4).max_sessions_per_tenant == 4  # no reserve under 8
    with pytest.raises(BadRequest, match="max_sessions_per_process"):
        SessionTable(1.0, 1.0, 8, max_sessions_per_process=9)
    pid = os.getpid()
    for _ in range(28):
        table.open("p", "d", OPERATOR, pid, True, "", 0.0)
    with pytest.raises(QuotaExceeded, match=r"at most 28 \(max_sessions_per_process\)"):
        table.open("p", "d", OPERATOR, pid, True, "", 0.0)
    table.open("p", "d", OPERATOR, pid, False, "", 0.0)  # unwatched (tcp://): the operator
    narrow = SessionTable(1.0, 1.0, 32, max_sessions_per_tenant=3)
    for _ in range(3):
        narrow.open("p", "alice", ALICE, 1, False, "", 0.0)
    with pytest.raises(QuotaExceeded, match=r"tenant 'alice' holds 3 sessions.*at most 3"):
        narrow.open("p", "alice", ALICE, 1, False, "", 0.0)
    bob = narrow.open("p", "bob", Grant("bob", None, None), 1, False, "", 0.0)
    narrow.end(bob)
    assert narrow.finished() == [bob]
    narrow.check_integrity({}, lambda pool, seq: False)
    table.check_integrity({}, lambda pool, seq: False)
    table.close_all()


# -- a real daemon ---------------------------------------------------------------------


def test_one_process_flooding_attach_neither_crashes_nor_fills_the_daemon(tmp_path: Path) -> None:
    """~1,100 attaches on one socket, then silence, under a raised limit of open files:
    the daemon survives the leases' end, holds one pidfd for that process, and others
    attach (before: 1,024 pidfds, and the lease scan's select() raised ValueError)."""
    with (
        _nofile(4096),
        DaemonProcess(
            "--endpoint",
            f"ipc://{tmp_path / 'd.sock'}",
            "--lease-timeout",
            "0.5",
            "--pool",
            POOL,
        ) as daemon,
        _flood(daemon.endpoint, 1100) as (flooder, (ok, refused, other), first),
    ):
        time.sleep(1.5)  # every lease of the flood is over: the scan ran many times
        _alive(daemon)
        with Client.connect(daemon.endpoint, pool="fixed", map_memory=False) as other_client:
            assert (ok, refused, other) == (64, 1036, 0)
            assert "at most 64 (max_sessions_per_process)" in first
            assert _sessions_of(other_client, flooder.pid) == 64  # fenced, it still lives
            assert _pidfds(daemon) <= 2  # the flooder's and this process's
            time.sleep(0.8)  # fenced sessions scanned again
            _alive(daemon)
            assert other_client.daemon_stats().counters.expired_sessions >= 64
            other_client.check_integrity()
    assert daemon.proc is not None and daemon.proc.returncode == 0


def test_a_silent_process_cannot_lock_everyone_out(tmp_path: Path) -> None:
    """--max-sessions 32: a live, silent process gets 28 sessions (4 are kept from any one
    process); the others attach; its fenced sessions end after --fence-timeout while it
    still lives, and their slots are anyone's again."""
    with (
        DaemonProcess(
            "--endpoint",
            f"ipc://{tmp_path / 'd.sock'}",
            "--lease-timeout",
            "0.5",
            "--fence-timeout",
            "2",
            "--max-sessions",
            "32",
            "--pool",
            POOL,
        ) as daemon,
        _flood(daemon.endpoint, 32) as (flooder, (ok, refused, _), first),
    ):
        flooded = time.monotonic()
        assert (ok, refused) == (28, 4) and "at most 28" in first
        with Client.connect(daemon.endpoint, pool="fixed", map_memory=False) as other:
            time.sleep(max(0.0, flooded + 1.2 - time.monotonic()))  # leases over, fenced
            assert _sessions_of(other, flooder.pid) == 28
            deadline = flooded + 2.5 + 5.0  # lease + fence, and room for a loaded machine
            while _sessions_of(other, flooder.pid):
                assert time.monotonic() < deadline, "fenced sessions outlived the fence timeout"
                time.sleep(0.05)
            assert time.monotonic() - flooded > 1.5, "fenced sessions ended before the fence"
            assert flooder.poll() is None  # it lives: the fence ended on time, not on exit
            with _flood(daemon.endpoint, 28) as (_, (ok2, refused2, _), _):
                assert (ok2, refused2) == (28, 0)  # the slots came back
            other.check_integrity()


def test_one_tenant_cannot_hold_every_session(tmp_path: Path) -> None:
    """tcp:// with CURVE (the grant names the tenant; its process cannot be watched):
    --max-sessions 8 keeps one session from any tenant, so alice gets 7 and bob attaches."""
    if not zmq.has("curve"):
        pytest.skip("libzmq without CURVE")
    tenants = {"alice": 'namespaces = ["alice"]', "bob": 'namespaces = ["bob"]'}
    head, pool = "max_sessions = 8\n", ("--pool", POOL)
    with curve_tenants(tmp_path, head, tenants, *pool) as (daemon, server, keys):

        def connect(who: str, namespace: str) -> Client:
            return Client.connect(
                daemon.endpoint,
                pool="fixed",
                namespace=namespace,
                map_memory=False,
                curve_server_key=server,
                curve_keypair=keys[who],
            )

        alices = []
        try:
            for _ in range(7):
                alices.append(connect("alice", "alice"))
            with pytest.raises(QuotaExceeded, match=r"tenant 'alice' holds 7 sessions.*at most 7"):
                connect("alice", "alice")
            with connect("bob", "bob") as b:
                assert len(b.daemon_stats().sessions) == 1  # bob sees only his own
            alices.pop().close()
            alices.append(connect("alice", "alice"))  # a freed slot is hers again
            alices[0].check_integrity()
        finally:
            for client in alices:
                client.close()


WATCH_AT_THE_RESERVE = """
import os, resource
from kvcore.daemon import fdlimit
from kvcore.daemon.watch import Watcher
used = fdlimit.open_descriptors()
resource.setrlimit(resource.RLIMIT_NOFILE, (used + fdlimit.RESERVE, used + 200))
watch = Watcher().watch(os.getppid())
print("fd" if watch.fd is not None else "unwatched")
"""


def test_a_pidfd_is_never_taken_from_the_reserve_kept_for_zeromq() -> None:
    """With only the reserve left, a new process is not watched (its fenced sessions end
    at the fence timeout) rather than leave libzmq without a descriptor."""
    done = subprocess.run(
        [sys.executable, "-c", WATCH_AT_THE_RESERVE], capture_output=True, text=True, timeout=60
    )
    assert done.stdout.split() == ["unwatched"], done
