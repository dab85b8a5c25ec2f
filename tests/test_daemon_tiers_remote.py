"""Two daemons on one machine share pages through a real Mooncake master on loopback.

1. An engine on daemon 1 computes and commits a prompt; daemon 2, which never saw it,
   serves the full pages as hits through the store, with byte-identical K/V, and the
   transformers adapter's tokens on daemon 2 equal DynamicCache's.
2. The master is killed mid-run: both daemons keep answering, each request within a
   bound, from their local (host) tiers; the remote tier's misses rise; nothing hangs.

The daemons share the deployment's secret (tier_secret_file): a remote tier without one
is refused at start (tests/test_tiers_config.py). One master for the module (its
teardown is slow). Skipped where mooncake is missing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvcore_ipc.messages import TierStats
from mooncake_helpers import SKIP_REASON, Master, master_binary, start_master

from kvcore import Client
from kvcore.daemon_process import DaemonProcess
from kvcore.demo import NAMESPACE, PAGE_SIZE, SYSTEM_PROMPT_TOKENS, finish_engine, start_engine
from kvcore.demo_model import TinyLlama

pytestmark = [
    pytest.mark.skipif(master_binary() is None, reason=SKIP_REASON),
    pytest.mark.timeout(300),
]

TIMEOUT_S = 0.5  # remote_timeout_s: the longest a request waits on the store
BOUND_S = 4 * TIMEOUT_S + 1.0  # a request's latency bound with the store gone (locate + get)
PAGES = 64


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Master]:
    running = start_master(tmp_path_factory.mktemp("mooncake"))
    yield running
    running.stop()


def pool_flag(master: Master, secret: Path) -> str:
    spec = TinyLlama()
    page_bytes = spec.num_layers * 2 * PAGE_SIZE * spec.num_kv_heads * spec.head_dim * 4  # float32
    return (
        spec.pool_flag(page_size=PAGE_SIZE, num_pages=PAGES)
        + f",host_tier={4 * PAGES * page_bytes}"
        + f",remote_master={master.address},remote_metadata={master.metadata_server}"
        + f",remote_timeout_s={TIMEOUT_S},tier_secret_file={secret}"
    )


@pytest.fixture(scope="module")
def daemons(
    master: Master, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[DaemonProcess]]:
    tmp = tmp_path_factory.mktemp("daemons")
    secret = tmp / "tier.secret"  # one secret, as every node of a deployment has it
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    flag = pool_flag(master, secret)
    with (
        DaemonProcess(
            "--endpoint", f"ipc://{tmp / 'one.sock'}", "--pool", flag, timeout_s=60
        ) as one,
        DaemonProcess(
            "--endpoint", f"ipc://{tmp / 'two.sock'}", "--pool", flag, timeout_s=60
        ) as two,
    ):
        yield [one, two]


def remote(client: Client) -> TierStats:
    (pool,) = [p for p in client.daemon_stats().pools if p.name == client.pool]
    return {t.medium: t for t in pool.tiers}["remote"]


def wait_for(check: object, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_a_prompt_committed_on_one_daemon_is_a_hit_on_the_other(
    daemons: list[DaemonProcess],
) -> None:
    one, two = daemons
    assert not any("trusts every client" in d.output for d in daemons)  # keyed: no warning
    tokens = list(range(7, 7 + 4 * PAGE_SIZE + 1))  # 4 full pages, then one token
    with (
        Client.connect(one.endpoint, namespace="bytes") as a,
        Client.connect(two.endpoint, namespace="bytes") as b,
    ):
        got = a.allocate(1, tokens)
        for n, page in enumerate(got.pages):
            for layer, view in enumerate(a.kv_caches):
                view[page].fill_(float(n * 100 + layer))
        a.commit(1, tokens)
        wait_for(lambda: remote(a).stored >= 4)  # published in the background
        wait_for(lambda: b.lookup(tokens).num_cached_tokens == 4 * PAGE_SIZE)  # b joined
        hit = b.allocate(1, tokens)
        assert hit.num_cached_tokens == 4 * PAGE_SIZE
        for n, page in enumerate(hit.pages[:4]):
            for layer, (va, vb) in enumerate(zip(a.kv_caches, b.kv_caches, strict=True)):
                assert bool((vb[page] == va[got.pages[n]]).all()), f"page {n} layer {layer}"
        assert remote(b).hits >= 4 and remote(b).corrupt == 0
        # b's allocate itself brings a second prompt up: its reply names the store
        second = [t + 10_000 for t in tokens]
        a.allocate(2, second)
        a.commit(2, second)
        wait_for(lambda: remote(a).stored >= 8)
        hit = b.allocate(2, second)
        assert hit.sources == [("pool", 0), ("remote", 4 * PAGE_SIZE)]
        b.check_integrity()

    engine_a = finish_engine(start_engine(one.endpoint, "default", "A", 8))
    with Client.connect(one.endpoint, namespace=NAMESPACE) as a:
        wait_for(lambda: remote(a).stored >= 4 + SYSTEM_PROMPT_TOKENS // PAGE_SIZE)
    engine_b = finish_engine(start_engine(two.endpoint, "default", "B", 8), go=True)
    assert engine_a["equal"] and engine_b["equal"]  # tokens equal DynamicCache's
    assert engine_a["cached_tokens"] == 0
    assert engine_b["cached_tokens"] >= SYSTEM_PROMPT_TOKENS // PAGE_SIZE * PAGE_SIZE


def test_master_killed_mid_run_both_daemons_keep_serving(
    daemons: list[DaemonProcess], master: Master
) -> None:
    clients = [Client.connect(d.endpoint, namespace="killed") for d in daemons]
    try:
        prompts = [[1000 * (i + 1) + t for t in range(2 * PAGE_SIZE + 1)] for i in range(PAGES)]
        for client in clients:  # more than the pool: the first prompts live in the host tier
            for i, tokens in enumerate(prompts):
                client.allocate(i, tokens)
                client.commit(i, tokens)
                client.free(i)
        before = [remote(c).timeouts + remote(c).misses for c in clients]
        master.kill()
        for client in clients:
            for i in range(4):
                start = time.monotonic()
                hit = client.allocate(10_000 + i, prompts[i])  # evicted: in the host tier
                assert time.monotonic() - start < BOUND_S
                assert hit.num_cached_tokens == 2 * PAGE_SIZE
                client.free(10_000 + i)
            for i in range(4):  # never seen anywhere: the store is asked, and misses
                start = time.monotonic()
                fresh = [5_000_000 + 100 * i + t for t in range(2 * PAGE_SIZE + 1)]
                assert client.allocate(20_000 + i, fresh).num_cached_tokens == 0
                assert time.monotonic() - start < BOUND_S
                client.free(20_000 + i)
            client.check_integrity()
        after = [remote(c).timeouts + remote(c).misses for c in clients]
        assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
    finally:
        for client in clients:
            client.close()
