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
from kvcore.daemon.quotas import Holder, Ledger, Limits, Usage
from kvcore.daemon.work import WorkBudget, check_carried
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
    """The ledger alone (no daemon): quotas read from kvcore.ops, as
    test_session_and_namespace_quotas sees them over the wire."""
    ledger = Ledger()
    ledger.open_pool("q", 4, Limits(10, 3, 16, 5))
    me = Holder(1, "t")

    def run(op: ops.Operation[..., object], body: msg.BatchOp) -> None:
        ledger.check("q", me, op, body)
        ledger.apply("q", me, op, body)

    run(ops.allocate, msg.Allocate(1, list(range(16))))  # 4 pages
    run(ops.fork, msg.Fork(1, 2))  # 8 page references
    with pytest.raises(QuotaExceeded, match="session holds 8 page references of pool 'q'; 4 more"):
        ledger.check("q", me, ops.fork, msg.Fork(1, 3))
    with pytest.raises(QuotaExceeded, match="3 more exceed its quota of 10"):
        ledger.check("q", me, ops.extend, msg.Extend(1, 12))
    run(ops.commit, msg.Commit(1, list(range(16))))  # adds nothing
    run(ops.lookup, msg.Lookup(list(range(17))))
    run(ops.allocate, msg.Allocate(3, [1]))  # the third sequence, 9 references
    with pytest.raises(QuotaExceeded, match="3 sequences of pool 'q'; its quota is 3"):
        ledger.check("q", me, ops.allocate, msg.Allocate(4, [1]))
    ledger.check("q", me, ops.extend, msg.Extend(9, 100))  # not booked: the Manager refuses
    run(ops.free, msg.Free(2))  # 5 references
    run(ops.extend, msg.Extend(1, 1))  # 17 tokens: 5 pages, 6 references
    assert ledger.usage("q", 1) == Usage(pages=6, sequences=2)
    ledger.check_integrity("q", {1: 17, 3: 1}.__getitem__)


def test_tenants_and_processes_are_booked_across_their_sessions() -> None:
    """Issue 18 point 8, the ledger alone: a tenant's and a process's sessions share one
    book each, so opening another session gives neither more; the operator (no tenant)
    and a peer without a kernel pid (process 0) have no such book."""
    ledger = Ledger()
    ledger.open_pool("q", 4, Limits(tenant_pages=7, tenant_sequences=3, process_sequences=2))
    first, second = Holder(1, "a", "alice", 100), Holder(2, "a", "alice", 101)
    same_process = Holder(3, "b", "bob", 100)

    def run(holder: Holder, op: ops.Operation[..., object], body: msg.BatchOp) -> None:
        ledger.check("q", holder, op, body)
        ledger.apply("q", holder, op, body)

    run(first, ops.allocate, msg.Allocate(1, list(range(8))))  # alice: 2 pages, process 100
    run(second, ops.allocate, msg.Allocate(2, list(range(8))))  # alice: 4 pages, process 101
    with pytest.raises(QuotaExceeded, match="tenant 'alice' holds 4 page references"):
        ledger.check("q", first, ops.extend, msg.Extend(1, 13))  # 4 more pages: 8 > 7
    run(second, ops.fork, msg.Fork(2, 3))  # alice: 3 sequences, 6 references
    with pytest.raises(QuotaExceeded, match="tenant 'alice' holds 3 sequences"):
        ledger.check("q", Holder(4, "a", "alice", 102), ops.allocate, msg.Allocate(4, [1]))
    with pytest.raises(QuotaExceeded, match="process 101 holds 2 sequences"):
        ledger.check("q", Holder(7, "b", "bob", 101), ops.allocate, msg.Allocate(4, [1]))
    run(same_process, ops.allocate, msg.Allocate(4, [1]))  # bob, in alice's process 100
    with pytest.raises(QuotaExceeded, match="process 100 holds 2 sequences"):
        ledger.check("q", same_process, ops.allocate, msg.Allocate(5, [1]))
    for unbooked in (Holder(5, "a"), Holder(6, "a", "", 0)):  # the operator, no pid
        run(unbooked, ops.allocate, msg.Allocate(unbooked.session * 10, [1]))
    assert ledger.held_by("q", tenant="alice") == Usage(pages=6, sequences=3)
    assert ledger.held_by("q", process=100) == Usage(pages=3, sequences=2)
    ledger.check_integrity("q", {1: 8, 2: 8, 3: 8, 4: 1, 50: 1, 60: 1}.__getitem__)
    for seq in (1, 2, 3, 4, 50, 60):
        ledger.drop("q", seq)
    assert ledger.held_by("q", tenant="alice") == Usage() == ledger.held_by("q", process=100)
    ledger.check_integrity("q", {}.__getitem__)


def test_the_work_budget_prices_each_op_against_the_books_as_they_are() -> None:
    """kvcore.daemon.work alone: tokens carried are checked up front; each op's work is
    charged just before it runs, so a fork of a child made earlier costs its pages."""
    ledger = Ledger()
    ledger.open_pool("q", 4, Limits())
    me = Holder(1, "t")
    books = ledger.books("q")
    check_carried([msg.Allocate(5, [1] * 10), msg.Lookup([1] * 23), msg.Extend(1, 99)], 33)
    with pytest.raises(BadRequest, match="carries 34 tokens, more than 33"):
        check_carried([msg.Allocate(5, [1] * 10), msg.Commit(1, [1] * 24)], 33)
    budget = WorkBudget(33)
    for op, body in (
        (ops.allocate, msg.Allocate(1, [1] * 10)),  # 10 tokens carried
        (ops.fork, msg.Fork(1, 2)),  # 3 pages of 4 copied: 12
        (ops.extend, msg.Extend(2, 3)),  # 3 added
    ):
        budget.charge(op, body, books)
        ledger.apply("q", me, op, body)  # as if the Manager ran it
    assert budget.spent == 25
    with pytest.raises(BadRequest, match="41 tokens of work with this op, more than 33"):
        budget.charge(ops.fork, msg.Fork(2, 3), books)  # the child above: 13 tokens, 4 pages
    assert budget.spent == 25  # a refused op costs nothing
    budget.charge(ops.num_tokens, msg.NumTokens(2), books)


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
