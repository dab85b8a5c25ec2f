"""A daemon that is killed or stopped comes back with its committed pages (issue 40):
real daemons (``--restore``) on one endpoint, killed with SIGKILL, or stopped with
SIGTERM or SIGINT, and started again with the same flags; a real client commits 4
prompts of 6 pages, each page filled with a marker of its prompt and place, and
leaves a 5th written but uncommitted. After the restart the 4 hit with their
markers, the 5th misses; the pages nobody committed are withheld until the old
client fences its mapping (its first StaleEpoch); ``--no-restore`` and a changed
pool start empty, saying why."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcore_ipc.shm import sweep

from kvcore import Client
from kvcore.daemon.daemon import segment_prefix
from kvcore.daemon_process import DaemonProcess
from kvcore.errors import KVCoreError, StaleEpoch
from kvcore.layout import KVLayout
from kvcore.manager import Manager

PAGES, PAGE = 6, 4  # pages a prompt, tokens a page
POOL = "name=default,num_layers=2,num_kv_heads=1,head_dim=8,page_size=4,dtype=float32,num_pages=64"


def prompt(n: int) -> list[int]:
    return [1000 * n + t for t in range(PAGES * PAGE)]


def marker(n: int, i: int) -> float:
    """What page ``i`` of prompt ``n`` holds, every element of every layer."""
    return float(100 * n + i + 1)


def fill(client: Client, pages: list[int], n: int, first: int = 0) -> None:
    """Write prompt ``n``'s markers into ``pages`` from its page ``first`` on."""
    for layer in client.kv_caches:
        for i, page in enumerate(pages[first:], start=first):
            layer[page].fill_(marker(n, i))


def holds(client: Client, pages: list[int], n: int) -> bool:
    return all(
        bool(torch.all(layer[page] == marker(n, i)))
        for layer in client.kv_caches
        for i, page in enumerate(pages)
    )


@pytest.fixture
def endpoint(tmp_path: Path) -> Iterator[str]:
    endpoint = f"ipc://{tmp_path / 'kvcore.sock'}"
    yield endpoint
    with DaemonProcess("--endpoint", endpoint, "--pool", POOL, "--no-restore"):
        pass  # cold: the manifest goes, the sweep unlinks what the test's daemons kept
    assert not sweep(segment_prefix(endpoint))


def serve(endpoint: str, *flags: str) -> DaemonProcess:
    return DaemonProcess(
        "--endpoint", endpoint, "--pool", POOL, "--lease-timeout-s", "30", *flags
    ).start()


def warm(endpoint: str) -> tuple[Client, list[int]]:
    """A client that committed prompts 0-3 and holds prompt 4 written, uncommitted; the
    pages of prompt 4. It does not heartbeat: it learns of a restart at its next call
    (a beat would fence its mapping at a moment of the machine's choosing)."""
    client = Client.connect(endpoint, heartbeat=False)
    for n in range(4):
        got = client.allocate(n + 1, prompt(n), compute_last=False)
        fill(client, got.pages, n)
        client.commit(n + 1, prompt(n))
        client.free(n + 1)
    held = client.allocate(5, prompt(4), compute_last=False)
    fill(client, held.pages, 4)
    return client, held.pages


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_committed_pages_come_back_after_the_daemon_ends(endpoint: str, sig: int) -> None:
    daemon = serve(endpoint, "--restore")
    old, uncommitted = warm(endpoint)
    daemon.stop(sig)
    daemon = serve(endpoint, "--restore")
    try:
        assert "re-adopted 24 committed pages" in daemon.output, daemon.output
        with Client.connect(endpoint) as new:
            stats = new.stats()
            assert stats.free_pages == 0  # withheld: the old client still maps them
            assert stats.withheld_pages == 64 - 24, stats
            snapshot = new.snapshot()  # what a router that subscribes now rebuilds from
            assert len(snapshot.pages) == 24 and snapshot.seq_no >= 24  # their stored events
            for n in range(4):
                got = new.allocate(10 + n, prompt(n), compute_last=False)
                assert got.num_cached_tokens == PAGES * PAGE, n
                assert holds(new, got.pages, n), f"prompt {n}: not its bytes"
                new.free(10 + n)
            assert new.lookup(prompt(4), compute_last=False).num_cached_tokens == 0
            with pytest.raises(StaleEpoch):
                old.heartbeat()  # the old session is gone; its mapping is fenced now
            assert all(bool(torch.all(layer == 0)) for layer in old.kv_caches)  # scratch
            fill(old, uncommitted, 9)  # writes what no pool page sees
            deadline = time.monotonic() + 10
            while new.stats().free_pages == 0 and time.monotonic() < deadline:
                time.sleep(0.2)
            stats = new.stats()
            assert stats.free_pages == 64 - 24, "the withheld pages were not released"
            assert stats.withheld_pages == 0
            assert "withheld pages released" in daemon.output
            got = new.allocate(20, prompt(0), compute_last=False)
            assert holds(new, got.pages, 0)  # the old client's late writes reached nothing
            new.check_integrity()
    finally:
        old.close()
        daemon.stop()


def test_no_restore_and_a_changed_pool_start_empty(endpoint: str) -> None:
    daemon = serve(endpoint, "--restore")
    client, _ = warm(endpoint)
    client.close()
    daemon.stop(signal.SIGKILL)
    changed = POOL.replace("num_pages=64", "num_pages=32")
    daemon = DaemonProcess(
        "--endpoint", endpoint, "--pool", changed, "--restore", "--lease-timeout-s", "30"
    ).start()
    try:
        assert "settings changed (num_pages 64 -> 32" in daemon.output, daemon.output
        with Client.connect(endpoint) as c:
            assert c.lookup(prompt(0), compute_last=False).num_cached_tokens == 0
            assert c.stats().free_pages == 32
            warm_client, _ = warm(endpoint)
            warm_client.close()
    finally:
        daemon.stop()
    daemon = serve(endpoint, "--no-restore")  # the operator's cold start on purpose
    try:
        with Client.connect(endpoint) as c:
            assert c.lookup(prompt(0), compute_last=False).num_cached_tokens == 0
            assert c.stats().free_pages == 64
    finally:
        daemon.stop()


def test_a_segment_of_another_size_is_refused_by_name(endpoint: str) -> None:
    """A segment resized behind the daemon's back is never mapped as the pool."""
    daemon = serve(endpoint, "--restore")
    client, _ = warm(endpoint)
    name = client.attach_info.memory.name  # type: ignore[union-attr]
    client.close()
    daemon.stop(signal.SIGKILL)
    os.truncate(f"/dev/shm/{name}", 4096)
    daemon = serve(endpoint, "--restore")
    try:
        assert f"segment {name}" in daemon.output and "starting empty" in daemon.output
        with Client.connect(endpoint) as c:
            assert c.lookup(prompt(0), compute_last=False).num_cached_tokens == 0
    finally:
        daemon.stop()


# -- withheld pages, in process ---------------------------------------------------------

STEPS = st.lists(
    st.tuples(
        st.sampled_from(["allocate", "commit", "free", "withhold", "release"]),
        st.integers(1, 4),
        st.integers(1, 12),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(steps=STEPS)
def test_withheld_pages_are_never_handed_out_until_released(
    steps: list[tuple[str, int, int]],
) -> None:
    """Whatever runs around ``withhold_free`` and ``release_withheld``: the Manager's
    invariants hold (free + evictable + held + withheld == total); no allocation is handed
    a withheld page, and none a page that was cached when withholding began, but as its
    hit (an old client may be reading it: nothing evicts it); a refused allocation
    changes nothing."""
    m = Manager(KVLayout(1, 1, 8, PAGE, "float32", num_pages=8))
    withheld: set[int] = set()
    cached: set[int] = set()  # cached at withhold_free(), while withholding
    for op, seq, length in steps:
        tokens = [seq * 100 + t for t in range(length)]
        try:
            if op == "allocate":
                got = m.allocate(seq, tokens, compute_last=False)
                fresh = set(got.pages[got.num_cached_tokens // PAGE :])
                assert not withheld & fresh, "a withheld page was handed out"
                assert not cached & fresh, "a page cached at the restart was evicted"
            elif op == "commit" and seq in m:
                m.commit(seq, tokens[: m.num_tokens(seq)])
            elif op == "free" and seq in m:
                m.free(seq)
            elif op == "withhold":
                free_before = m.stats().free_pages
                assert m.withhold_free() == len(withheld) + free_before
                withheld = set(range(8)) - _in_use(m)
                cached |= {e.page for e in m.prefix_snapshot()}
            elif op == "release":
                assert m.release_withheld() == len(withheld)
                withheld, cached = set(), set()
        except KVCoreError:
            pass
        m.check_integrity()
        stats = m.stats()
        assert stats.withheld_pages == len(withheld)
        assert stats.free_pages + stats.evictable_pages + stats.held_pages + len(withheld) == 8


def _in_use(m: Manager) -> set[int]:
    """Pages held by a sequence or indexed."""
    pages = {e.page for e in m.prefix_snapshot()}
    for seq in range(1, 5):
        if seq in m:
            pages |= set(m.block_table(seq))
    return pages
