"""The one-page-chain operations the SGLang storage backend runs (``allocate_pages``,
``lookup_pages``, ``commit_pages``; spec/protocol.md): each page a chain of its own,
one sequence a call. In-process on the Manager (keys, hits, all-or-nothing), and on
a real daemon (ownership, quotas, typed errors, a failed op changes nothing, pages
visible only after their commit, a pool with tiers brings pages up from them); and
the SGLang backend on both kinds of pool (in SGLang's venv; skips without it)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang_helpers import sglang_venv

from kvcore import Client, KeySpace
from kvcore.daemon_process import DaemonProcess
from kvcore.errors import (
    BadRequest,
    Forbidden,
    KVCoreError,
    OutOfPages,
    QuotaExceeded,
)
from kvcore.layout import KVLayout
from kvcore.manager import Manager
from kvcore.prefix import PackedTokens

PS = 4  # tokens per page
SPACE = KeySpace(model="m")


def page(n: int) -> list[int]:
    """One page of tokens naming chain ``n``."""
    return [n, n + 1, n + 2, n + 3]


def pages(*ns: int) -> list[int]:
    return [t for n in ns for t in page(n)]


def packed(tokens: list[int]) -> PackedTokens:
    """``tokens`` as the packed form the ops also take (4 bytes a token, little-endian)."""
    return PackedTokens(struct.pack(f"<{len(tokens)}I", *tokens))


def manager(num_pages: int = 8) -> Manager:
    return Manager(KVLayout(1, 1, 8, PS, "float16", num_pages=num_pages))


def state(m: Manager) -> tuple[object, ...]:
    """What a failed op must leave as it was (the events are taken: compare first)."""
    return (m.stats(), m.prefix_snapshot(), [m.block_table(s) for s in range(1, 9) if s in m])


def test_each_page_is_its_own_chain_and_reads_only_after_its_commit() -> None:
    m = manager()
    got = m.allocate_pages(1, pages(10, 20, 30), SPACE)
    assert got.hits == [False] * 3 and len(set(got.pages)) == 3
    assert m.lookup_pages(pages(10, 20, 30), SPACE) == [False] * 3  # not committed: no hit
    assert m.commit_pages(1, pages(10, 20, 30)) == 3
    assert m.lookup_pages(pages(30, 99, 10), SPACE) == [True, False, True]  # any order
    assert m.lookup_pages(pages(10), KeySpace(model="other")) == [False]  # key spaces apart
    # page 20 is keyed as a prompt's first page: what a one-page allocate finds
    assert m.lookup(page(20), SPACE, compute_last=False).num_cached_tokens == PS
    m.allocate(2, page(30), SPACE, compute_last=False)
    assert m.block_table(2) == [got.pages[2]]
    again = m.allocate_pages(3, pages(20, 40), SPACE)
    assert again.hits == [True, False] and again.pages[0] == got.pages[1]
    assert m.commit_pages(3, pages(20, 40)) == 1  # the hit is left as it is
    for seq in (1, 2, 3):
        m.free(seq)
    assert m.stats().held_pages == 0 and m.stats().cached_pages == 4
    m.check_integrity()


def test_a_chain_twice_in_one_call_stays_private_once() -> None:
    m = manager()
    got = m.allocate_pages(1, pages(10, 10), SPACE)
    assert got.hits == [False, False]
    assert m.commit_pages(1, pages(10, 10)) == 1  # the second page's key is the first's
    m.free(1)
    assert m.stats().cached_pages == 1 and m.stats().free_pages == 7
    hit = m.allocate_pages(2, pages(10, 10), SPACE)  # one evictable page, pinned twice
    assert hit.hits == [True, True] and hit.pages[0] == hit.pages[1] == got.pages[0]
    m.check_integrity()


def test_failed_ops_change_nothing() -> None:
    m = manager(num_pages=4)
    m.allocate_pages(1, pages(10, 20), SPACE)
    m.commit_pages(1, pages(10, 20))
    m.take_events()
    before = state(m)
    with pytest.raises(OutOfPages):  # 3 fresh pages beside 2 held: all or nothing
        m.allocate_pages(2, pages(10, 30, 40, 50), SPACE)
    with pytest.raises(BadRequest, match="whole pages"):
        m.allocate_pages(2, [1, 2, 3], SPACE)
    with pytest.raises(BadRequest, match="whole pages"):
        m.lookup_pages([1, 2, 3], SPACE)
    with pytest.raises(BadRequest, match="whole pages"):
        m.commit_pages(1, pages(10, 20, 30))  # more than the sequence holds
    with pytest.raises(BadRequest, match="other tokens"):
        m.commit_pages(1, pages(10, 99))  # page 1 is indexed under chain 20's key
    with pytest.raises(BadRequest):
        m.allocate_pages(2, pages(10), KeySpace(model="x" * 300))
    with pytest.raises(BadRequest, match="4 bytes each"):
        m.allocate_pages(2, PackedTokens(bytes(4 * PS + 2)), SPACE)
    with pytest.raises(BadRequest, match="whole pages"):
        m.lookup_pages(packed([1, 2, 3]), SPACE)
    assert state(m) == before and m.take_events() == []
    assert m.allocate_pages(2, pages(10, 30), SPACE).hits == [True, False]  # 1 fresh fits
    m.check_integrity()


def test_a_commit_publishes_the_leading_pages_it_is_sent() -> None:
    m = manager()
    m.allocate_pages(1, pages(10, 20, 30), SPACE)
    assert m.commit_pages(1, pages(10)) == 1
    assert m.lookup_pages(pages(10, 20, 30), SPACE) == [True, False, False]
    assert m.commit_pages(1, pages(10, 20, 30)) == 2
    m.check_integrity()


CHAINS = st.lists(st.integers(0, 5).map(lambda n: 10 * n), max_size=4)
STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("allocate_pages"), st.integers(1, 4), CHAINS, st.booleans()),
        st.tuples(st.just("commit_pages"), st.integers(1, 4), CHAINS, st.booleans()),
        st.tuples(st.just("free"), st.integers(1, 4), st.just([]), st.just(False)),
        st.tuples(st.just("allocate"), st.integers(1, 4), CHAINS, st.just(False)),
    ),
    max_size=30,
)


@settings(max_examples=100, deadline=None)
@given(steps=STEPS)
def test_any_program_keeps_the_invariants_and_fails_whole(
    steps: list[tuple[str, int, list[int], bool]],
) -> None:
    """Random programs on a small pool, each op's tokens packed or not at random:
    after every step the Manager's invariants hold; a refused step changed nothing;
    ``lookup_pages`` answers what a one-page ``lookup`` (``compute_last=False``) does,
    packed or not; a chain's hit is its committed page."""
    m = manager(num_pages=5)
    written: dict[int, int] = {}  # chain -> the page committed for it (while indexed)
    for op, seq, chains, pack in steps:
        m.take_events()
        before = state(m)
        tokens = packed(pages(*chains)) if pack else pages(*chains)
        try:
            if op == "allocate_pages":
                got = m.allocate_pages(seq, tokens, SPACE)
                for n, p, hit in zip(chains, got.pages, got.hits, strict=True):
                    assert hit is (n in written and written[n] == p)
            elif op == "commit_pages":
                if seq in m:
                    table = m.block_table(seq)[: len(chains)]
                m.commit_pages(seq, tokens)
                for n, p in zip(chains, table, strict=False):
                    written.setdefault(n, p)
            elif op == "free":
                m.free(seq)
            elif chains:
                m.allocate(seq, page(chains[0]), SPACE, compute_last=False)
        except KVCoreError as exc:  # refused (bad input, no room, no such sequence)
            assert state(m) == before and m.take_events() == [], f"{op} failed ({exc}) and changed"
        m.check_integrity()
        indexed = {e.page for e in m.prefix_snapshot()}
        written = {n: p for n, p in written.items() if p in indexed}  # evicted: gone
        every = [10 * n for n in range(6)]
        assert m.lookup_pages(pages(*every), SPACE) == m.lookup_pages(packed(pages(*every)), SPACE)
        assert m.lookup_pages(pages(*every), SPACE) == [
            m.lookup(page(n), SPACE, compute_last=False).num_cached_tokens == PS for n in every
        ]


# -- on a daemon ------------------------------------------------------------------------

CONFIG = """
[[pools]]
name = "q"
num_layers = 1
num_kv_heads = 1
head_dim = 8
page_size = 4
dtype = "float16"
num_pages = 64
session_max_pages = 6
[[pools]]
name = "tiered"
num_layers = 1
num_kv_heads = 1
head_dim = 8
page_size = 4
dtype = "float16"
num_pages = 16
[pools.tiers]
host = "1MiB"
"""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    root: Path = tmp_path_factory.mktemp("pages-ops")
    (root / "kvcore.toml").write_text(CONFIG)
    with DaemonProcess(
        "--config", str(root / "kvcore.toml"), "--endpoint", f"ipc://{root / 'd.sock'}"
    ) as d:
        yield d


def test_on_a_daemon_ownership_quota_and_visibility(daemon: DaemonProcess) -> None:
    with (
        Client.connect(daemon.endpoint, pool="q", map_memory=False) as a,
        Client.connect(daemon.endpoint, pool="q", map_memory=False) as b,
    ):
        got = a.allocate_pages(1, pages(10, 20, 30), SPACE)
        assert got.hits == [False] * 3
        assert b.lookup_pages(pages(10, 20, 30), SPACE) == [False] * 3  # written, not committed
        with pytest.raises(Forbidden):
            b.commit_pages(1, pages(10, 20, 30))  # a's sequence
        with pytest.raises(Forbidden):
            b.free(1)
        held = a.stats().held_pages
        with pytest.raises(QuotaExceeded, match="session"):
            a.allocate_pages(2, pages(40, 50, 60, 70), SPACE)  # 3 + 4 > 6
        assert a.stats().held_pages == held and a.stats().num_sequences == 1
        with pytest.raises(BadRequest, match="whole pages"):
            a.allocate_pages(2, [1, 2], SPACE)
        with pytest.raises(BadRequest, match="4 bytes each"):
            a.allocate_pages(2, PackedTokens(bytes(4 * PS + 1)), SPACE)
        batch = a.batch()
        batch.commit_pages(1, packed(pages(10, 20, 30)))  # packed or not: the same tokens
        batch.free(1)
        assert batch.run() == [3, None]
        assert b.lookup_pages(pages(10, 20, 30, 40), SPACE) == [True, True, True, False]
        assert b.lookup_pages(packed(pages(40, 30)), SPACE) == [False, True]
        pinned = b.allocate_pages(7, pages(20, 40), SPACE)
        assert pinned.hits == [True, False] and pinned.pages[0] == got.pages[1]
        b.free(7)
        a.check_integrity()


def test_a_pool_with_tiers_serves_them_from_its_host_tier(daemon: DaemonProcess) -> None:
    """The tiered pool (16 pages, a host tier) serves the *_pages ops: chains pushed out
    of the pool into the host tier are hits again, with their bytes and medium "host"."""
    with Client.connect(daemon.endpoint, pool="tiered") as c:
        view = c.kv_caches[0]
        first = pages(*range(100, 108))  # 8 chains
        got = c.allocate_pages(1, first, SPACE)
        assert got.hits == [False] * 8
        for n, p in enumerate(got.pages):
            view[p].fill_(float(n + 1))
        c.commit_pages(1, first)
        c.free(1)
        for r in range(2):  # 16 other chains fill the pool: the first 8 go to the host tier
            other = pages(*range(200 + 8 * r, 208 + 8 * r))
            c.allocate_pages(10 + r, other, SPACE)
            c.commit_pages(10 + r, other)
            c.free(10 + r)
        again = c.allocate_pages(2, first, SPACE)
        assert again.hits == [True] * 8 and again.media == ["host"] * 8
        assert [float(view[p].flatten()[0]) for p in again.pages] == [n + 1.0 for n in range(8)]
        c.free(2)
        assert c.lookup_pages(first, SPACE) == [True] * 8  # in the pool again
        assert c.stats().num_sequences == 0
        c.check_integrity()


SCRIPT = """
import json, sys, torch
from kvcore.bench import sglang as b
from kvcore.layout import KVLayout
out = {}
for pool in ("plain", "tiered"):
    layout = KVLayout(1, 1, 8, 16, "float16", 64)
    host = b.host_pool(layout, "layer_first", 32)
    store = b.kvcore_backend(sys.argv[1], host, pool=pool)
    b._fill(host, 8, seed=1)
    keys = b.page_keys(16, 8, seed=1)
    src, dst = torch.arange(8 * 16), torch.arange(8 * 16, 16 * 16)
    stored = store.batch_set_v1(keys, src)
    again = store.batch_set_v1(keys[:4], src[: 4 * 16])  # hits: stored already
    hit = store.batch_exists(keys + ["never"])
    got = store.batch_get_v1(keys, dst)
    same = b._pages_equal(host, src, dst, torch)
    out[pool] = [all(stored), all(again), hit, all(got), same]
    out[pool].append(store.get_stats().prefetch_pgs_by_source)
    if pool == "tiered":  # 64 other pages push the 8 out of the pool, into its host tier
        for seed in range(2, 10):
            store.batch_set_v1(b.page_keys(16, 8, seed=seed), src)
        b._poison(host, dst, torch)
        got = store.batch_get_v1(keys, dst)
        metrics = store.get_stats()
        out["promoted"] = [all(got), b._pages_equal(host, src, dst, torch),
                           metrics.prefetch_pgs, metrics.prefetch_pgs_by_source]
    store.close()
print(json.dumps(out))
"""


@pytest.mark.timeout(300)
def test_sglang_storage_on_a_pool_with_tiers(tmp_path: Path) -> None:
    """KVCoreStorage (SGLang's host pool and factory, in its venv) stores, finds and
    fetches the same bytes with the ``*_pages`` ops on a plain pool and on a pool with a
    host tier. Its stats say where the fetched pages were: the pool, and, once other
    pages pushed them out of the tiered pool, its host tier (the same bytes, brought
    back)."""
    venv = sglang_venv()
    pool = (
        "num_layers=1,num_kv_heads=1,head_dim=8,page_size=16,dtype=float16,num_pages=64,order=LPKTH"
    )
    with DaemonProcess(
        "--endpoint",
        f"ipc://{tmp_path / 'd.sock'}",
        "--pool",
        f"name=plain,{pool}",
        "--pool",
        f"name=tiered,{pool},host_tier=1MiB,eviction=lru",  # lru: newer pages push older out
    ) as d:
        env = {**os.environ, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
        done = subprocess.run(
            [str(venv / "bin" / "python"), "-c", SCRIPT, d.endpoint],
            capture_output=True,
            text=True,
            env=env,
            timeout=280,
            check=False,
        )
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out == {
        "plain": [True, True, 8, True, True, {"pool": 8}],
        "tiered": [True, True, 8, True, True, {"pool": 8}],
        "promoted": [True, True, [8], {"host": 8}],
    }
