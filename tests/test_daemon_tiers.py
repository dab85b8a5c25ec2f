"""Lower tiers inside a real daemon: a working set 4x the pool cycles through a host tier
much larger than the pool and comes back as hits with the bytes written; a disk tier
serves the old prefixes to a new daemon on the same directory; a corrupted disk entry is
a counted miss, never wrong K/V; events and stats say where pages went."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvcore_ipc.events import EventSubscriber
from kvcore_ipc.messages import PageRemovedEvent, PageStoredEvent, TierStats

from kvcore import Client
from kvcore.daemon_process import DaemonProcess

PAGE = 4
POOL_PAGES = 16
PROMPT_PAGES = 3  # full pages a prompt's hit may cover (the prompt has one token more)
POOL = (
    f"num_layers=2,num_kv_heads=1,head_dim=8,page_size={PAGE},dtype=float32,num_pages={POOL_PAGES}"
)
PAGE_BYTES = 2 * 2 * PAGE * 1 * 8 * 4  # layers x K/V x tokens x heads x dim x float32


def prompt(i: int) -> list[int]:
    return [1000 * (i + 1) + t for t in range(PROMPT_PAGES * PAGE + 1)]


def fill(client: Client, pages: list[int], first: int, i: int) -> None:
    """Write a pattern naming (prompt i, page, layer) into pages[first:]."""
    for n, page in enumerate(pages[first:], start=first):
        for layer, view in enumerate(client.kv_caches):
            view[page].fill_(float(i * 100 + n * 10 + layer))


def holds_pattern(client: Client, pages: list[int], count: int, i: int) -> bool:
    return all(
        bool((view[page] == float(i * 100 + n * 10 + layer)).all())
        for n, page in enumerate(pages[:count])
        for layer, view in enumerate(client.kv_caches)
    )


def serve_prompt(client: Client, seq: int, i: int) -> int:
    """An engine's request: allocate, write what missed, commit, free; the cached pages."""
    tokens = prompt(i)
    got = client.allocate(seq, tokens)
    cached = got.num_cached_tokens // PAGE
    assert holds_pattern(client, got.pages, cached, i), f"prompt {i}: wrong K/V after a hit"
    fill(client, got.pages, cached, i)
    client.commit(seq, tokens)
    client.free(seq)
    return cached


def tiers(client: Client) -> dict[str, TierStats]:
    (pool,) = [p for p in client.daemon_stats().pools if p.name == client.pool]
    return {t.medium: t for t in pool.tiers}


@pytest.fixture(scope="module")
def host_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    tmp = tmp_path_factory.mktemp("host")
    endpoint, pool = f"ipc://{tmp / 'd.sock'}", f"{POOL},host_tier={64 * PAGE_BYTES}"
    with DaemonProcess("--endpoint", endpoint, "--events", "auto", "--pool", pool) as d:
        yield d


def test_host_tier_serves_a_working_set_four_times_the_pool(host_daemon: DaemonProcess) -> None:
    prompts = 4 * POOL_PAGES // PROMPT_PAGES + 1  # > 4x the pool's pages of distinct prefixes
    with Client.connect(host_daemon.endpoint) as client:
        sub = EventSubscriber(client.attach_info.events, pool=client.pool)
        time.sleep(0.3)
        assert [serve_prompt(client, i, i) for i in range(prompts)] == [0] * prompts
        again = [serve_prompt(client, 1000 + i, i) for i in range(4)]  # long evicted
        stats = tiers(client)["host"]
        client.check_integrity()
        events = [e for batch in sub.drain(timeout_ms=500) for e in batch.events]
        sub.close()
    assert again == [PROMPT_PAGES] * 4  # every full page a hit, with its bytes
    assert stats.hits >= 4 * PROMPT_PAGES and stats.corrupt == 0
    assert stats.pages <= 64 and stats.bytes_in >= stats.stored * PAGE_BYTES > 0
    assert {e.medium for e in events if isinstance(e, PageRemovedEvent)} == {"host"}
    promoted = [e for e in events if isinstance(e, PageStoredEvent) and e.medium == "host"]
    assert len(promoted) == 4 * PROMPT_PAGES


def test_lookup_promotes_and_counts_the_hit(host_daemon: DaemonProcess) -> None:
    with Client.connect(host_daemon.endpoint, namespace="lookups") as client:
        # enough prompts to push prompt 50 out of the pool, few enough that the host tier
        # keeps it whatever its policy (the last test left pages it protects, as hit)
        for i in range(POOL_PAGES // PROMPT_PAGES + 2):
            serve_prompt(client, i, 50 + i)
        hit = client.lookup(prompt(50))
        assert hit.num_cached_tokens == PROMPT_PAGES * PAGE
        assert hit.num_evictable_pages == PROMPT_PAGES  # promoted, held by nobody yet
        assert serve_prompt(client, 99, 50) == PROMPT_PAGES


def test_namespaces_stay_apart_below_the_pool(host_daemon: DaemonProcess) -> None:
    with Client.connect(host_daemon.endpoint, namespace="ns-a") as a:
        for i in range(4 * POOL_PAGES // PROMPT_PAGES + 1):
            serve_prompt(a, i, 200 + i)
    with Client.connect(host_daemon.endpoint, namespace="ns-b") as b:
        assert b.lookup(prompt(200)).num_cached_tokens == 0


def disk_daemon(tmp: Path, disk: Path) -> DaemonProcess:
    pool = f"{POOL},disk_tier={disk},disk_tier_size={256 * PAGE_BYTES}"
    return DaemonProcess("--endpoint", f"ipc://{tmp / 'd.sock'}", "--pool", pool)


def test_disk_tier_survives_a_restart_and_a_corrupt_entry_is_a_miss(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    prompts = 4 * POOL_PAGES // PROMPT_PAGES + 1
    with disk_daemon(tmp_path, disk) as daemon, Client.connect(daemon.endpoint) as client:
        for i in range(prompts):
            serve_prompt(client, i, i)
        assert tiers(client)["disk"].stored >= 3 * PROMPT_PAGES
    files = sorted(disk.glob("*.kv"), key=lambda f: f.stat().st_mtime)
    assert files, "nothing reached the disk"
    with disk_daemon(tmp_path, disk) as daemon, Client.connect(daemon.endpoint) as client:
        assert serve_prompt(client, 1, 0) == PROMPT_PAGES  # from disk, verified, exact bytes
        assert serve_prompt(client, 2, 1) == PROMPT_PAGES
        assert serve_prompt(client, 3, prompts - 1) == PROMPT_PAGES  # was in the pool: written back
        probe = client.lookup(prompt(2))  # promotes prompt 2's pages, reading its files
        assert probe.num_cached_tokens == PROMPT_PAGES * PAGE
    keys = _chain_files(disk, prompt(3))
    data = bytearray(keys[0].read_bytes())
    data[-1] ^= 0xFF
    keys[0].write_bytes(data)
    with disk_daemon(tmp_path, disk) as daemon, Client.connect(daemon.endpoint) as client:
        assert serve_prompt(client, 1, 3) == 0  # a miss: recomputed, never wrong K/V
        stats = tiers(client)["disk"]
        client.check_integrity()
    assert stats.corrupt == 1 and stats.misses >= 1


def test_a_page_major_pool_spills_and_promotes_through_its_tiers(tmp_path: Path) -> None:
    """--pool ...,order=PLKTH with host and disk tiers, through a real Client: pages the
    pool evicts go down (host, then disk) in their page-major stored form and come back
    as hits holding what was written (the Client's layer views take the order)."""
    pool = (
        f"{POOL},order=PLKTH,host_tier={8 * PAGE_BYTES},"
        f"disk_tier={tmp_path / 'disk'},disk_tier_size={256 * PAGE_BYTES}"
    )
    prompts = 2 * POOL_PAGES // PROMPT_PAGES + 1  # twice the pool: host and disk both fill
    endpoint = f"ipc://{tmp_path / 'd.sock'}"
    with (
        DaemonProcess("--endpoint", endpoint, "--pool", pool) as daemon,
        Client.connect(daemon.endpoint) as client,
    ):
        assert client.layout.order == "PLKTH"
        assert [serve_prompt(client, i, i) for i in range(prompts)] == [0] * prompts
        again = [serve_prompt(client, 1000 + i, i) for i in (0, 1, prompts - 4)]
        stats = tiers(client)
        client.check_integrity()
    assert again == [PROMPT_PAGES] * 3  # every full page a hit, with its bytes
    assert stats["host"].hits > 0 and stats["disk"].hits > 0
    assert stats["host"].corrupt == stats["disk"].corrupt == 0


def _chain_files(disk: Path, tokens: list[int]) -> list[Path]:
    """The disk tier's files of ``tokens``' full pages, in chain order."""
    from kvcore.layout import KVLayout
    from kvcore.prefix import KeySpace, chain_keys, encode_tokens, root_key
    from kvcore.tiers import layout_fingerprint

    layout = KVLayout(2, 1, 8, PAGE, "float32", POOL_PAGES)
    fp = layout_fingerprint(layout).hex()
    keys = chain_keys(
        root_key(KeySpace("default")), encode_tokens(tokens[: PROMPT_PAGES * PAGE]), PAGE
    )
    return [disk / f"{fp}-{key.hex()}.kv" for key in keys]


def test_kvcore_stats_shows_the_tiers(host_daemon: DaemonProcess) -> None:
    import io

    from rich.console import Console

    from kvcore.statsview import fetch, tier_table

    stats = fetch(host_daemon.endpoint, 3.0)
    (tiers_of_pool,) = [p["tiers"] for p in stats["pools"]]
    assert [t["medium"] for t in tiers_of_pool] == ["host"]
    out = io.StringIO()
    Console(file=out, width=160).print(tier_table(stats["pools"]))
    assert "host" in out.getvalue() and "corrupt" in out.getvalue()
