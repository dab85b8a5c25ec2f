"""Defect 4: what one client can make the daemon hold is bounded.

Pool quotas (page references and sequences, per session and per namespace)
answer ``quota_exceeded`` and change nothing; sessions are bounded; the bytes
queued per connection and buffered per event subscriber are bounded (the
daemon's peak RSS is read from /proc).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq
from kvcore_ipc import messages as msg

from kvcore import Client, ops
from kvcore.daemon.quotas import Ledger, Limits, Usage, request_work
from kvcore.daemon_process import DaemonProcess
from kvcore.errors import BadRequest, QuotaExceeded

CONFIG = """
max_sessions = 4
[[pools]]
name = "q"
num_layers = 1
num_kv_heads = 1
head_dim = 8
page_size = 4
dtype = "float16"
num_pages = 256
session_max_pages = 10
session_max_sequences = 3
namespace_max_pages = 16
namespace_max_sequences = 5
[[pools]]
name = "e"
num_layers = 1
num_kv_heads = 1
head_dim = 8
page_size = 4
dtype = "float16"
num_pages = 512
"""


def _daemon(tmp_path: Path, *args: str) -> DaemonProcess:
    config = tmp_path / "kvcore.toml"
    config.write_text(CONFIG)
    return DaemonProcess(
        "--config", str(config), "--endpoint", f"ipc://{tmp_path / 'd.sock'}", *args
    )


def _peak_mib(daemon: DaemonProcess) -> float:
    assert daemon.proc is not None
    for line in Path(f"/proc/{daemon.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def test_session_and_namespace_quotas(tmp_path: Path) -> None:
    with _daemon(tmp_path) as daemon:
        a = Client.connect(daemon.endpoint, pool="q", namespace="t", map_memory=False)
        a.allocate(1, list(range(16)))  # 4 pages
        a.fork(1, 2)  # 8 page references
        with pytest.raises(QuotaExceeded, match="session"):
            a.fork(1, 3)  # 12 > 10
        with pytest.raises(QuotaExceeded, match="session"):
            a.extend(1, 12)  # 4 more pages
        a.allocate(3, [1])  # the third sequence, 9 references
        with pytest.raises(QuotaExceeded, match="sequences"):
            a.allocate(4, [1])
        stats = a.stats()
        assert (stats.num_sequences, stats.held_pages) == (3, 5)  # the refusals changed nothing
        b = Client.connect(daemon.endpoint, pool="q", namespace="t", map_memory=False)
        b.allocate(10, list(range(16)))  # namespace t: 13 references, 4 sequences
        with pytest.raises(QuotaExceeded, match="namespace 't'"):
            b.allocate(11, list(range(16)))  # 17 > 16
        b.allocate(11, [1])  # 5 sequences
        with pytest.raises(QuotaExceeded, match="namespace 't'"):
            b.allocate(12, [1])
        with Client.connect(daemon.endpoint, pool="q", namespace="u", map_memory=False) as c:
            c.allocate(20, list(range(16)))  # another namespace has its own quota
        a.free(2)
        a.allocate(4, [1])  # room again
        a.check_integrity()  # the daemon's ledger agrees with the Manager
        a.close()
        b.close()


def test_the_ledger_prices_and_books_each_op_by_its_table_entry() -> None:
    """The ledger alone (no daemon): quotas and work read from kvcore.ops, as
    test_session_and_namespace_quotas sees them over the wire."""
    ledger = Ledger()
    ledger.open_pool("q", 4, Limits(10, 3, 16, 5))

    def run(op: ops.Operation[..., object], body: msg.BatchOp) -> None:
        ledger.check("q", 1, "t", op, body)
        ledger.apply("q", 1, "t", op, body)

    run(ops.allocate, msg.Allocate(1, list(range(16))))  # 4 pages
    run(ops.fork, msg.Fork(1, 2))  # 8 page references
    with pytest.raises(QuotaExceeded, match="session holds 8 page references; 4 more"):
        ledger.check("q", 1, "t", ops.fork, msg.Fork(1, 3))
    with pytest.raises(QuotaExceeded, match="3 more exceed its quota of 10"):
        ledger.check("q", 1, "t", ops.extend, msg.Extend(1, 12))
    run(ops.commit, msg.Commit(1, list(range(16))))  # adds nothing
    run(ops.lookup, msg.Lookup(list(range(17))))
    run(ops.allocate, msg.Allocate(3, [1]))  # the third sequence, 9 references
    with pytest.raises(QuotaExceeded, match="3 sequences; its quota is 3"):
        ledger.check("q", 1, "t", ops.allocate, msg.Allocate(4, [1]))
    ledger.check("q", 1, "t", ops.extend, msg.Extend(9, 100))  # not booked: the Manager refuses
    run(ops.free, msg.Free(2))  # 5 references
    run(ops.extend, msg.Extend(1, 1))  # 17 tokens: 5 pages, 6 references
    assert ledger.usage("q", 1) == Usage(pages=6, sequences=2)
    ledger.check_integrity("q", {1: 17, 3: 1}.__getitem__)
    books = ledger.books("q")
    batch = [
        (ops.allocate, msg.Allocate(5, [1] * 10)),  # 10 tokens carried
        (ops.extend, msg.Extend(1, 3)),  # 3 added
        (ops.fork, msg.Fork(1, 6)),  # 5 pages of 4 copied: 20
        (ops.free, msg.Free(3)),  # nothing
    ]
    request_work(batch, books, 33)
    with pytest.raises(BadRequest, match="34 tokens of work, more than 33"):
        request_work(
            [*batch, (ops.num_tokens, msg.NumTokens(1)), (ops.extend, msg.Extend(1, 1))], books, 33
        )


def test_sessions_are_bounded(tmp_path: Path) -> None:
    with _daemon(tmp_path) as daemon:
        clients = [Client.connect(daemon.endpoint, pool="q", map_memory=False) for _ in range(4)]
        with pytest.raises(QuotaExceeded, match="at most 4 sessions"):
            Client.connect(daemon.endpoint, pool="q", map_memory=False)
        for client in clients:
            client.close()


BUSY = """
import sys
from kvcore import Client
c = Client.connect(sys.argv[1], pool="e", map_memory=False, timeout_s=60)
c.allocate(1, list(range(2000)))  # 500 pages
batch = c.batch()
for child in range(2, 2 + 4096):  # ~2,000,000 page references: the daemon is busy a while
    batch.fork(1, child)
print("go", flush=True)
batch.run()
"""


def test_queued_requests_are_bounded_in_bytes(tmp_path: Path) -> None:
    """12 frames of 30 MiB (under the transport's cut-off) sent by one peer while the
    daemon is busy with another client's request."""
    with _daemon(tmp_path, "--max-request-tokens", "100000000") as daemon:
        before = _peak_mib(daemon)
        busy = subprocess.Popen(
            [sys.executable, "-c", BUSY, daemon.endpoint], stdout=subprocess.PIPE, text=True
        )
        assert busy.stdout is not None and busy.stdout.readline().strip() == "go"
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(daemon.endpoint)
        frame = b"\x00" * (30 << 20)
        for _ in range(12):
            sock.send(frame, copy=False)
        replies = 0
        while replies < 12 and sock.poll(20_000):
            sock.recv()
            replies += 1
        sock.close()
        busy.wait(60)
        assert replies == 12  # each answered bad_request, in turn
        growth = _peak_mib(daemon) - before
        assert growth < 200, f"the daemon grew by {growth:.0f} MiB queueing one peer's frames"


def test_a_slow_event_subscriber_is_bounded(tmp_path: Path) -> None:
    events = f"ipc://{tmp_path / 'ev.sock'}"
    with _daemon(tmp_path, "--events", events) as daemon:
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 1)
        sub.setsockopt(zmq.RCVBUF, 4096)
        sub.connect(events)
        sub.setsockopt(zmq.SUBSCRIBE, b"")  # and never reads
        time.sleep(0.2)
        before = _peak_mib(daemon)
        with Client.connect(daemon.endpoint, pool="e", map_memory=False) as c:
            for round_ in range(2000):  # ~36 KB of events a round: 200 stored, 200 removed
                tokens = list(range(round_ * 1000, round_ * 1000 + 801))
                with c.batch() as ops:
                    ops.allocate(1, tokens)
                    ops.commit(1, tokens)
                    ops.free(1)
            growth = _peak_mib(daemon) - before
        sub.close()
        assert growth < 40, f"the daemon grew by {growth:.0f} MiB for a subscriber that never reads"
