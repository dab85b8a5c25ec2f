"""Defect 2: a client stopped beyond its lease never writes into pages someone else now owns.

The client process is SIGSTOPped past its lease (a debugger, a long pause).
Its pages are fenced: not reused while it lives. When it resumes it learns
(its heartbeat gets ``lease_lost``), fences its own mapping, acknowledges, and
every later call raises LeaseLost; a write through its old block table lands
in private scratch, never in the next owner's page. A fence is bounded in time
(``fence_timeout_s``), whether or not the daemon can watch the process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcore import Client
from kvcore.daemon_process import DaemonProcess
from kvcore.errors import NotAttached, OutOfPages
from kvcore.layout import KVLayout

LEASE_S = 1.0
LAYOUT = KVLayout(
    num_layers=1, num_kv_heads=1, head_dim=8, page_size=4, dtype="float32", num_pages=16
)
MINE, THEIRS = 11.0, 77.0  # markers: the new owner's, the stopped client's

STOPPED = """
import sys
from kvcore import Client
from kvcore.errors import LeaseLost
c = Client.connect(sys.argv[1], pool="fixed")
pages = c.allocate(1, list(range(16))).pages            # 4 pages, its own
print(" ".join(map(str, pages)), flush=True)
for line in sys.stdin:                                  # each line: write through the old table
    for p in pages:
        c.kv_caches[0][p].fill_(77.0)
    try:
        c.extend(1, 1)
        print("extended", flush=True)
    except LeaseLost:
        print("lease_lost", c.lease_lost, flush=True)
"""


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    with DaemonProcess(
        "--endpoint",
        f"ipc://{tmp_path / 'd.sock'}",
        "--lease-timeout",
        str(LEASE_S),
        "--pool",
        "name=fixed,num_layers=1,num_kv_heads=1,head_dim=8,page_size=4,dtype=float32,num_pages=16",
    ) as d:
        yield d


def test_a_stopped_client_is_fenced_then_told_and_cannot_clobber(daemon: DaemonProcess) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", STOPPED, daemon.endpoint],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        theirs = [int(p) for p in child.stdout.readline().split()]
        assert len(theirs) == 4
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(LEASE_S + 0.8)
        with Client.connect(daemon.endpoint, pool="fixed") as owner:
            stats = owner.stats()
            assert stats.held_pages == 4 and stats.free_pages == 12, "fenced pages were released"
            with pytest.raises(OutOfPages):
                owner.allocate(100, list(range(13 * 4)))  # 13 pages: only 12 are not fenced
            mine = owner.allocate(100, list(range(12 * 4))).pages
            assert not set(mine) & set(theirs)
            os.kill(child.pid, signal.SIGCONT)
            deadline = time.monotonic() + 5
            while owner.stats().held_pages != 12:  # it learned, fenced itself and acked
                assert time.monotonic() < deadline, "the resumed client never gave its pages up"
                time.sleep(0.02)
            assert owner.daemon_stats().counters.expired_sessions >= 1
            owner.extend(100, 4 * 4)  # the 4 pages it had are someone else's now
            new = owner.block_table(100)[12:]
            assert sorted(new) == sorted(theirs)
            for p in new:
                owner.kv_caches[0][p].fill_(MINE)
            child.stdin.write("write\n")
            child.stdin.flush()
            assert child.stdout.readline().split() == ["lease_lost", "True"]
            for p in new:  # its writes went to scratch, not into the owner's pages
                assert bool((owner.kv_caches[0][p] == MINE).all()), f"page {p} was clobbered"
            owner.check_integrity()
    finally:
        os.kill(child.pid, signal.SIGCONT)
        child.kill()
        child.wait()


def test_a_fenced_session_is_released_when_its_process_exits(daemon: DaemonProcess) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", STOPPED, daemon.endpoint],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    child.stdout.readline()
    os.kill(child.pid, signal.SIGSTOP)
    time.sleep(LEASE_S + 0.5)
    with Client.connect(daemon.endpoint, pool="fixed", map_memory=False) as owner:
        assert owner.stats().held_pages == 4  # fenced
        child.kill()  # SIGKILL of a stopped process: it exits without resuming
        child.wait()
        deadline = time.monotonic() + 3
        while owner.stats().held_pages:
            assert time.monotonic() < deadline, "pages of a dead fenced client were kept"
            time.sleep(0.02)
        owner.check_integrity()


def test_an_unwatchable_fenced_session_is_released_after_the_fence_timeout(tmp_path: Path) -> None:
    """A tcp:// peer's process cannot be watched: its fence ends after fence_timeout_s."""
    with DaemonProcess(
        "--endpoint",
        "tcp://127.0.0.1:*",
        "--insecure",
        "--lease-timeout",
        "0.5",
        "--fence-timeout",
        "1",
        "--pool",
        "num_pages=8,num_layers=1",
    ) as daemon:
        quiet = Client.connect(daemon.endpoint, heartbeat=False, map_memory=False)
        quiet.allocate(1, [1, 2, 3])
        with Client.connect(daemon.endpoint, map_memory=False) as watcher:
            time.sleep(0.9)
            assert watcher.stats().held_pages == 1  # fenced: its writes could still land
            time.sleep(1.0)
            assert watcher.stats().held_pages == 0  # the fence timed out
            watcher.check_integrity()
        with pytest.raises(NotAttached):
            quiet.extend(1, 1)  # it is gone, not fenced any more
        quiet.close()


def test_a_watched_fenced_session_is_released_after_the_fence_timeout(tmp_path: Path) -> None:
    """An ipc:// peer whose process lives (this one) but stays silent: its fence ends after
    fence_timeout_s too, not only when it exits (issue 18, point 7)."""
    with DaemonProcess(
        "--endpoint",
        f"ipc://{tmp_path / 'd.sock'}",
        "--lease-timeout",
        "0.5",
        "--fence-timeout",
        "1.5",
        "--pool",
        "num_pages=8,num_layers=1",
    ) as daemon:
        quiet = Client.connect(daemon.endpoint, heartbeat=False, map_memory=False)
        quiet.allocate(1, [1, 2, 3])
        silent_from = time.monotonic()
        with Client.connect(daemon.endpoint, map_memory=False) as watcher:
            time.sleep(1.2)
            assert watcher.stats().held_pages == 1  # fenced: its process lives
            deadline = silent_from + 2.0 + 5.0  # lease + fence, and room for a loaded machine
            while watcher.stats().held_pages:
                assert time.monotonic() < deadline, "a live process's fence never ended"
                time.sleep(0.05)
            assert time.monotonic() - silent_from > 1.9, "the fence ended before its timeout"
            watcher.check_integrity()
        with pytest.raises(NotAttached):
            quiet.extend(1, 1)  # it is gone, not fenced any more
        quiet.close()
