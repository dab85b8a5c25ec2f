"""A tiered pool (host and disk tiers below it) kept across daemon restarts (issue 40).

Real daemons (``--restore``): a real client commits 8 prompts of 6 pages into a pool of
32, each page filled with a marker of its prompt and place, so that the oldest go down
to the host tier and on to the disk; it brings prompt 0 back up (a promotion: pages
indexed before their bytes are copied in) and leaves a 9th prompt written but
uncommitted. After a SIGKILL or a SIGTERM and a start with the same flags, the pool's
committed pages come back (the promoted ones too), hit with their markers, and the
uncommitted pages are withheld until the old client fences its mapping; the host tier
comes back too (kvcore.tiers.host_table), so every prompt hits whole after either end.
A pool with a host tier alone (no disk below it) shows the host tier's part: after a
SIGKILL the prompts only the host tier held are promoted from it with their markers;
a changed host tier capacity starts the host tier alone empty, named in the log.

In process: a TieredManager over a Manager whose index is mirrored into an index table,
with a crash image (the table's bytes, the pool's) taken at every store of the table and
after every page a promotion copies in. A restart from any image restores only pages
holding their key's marker; a table that stores adopted pages at once (not PENDING
until placed) is caught restoring a wrong page.

Over 400 lines on purpose: the daemon tests and the in-process crash images share one
set of marker-filled prompts and their helpers.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from unittest import mock

import pytest
import test_index_table as it
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcore_ipc.shm import sweep
from test_restart import fill, holds
from tiered_helpers import LAYOUT

from kvcore import Client
from kvcore.allocator import PageId
from kvcore.daemon import tiering
from kvcore.daemon.daemon import segment_prefix
from kvcore.daemon.index_table import MirroredIndex
from kvcore.daemon_process import DaemonProcess
from kvcore.errors import OutOfPages, StaleEpoch
from kvcore.layout import KVLayout
from kvcore.manager import Manager
from kvcore.prefix import KeySpace, PageStored, PrefixKey, chain_keys, encode_tokens, page_key
from kvcore.prefix import root_key as root_of
from kvcore.tiers import DiskTier, HostTier, TierStack, scatter_pages
from kvcore.tiers.base import TierKey

PAGES, PAGE, POOL_PAGES = 6, 4, 32  # pages a prompt, tokens a page, pages of the pool
PAGE_BYTES = 2 * 2 * PAGE * 1 * 8 * 4  # layers x K/V x tokens x heads x dim x float32
ROOT = root_of(KeySpace("default"))


def pool_flag(disk: Path) -> str:
    return (
        f"name=default,num_layers=2,num_kv_heads=1,head_dim=8,page_size={PAGE},dtype=float32,"
        f"num_pages={POOL_PAGES},host_tier={12 * PAGE_BYTES},disk_tier={disk},"
        f"disk_tier_size={256 * PAGE_BYTES}"
    )


def host_only_flag(host_pages: int) -> str:
    """The pool of :func:`pool_flag` with a host tier of ``host_pages`` pages, no disk."""
    return (
        f"name=default,num_layers=2,num_kv_heads=1,head_dim=8,page_size={PAGE},dtype=float32,"
        f"num_pages={POOL_PAGES},host_tier={host_pages * PAGE_BYTES}"
    )


def prompt(n: int) -> list[int]:
    return [1000 * n + t for t in range(PAGES * PAGE)]


def keys_of(n: int) -> list[PrefixKey]:
    return list(chain_keys(ROOT, encode_tokens(prompt(n)), PAGE))


@pytest.fixture
def endpoint(tmp_path: Path) -> Iterator[str]:
    endpoint = f"ipc://{tmp_path / 'kvcore.sock'}"
    yield endpoint
    with DaemonProcess(
        "--endpoint", endpoint, "--pool", pool_flag(tmp_path / "disk"), "--no-restore"
    ):
        pass  # cold: the manifest goes, the sweep unlinks what the test's daemons kept
    assert not sweep(segment_prefix(endpoint))


def serve(endpoint: str, disk: Path, pool: str = "") -> DaemonProcess:
    flags = ("--pool", pool or pool_flag(disk), "--lease-timeout-s", "30", "--restore")
    return DaemonProcess("--endpoint", endpoint, *flags).start()


def host_pages(client: Client) -> int:
    """Entries the pool's host tier holds now."""
    (pool,) = client.daemon_stats().pools
    return next(t.pages for t in pool.tiers if t.medium == "host")


def warm(endpoint: str) -> tuple[Client, list[int]]:
    """A client that committed prompts 0-7 (the oldest pushed down to the tiers), brought
    prompt 0 back up from them, and holds prompt 8 written, uncommitted; its pages. No
    heartbeat: it learns of a restart at its next call."""
    client = Client.connect(endpoint, heartbeat=False)
    for seq, n in enumerate([*range(8), 0], start=1):
        got = client.allocate(seq, prompt(n), compute_last=False)
        cached = got.num_cached_tokens // PAGE
        assert holds(client, got.pages[:cached], n), f"prompt {n}: a wrong hit"
        if n == 0 and seq > 1:
            assert cached == PAGES and {m for m, _ in got.sources[1:]} <= {"host", "disk"}
            assert tuple(got.sources[0]) == ("pool", 0), got.sources  # promoted, all of it
        fill(client, got.pages, n, cached)
        client.commit(seq, prompt(n))
        client.free(seq)
    held = client.allocate(20, prompt(8), compute_last=False)
    fill(client, held.pages, 8)
    return client, held.pages


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_tiered_pool_comes_back_after_the_daemon_ends(
    endpoint: str, tmp_path: Path, sig: int
) -> None:
    disk = tmp_path / "disk"
    daemon = serve(endpoint, disk)
    old, uncommitted = warm(endpoint)
    daemon.stop(sig)
    daemon = serve(endpoint, disk)
    try:
        # The pool was full: 6 pages held, 26 cached, prompt 0's promoted pages among them.
        assert "re-adopted 26 committed pages" in daemon.output, daemon.output
        assert "; 0 dropped" in daemon.output, daemon.output
        with Client.connect(endpoint) as new:
            assert new.stats().free_pages == 0  # withheld: the old client still maps them
            in_pool = {page.key for page in new.snapshot().pages}
            whole = [n for n in range(8) if set(keys_of(n)) <= in_pool]
            assert {0, 7} <= set(whole), whole
            with pytest.raises(StaleEpoch):
                old.heartbeat()  # its mapping is fenced now
            fill(old, uncommitted, 9)  # writes what no pool page sees
            deadline = time.monotonic() + 10
            while new.stats().free_pages == 0 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert new.stats().free_pages == PAGES, "the withheld pages were not released"
            assert "withheld pages released" in daemon.output
            rest = [n for n in range(8) if n not in whole]
            for seq, n in enumerate([*whole, *rest], start=100):  # the pool's own first
                got = new.allocate(seq, prompt(n), compute_last=False)
                cached = got.num_cached_tokens // PAGE
                assert holds(new, got.pages[:cached], n), f"prompt {n}: not its bytes"
                assert cached == PAGES, (n, got.sources)  # the pool, host or disk tier
                new.free(seq)
            assert new.lookup(prompt(8), compute_last=False).num_cached_tokens == 0
            new.check_integrity()
    finally:
        old.close()
        daemon.stop()


# -- promotions interrupted, in process -------------------------------------------------


class CopyByPage(HostTier):
    """A host tier whose promotions copy one page at a time, a crash point after each."""

    def __init__(self, layout: KVLayout, pages: int, on_page: Callable[[], None]) -> None:
        super().__init__(layout, pages)
        self.on_page = on_page

    def promote(self, keys: Sequence[TierKey], pool: torch.Tensor, page_ids: Sequence[int]) -> int:
        got = 0
        for key, page in zip(keys, page_ids, strict=False):
            if not super().promote([key], pool, [page]):
                break
            got += 1
            self.on_page()
        return got


class Eager(MirroredIndex):
    """The bug the PENDING state rules out: adopted pages stored STORED at once."""

    def insert_chain(
        self,
        parent_key: PrefixKey,
        keys: Sequence[PrefixKey],
        pages: Sequence[PageId],
        token_bytes: bytes,
        space: KeySpace = KeySpace(""),
        medium: str = "",
    ) -> list[PageStored]:
        return super().insert_chain(parent_key, keys, pages, token_bytes, space)


class Rig:
    """A kept tiered pool in process: a TieredManager (host tier of 2 pages, disk tier of
    8) over a Manager of LAYOUT whose index is mirrored into a RecordingTable, and what
    the engine wrote: each committed page its key's marker, each other write a nonce.
    A crash image is checked at every store of the table and every page a promotion
    copies in; ``pending`` counts the promoted pages images dropped as PENDING."""

    def __init__(self, directory: Path, index: type[MirroredIndex] = MirroredIndex) -> None:
        self.n, self.ps = LAYOUT.num_pages, LAYOUT.page_size
        self.buf, table = it.new_table(self.n, self.ps, 4096, it.RecordingTable)
        assert isinstance(table, it.RecordingTable)
        self.memory = torch.zeros(LAYOUT.total_bytes, dtype=torch.uint8)
        self.views = LAYOUT.layer_views(self.memory)
        host = CopyByPage(LAYOUT, 2, self.crash_point)
        self.stack = TierStack(host, DiskTier(LAYOUT, directory, 8 * (LAYOUT.page_bytes + 80)))
        manager = Manager(LAYOUT, record_evictions=True, index=index(table))
        self.manager = tiering.TieredManager(
            LAYOUT, self.memory, self.stack, manager=manager, placed=table.placed
        )
        self.markers: dict[bytes, float] = {}
        self.nonces = self.pending = 0
        table.on_store = self.crash_point

    def mark(self, key: bytes) -> float:
        return self.markers.setdefault(key, float(len(self.markers) + 1))

    def write(self, page: int, value: float) -> None:
        for view in self.views:
            view[page].fill_(value)

    def holds(self, views: list[torch.Tensor], page: int, key: bytes) -> bool:
        return all(bool((view[page] == self.mark(key)).all()) for view in views)

    def crash_point(self) -> None:
        """What a restart would restore if the daemon died now: only marked pages."""
        found = it.reopen(bytes(self.buf), self.n, self.ps).opened
        assert set(found.dropped) <= {"pending"}, found.dropped
        self.pending += found.dropped["pending"]
        views = LAYOUT.layer_views(self.memory.clone())
        for entry in found.entries:
            assert self.holds(views, entry.page, entry.key), f"page {entry.page}: not its bytes"

    def scatter(self, pool: torch.Tensor, pages: Sequence[int], data: torch.Tensor) -> None:
        """tiering.scatter_pages (the disk tier's promotions), a page at a time."""
        for i, page in enumerate(pages):
            scatter_pages(pool, [page], data[i : i + 1])
            self.crash_point()

    def run(self, seq: int, tokens: list[int]) -> list[tuple[str, int]]:
        """An engine's request: allocate (hits checked), write, commit, free; its sources."""
        if not tokens:
            return []
        try:
            got = self.manager.allocate(seq, tokens)
        except OutOfPages:
            return []
        keys = list(chain_keys(ROOT, encode_tokens(tokens), self.ps))
        cached = got.num_cached_tokens // self.ps
        for i, page in enumerate(got.pages):
            if i < cached:
                assert self.holds(self.views, page, keys[i]), f"hit page {i}: not its bytes"
            elif i < len(keys):
                self.write(page, self.mark(keys[i]))
            else:
                self.nonces += 1
                self.write(page, -float(self.nonces))
        self.manager.commit(seq, tokens)
        self.manager.free(seq)
        return got.sources

    def run_pages(self, seq: int, tokens: list[int]) -> None:
        """allocate_pages (one-page chains), write the misses, commit_pages, free."""
        tokens = tokens[: len(tokens) // self.ps * self.ps]
        if not tokens:
            return
        try:
            got = self.manager.allocate_pages(seq, tokens)
        except OutOfPages:
            return
        data, stride = encode_tokens(tokens), 4 * self.ps
        for i, (page, hit) in enumerate(zip(got.pages, got.hits, strict=True)):
            key = page_key(ROOT, data[i * stride : (i + 1) * stride])
            if hit:
                assert self.holds(self.views, page, key), f"hit chain {i}: not its bytes"
            else:
                self.write(page, self.mark(key))
        self.manager.commit_pages(seq, tokens)
        self.manager.free(seq)

    def settled(self) -> None:
        """Between requests: every promotion placed, the table mirroring the index."""
        self.manager.check_integrity()
        found = it.reopen(bytes(self.buf), self.n, self.ps).opened
        assert not found.dropped, found.dropped
        live = self.manager.prefix_snapshot()
        assert {(e.key, e.page) for e in found.entries} == {(e.key, e.page) for e in live}


def short(n: int) -> list[int]:
    """A prompt of two full pages and one token more (three pool pages)."""
    return [10 * n + t for t in range(2 * LAYOUT.page_size + 1)]


def promote_once(rig: Rig) -> list[tuple[str, int]]:
    """Prompt 0 committed, pushed out of the pool (6 pages) by three more, brought back."""
    with mock.patch.object(tiering, "scatter_pages", rig.scatter):
        for n in range(4):
            rig.run(n, short(n))
        return rig.run(9, short(0))


def test_a_promotion_cut_short_never_comes_back(tmp_path: Path) -> None:
    rig = Rig(tmp_path / "disk")
    try:
        sources = promote_once(rig)
        assert [m for m, _ in sources[1:]] and sources[0] == ("pool", 0), sources
        assert rig.pending >= 2  # images taken while its pages were indexed, not placed
        rig.settled()
    finally:
        rig.stack.close()


def test_control_pages_stored_before_their_copy_are_caught(tmp_path: Path) -> None:
    rig = Rig(tmp_path / "disk", Eager)
    try:
        with pytest.raises(AssertionError, match="not its bytes"):
            promote_once(rig)
    finally:
        rig.stack.close()


def base(n: int) -> list[int]:
    """Prompt ``n`` of 6: the odd ones share their first two pages."""
    return ([1, 2, 3, 4] if n % 2 else []) + [10 * (n + 1) + t for t in range(8)]


OPS = st.lists(
    st.tuples(
        st.sampled_from(["run", "run", "run", "pages", "lookup", "lookup_pages"]),
        st.integers(0, 5),  # which prompt
        st.integers(1, 12),  # how many of its tokens
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=60, deadline=None)
@given(ops=OPS)
def test_no_crash_image_of_tiered_traffic_restores_a_wrong_page(
    ops: list[tuple[str, int, int]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Random requests (chains and one-page chains, allocations and lookups, each may
    promote, evict and spill): every crash image restores only pages holding their
    key's marker, and between requests every promotion is placed."""
    rig = Rig(tmp_path_factory.mktemp("disk") / "tier")
    try:
        with mock.patch.object(tiering, "scatter_pages", rig.scatter):
            for seq, (op, n, length) in enumerate(ops):
                tokens = base(n)[:length]
                if op == "run":
                    rig.run(seq, tokens)
                elif op == "pages":
                    rig.run_pages(seq, tokens)
                elif op == "lookup":
                    rig.manager.lookup(tokens)
                else:
                    whole = tokens[: len(tokens) // LAYOUT.page_size * LAYOUT.page_size]
                    rig.manager.lookup_pages(whole)
                rig.settled()
    finally:
        rig.stack.close()


# -- the host tier alone, after a SIGKILL -------------------------------------------------


def test_a_host_tier_comes_back_after_a_sigkill(endpoint: str, tmp_path: Path) -> None:
    """Its entries are promoted with their markers: none was written down anywhere."""
    pool = host_only_flag(64)  # room for every page spilled: no host tier eviction
    daemon = serve(endpoint, tmp_path, pool)
    old, _ = warm(endpoint)
    held = host_pages(old)
    assert held >= 2 * PAGES, held
    daemon.stop(signal.SIGKILL)
    daemon = serve(endpoint, tmp_path, pool)
    try:
        assert f"host tier re-adopted {held} entries" in daemon.output, daemon.output
        assert "(0 dropped: none)" in daemon.output, daemon.output
        with Client.connect(endpoint) as new:
            assert host_pages(new) == held
            in_pool = {page.key for page in new.snapshot().pages}
            below = [n for n in range(8) if not set(keys_of(n)) & in_pool]
            assert below, "no prompt was held by the host tier alone"
            with pytest.raises(StaleEpoch):
                old.heartbeat()  # fenced: promotions may take pool pages once released
            deadline = time.monotonic() + 10
            while "withheld pages released" not in daemon.output:
                assert time.monotonic() < deadline, daemon.output
                time.sleep(0.1)
            for seq, n in enumerate(range(8), start=100):
                got = new.allocate(seq, prompt(n), compute_last=False)
                assert got.num_cached_tokens == PAGES * PAGE, (n, got.sources)
                assert holds(new, got.pages, n), f"prompt {n}: not its bytes"
                if n in below:
                    assert [tuple(s) for s in got.sources] == [("pool", 0), ("host", PAGES * PAGE)]
                new.free(seq)
            new.check_integrity()
    finally:
        old.close()
        daemon.stop()


def test_a_changed_host_tier_capacity_starts_the_host_tier_alone_empty(
    endpoint: str, tmp_path: Path
) -> None:
    daemon = serve(endpoint, tmp_path, host_only_flag(64))
    old, _ = warm(endpoint)
    old.close()
    daemon.stop(signal.SIGKILL)
    daemon = serve(endpoint, tmp_path, host_only_flag(48))
    try:
        out = daemon.output
        assert "host tier settings changed (capacity_pages 64 -> 48)" in out, out
        assert "starting the host tier empty" in out and "re-adopted 26 committed pages" in out
        with Client.connect(endpoint) as new:
            assert host_pages(new) == 0
            got = new.allocate(1, prompt(7), compute_last=False)  # the pool's own, kept
            assert got.num_cached_tokens == PAGES * PAGE and holds(new, got.pages, 7)
            new.free(1)
        ours = [n for n in os.listdir("/dev/shm") if n.startswith(segment_prefix(endpoint))]
        assert len(ours) == 3, ours  # pool, index table, the new host tier: the old one went
    finally:
        daemon.stop()
