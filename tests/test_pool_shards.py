"""Sharded pools (pipeline stages): one region per stage, one Manager and prefix index.

Two stage processes map shards 0 and 1 of one pool and write different bytes into
the same pages; each reads its own back, and one allocate/commit of the
controller (the connector's scheduler side) is one prefix hit for both. A shard
past the last, or a shard count the client did not expect, is refused; every
shard's segment goes when the pool does, or when a later daemon sweeps a killed
one's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcore import Client
from kvcore.config import PoolConfig, parse_pool_spec
from kvcore.daemon_process import DaemonProcess
from kvcore.errors import BadRequest, LayoutMismatch
from kvcore.layout import KVLayout

SPEC = "name=kv,num_layers=2,num_kv_heads=1,head_dim=8,page_size=4,dtype=float32,num_pages=16"
POOL = SPEC + ",shards=2"
PROMPT = list(range(500, 514))  # 3 full pages of 4 tokens + 2

RANK = r"""
import json, sys
from kvcore import Client

endpoint, rank = sys.argv[1], int(sys.argv[2])
client = Client.connect(endpoint, pool="kv", shard=rank, shards=2, name=f"rank{rank}")
pages = json.loads(sys.stdin.readline())
for layer, cache in enumerate(client.kv_caches):
    for page in pages:
        cache[page] = 100.0 * (rank + 1) + layer  # this stage's layers: its own value
print(json.dumps({"written": True}), flush=True)
hit = json.loads(sys.stdin.readline())  # the pages of another sequence's prefix hit
own = all(
    bool((cache[page] == 100.0 * (rank + 1) + layer).all())
    for layer, cache in enumerate(client.kv_caches)
    for page in hit
)
print(json.dumps({"own": own, "shards": client.shards, "shard": client.attach_info.shard}),
      flush=True)
client.close()
"""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    tmp: Path = tmp_path_factory.mktemp("shards")
    args = ("--endpoint", f"ipc://{tmp / 'd.sock'}", "--pool", POOL, "--allow-ephemeral")
    with DaemonProcess(*args) as d:
        yield d


def rank_process(endpoint: str, rank: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", RANK, endpoint, str(rank)],
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def tell(proc: subprocess.Popen[str], value: object) -> dict[str, object]:
    """Send one JSON line, read one back."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps(value) + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        assert proc.stderr is not None
        raise AssertionError(proc.stderr.read())
    reply: dict[str, object] = json.loads(line)
    return reply


def test_two_ranks_write_their_own_shard_and_share_one_prefix_index(
    daemon: DaemonProcess,
) -> None:
    ranks = [rank_process(daemon.endpoint, rank) for rank in (0, 1)]
    try:
        with Client.connect(daemon.endpoint, pool="kv", map_memory=False) as books:
            alloc = books.allocate(1, PROMPT)  # the scheduler side: pages for both ranks
            for proc in ranks:
                assert tell(proc, alloc.pages) == {"written": True}
            assert books.commit(1, PROMPT) == 3  # once, for every shard: all ranks saved
            books.free(1)
            hit = books.allocate(2, PROMPT)
            assert hit.num_cached_tokens == 12 and hit.pages[:3] == alloc.pages[:3]
            for rank, proc in enumerate(ranks):
                assert tell(proc, hit.pages[:3]) == {"own": True, "shards": 2, "shard": rank}
            stats = books.stats()
            assert stats.total_pages == 16  # pages count once: page p is p in every shard
            assert stats.cached_pages == 3
            (pool,) = books.daemon_stats().pools
            assert pool.shards == 2  # what `kvcore stats` shows
            books.free(2)
            books.check_integrity()
    finally:
        for proc in ranks:
            proc.communicate(timeout=60)
    assert [proc.returncode for proc in ranks] == [0, 0]


def test_each_shard_is_its_own_region(daemon: DaemonProcess) -> None:
    with (
        Client.connect(daemon.endpoint, pool="kv", shard=0) as zero,
        Client.connect(daemon.endpoint, pool="kv", shard=1) as one,
    ):
        assert zero.attach_info.memory != one.attach_info.memory
        assert (zero.shards, one.shards) == (2, 2)
        zero.kv_caches[0][5].fill_(1.0)
        one.kv_caches[0][5].fill_(2.0)
        assert bool((zero.kv_caches[0][5] == 1.0).all())
        assert bool((one.kv_caches[0][5] == 2.0).all())
        assert zero.layout == one.layout and zero.layout.num_kv_heads == 1  # one rank's heads


def test_a_shard_past_the_last_is_a_bad_request(daemon: DaemonProcess) -> None:
    with pytest.raises(BadRequest, match="2 shard"):
        Client.connect(daemon.endpoint, pool="kv", shard=2, map_memory=False)


def test_another_shard_count_is_a_layout_mismatch_naming_both(daemon: DaemonProcess) -> None:
    with pytest.raises(LayoutMismatch, match=r"2 shard.*expects 4.*shards=4"):
        Client.connect(daemon.endpoint, pool="kv", shard=1, shards=4, map_memory=False)


def test_reconnect_maps_the_same_shard(daemon: DaemonProcess) -> None:
    with Client.connect(daemon.endpoint, pool="kv", shard=1) as client:
        before = client.attach_info.memory
        client.reconnect()
        assert client.attach_info.shard == 1 and client.attach_info.memory == before


def test_an_ephemeral_pool_has_the_shards_asked_for_and_unlinks_them_all(
    daemon: DaemonProcess,
) -> None:
    layout = KVLayout(1, 1, 8, 4, "float32", 8)
    first = Client.connect(daemon.endpoint, pool="eph", layout=layout, ephemeral=True, shards=2)
    second = Client.connect(daemon.endpoint, pool="eph", shard=1, shards=2)
    names = [c.attach_info.memory.name for c in (first, second)]  # type: ignore[union-attr]
    assert len(set(names)) == 2 and all(os.path.exists(f"/dev/shm/{n}") for n in names)
    first.close()
    second.close()
    with Client.connect(daemon.endpoint, pool="kv", map_memory=False) as observer:
        observer.heartbeat()  # the daemon reaps the pool between requests
        assert _gone(names, observer)


def test_a_killed_daemons_shards_are_gone_when_the_next_starts(tmp_path: Path) -> None:
    """Each shard is a segment named like an unsharded pool's, so the next daemon of the
    endpoint sweeps them all (if the resource tracker has not unlinked them already)."""
    endpoint = ("--endpoint", f"ipc://{tmp_path / 'd.sock'}")
    first = DaemonProcess(*endpoint, "--pool", POOL).start()
    names = []
    for shard in (0, 1):
        with Client.connect(first.endpoint, pool="kv", shard=shard, map_memory=False) as c:
            names.append(c.attach_info.memory.name)  # type: ignore[union-attr]
    assert first.proc is not None
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(30)
    (tmp_path / "d.sock").unlink(missing_ok=True)
    with DaemonProcess(*endpoint, "--pool", SPEC):
        assert not any(os.path.exists(f"/dev/shm/{n}") for n in names)


def test_shards_in_the_configuration() -> None:
    pool = parse_pool_spec(SPEC.replace("num_pages=16", "size=4096") + ",shards=2")
    assert pool.shards == 2
    one = parse_pool_spec(SPEC.replace("num_pages=16", "size=4096")).layout()
    assert pool.layout().num_pages == one.num_pages // 2  # size is every shard's together
    assert pool.total_bytes() == 2 * pool.layout().total_bytes <= 4096
    for bad in (0, 65):
        with pytest.raises(BadRequest, match="shards is 1 to 64"):
            PoolConfig(shards=bad).validate()
    with pytest.raises(BadRequest, match="lower tiers"):
        parse_pool_spec(POOL + ",host_tier=1MiB").validate()


def _gone(names: list[str], observer: Client) -> bool:
    for _ in range(100):
        if not any(os.path.exists(f"/dev/shm/{n}") for n in names):
            return True
        observer.heartbeat()
    return False


def test_cuda_shards_need_a_gpu_each() -> None:
    import torch

    from kvcore.daemon.pools import shard_devices

    assert shard_devices("cpu", 3) == ["cpu"] * 3
    assert shard_devices("cuda:1", 1) == ["cuda:1"]  # one shard: the device named, as before
    have = torch.cuda.device_count()
    with pytest.raises(BadRequest, match=rf"needs GPUs 0 to {have + 1}; this machine has {have}"):
        shard_devices("cuda:0", have + 2)
