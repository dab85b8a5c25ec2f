"""Issue 40, point 3: a restarted daemon tells routers what it holds, so that NVIDIA
Dynamo's KV indexer (ai-dynamo 1.6.1, as tests/test_dynamo_daemon.py runs it) agrees
with it again.

A real daemon (``--restore``, ``--events-format vllm`` with a replay endpoint) feeds a
Dynamo indexer registered with that replay endpoint; an engine (a real client) commits
prompts, commits part of one and leaves one uncommitted, and the indexer answers what
the daemon holds. The daemon is then SIGKILLed or stopped with SIGTERM and started
again on the same endpoints. With no event since the start (the daemon repeats its
last message for a while: VllmEventPublisher.remind), the indexer that followed the
old daemon and a fresh one started only now both answer the re-adopted prefixes and
nothing of what did not come back, and both follow an eviction. The new
daemon numbers its messages above the old one's (else the old indexer drops them as
already seen); its replay socket holds AllBlocksCleared and then every re-adopted page
(the fresh indexer learns them there). Control: a daemon started with
``--no-restore`` makes both kinds of indexer answer nothing."""

from __future__ import annotations

import importlib.util
import math
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
import zmq

if importlib.util.find_spec("dynamo") is None or importlib.util.find_spec("dynamo.indexer") is None:
    pytest.skip(
        "Dynamo's indexer is not installed (pip install --no-deps ai-dynamo==1.6.1 "
        "ai-dynamo-runtime==1.6.1)",
        allow_module_level=True,
    )

from kvcore_ipc.shm import sweep
from kvcore_ipc.vllm_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockStored,
    VllmEventBatch,
    block_hash,
)
from test_dynamo_indexer import Indexer
from vllm_events_helpers import free_port

from kvcore import Client
from kvcore.daemon.daemon import segment_prefix
from kvcore.daemon.pools import MAX_EVENTS_PER_MESSAGE
from kvcore.daemon_process import DaemonProcess

PAGE, PAGES = 4, 6  # tokens a page, pages a prompt
POOL = (
    f"name=default,num_layers=1,num_kv_heads=1,head_dim=8,page_size={PAGE},"
    "dtype=float32,num_pages=1024"
)
COMMITTED = (0, 1, 2, 3)  # whole prompts
PARTIAL = 4  # its first 2 pages committed, the rest written and never committed
UNCOMMITTED = 5  # allocated, never committed
BULK = (10, 11, 12)  # prompts of 100 pages: the re-adopt spans several messages
BULK_PAGES = 100


def prompt(n: int) -> list[int]:
    pages = BULK_PAGES if n in BULK else PAGES
    return [1000 * n + t for t in range(pages * PAGE)]


SHOWN = (*COMMITTED, PARTIAL, UNCOMMITTED, *BULK)
HELD = {**{n: PAGES * PAGE for n in COMMITTED}, PARTIAL: 2 * PAGE, UNCOMMITTED: 0}
HELD |= {n: BULK_PAGES * PAGE for n in BULK}  # what the daemon holds, restored or not


@dataclass(frozen=True)
class Endpoints:
    request: str
    events: str
    replay: str


@pytest.fixture
def endpoints(tmp_path: Path) -> Iterator[Endpoints]:
    request = f"ipc://{tmp_path / 'kvcore.sock'}"
    yield Endpoints(request, f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
    with DaemonProcess("--endpoint", request, "--pool", POOL, "--no-restore"):
        pass  # cold: the manifest goes, the sweep unlinks what the test's daemons kept
    assert not sweep(segment_prefix(request))


def serve(ends: Endpoints, *flags: str) -> DaemonProcess:
    return DaemonProcess(
        "--endpoint", ends.request, "--pool", POOL, "--lease-timeout-s", "30",
        "--events", ends.events, "--events-format", "vllm", "--events-replay", ends.replay,
        "--insecure", *flags,
    ).start()  # fmt: skip


class ReplayingIndexer(Indexer):
    """``python -m dynamo.indexer`` with the daemon registered over HTTP, its replay
    endpoint included (``--workers`` registers none): on a gap in the message numbers,
    a first message numbered above 0 included, it asks the replay socket for the rest."""

    def __init__(self, ends: Endpoints) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dynamo.indexer", "--port", str(self.port), "--threads", "1"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while not isinstance(self.http("/workers"), list):
            assert self.proc.poll() is None and time.monotonic() < deadline, "no indexer"
            time.sleep(0.2)
        worker = {
            "instance_id": 1,
            "endpoint": ends.events,
            "replay_endpoint": ends.replay,
            "model_name": "default",
            "block_size": PAGE,
        }
        assert self.http("/register", worker) == {"status": "ok"}


def commit(client: Client, tokens: list[int]) -> None:
    seq = random.getrandbits(63)
    client.allocate(seq, tokens, compute_last=False)
    client.commit(seq, tokens)  # the K/V bytes do not matter to the index
    client.free(seq)


def heard(client: Client, indexer: Indexer) -> None:
    """Commit fresh one-page probe prompts until the indexer knows one: ZeroMQ's slow
    joiner, and after a restart the first event a subscriber gets from the new daemon
    (a gap in the numbers, which it replays: Dynamo asks for a replay on a gap only)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        probe = [random.randrange(100_000, 200_000) for _ in range(PAGE)]
        commit(client, probe)
        retry = time.monotonic() + 1  # a probe sent before the subscriber (re)joined is lost
        while time.monotonic() < retry:
            if indexer.matched(probe) == PAGE:
                return
            time.sleep(0.05)
    raise AssertionError("the indexer never heard the daemon")


def held(client: Client) -> dict[int, int]:
    """Prefix tokens the daemon holds of each shown prompt."""
    return {n: client.lookup(prompt(n), compute_last=False).num_cached_tokens for n in SHOWN}


def agree(client: Client, indexer: Indexer) -> dict[int, int]:
    """Assert the indexer answers each shown prompt what the daemon holds of it; that."""
    holds = held(client)
    answers = {n: indexer.wait_for(prompt(n), want) for n, want in holds.items()}
    assert answers == holds, "the indexer's answers (tokens) are not what the daemon holds"
    return holds


def replayed(ends: Endpoints, start: int = 0) -> list[tuple[int, VllmEventBatch]]:
    """What the replay socket holds from message ``start`` on, as vLLM's replay hands it."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(ends.replay)
    got = []
    try:
        sock.send_multipart((b"", start.to_bytes(8, "big")))
        while True:
            assert sock.poll(10_000), "the replay socket did not answer"
            _, _topic, seq, payload = sock.recv_multipart()
            if seq == END_SEQ:
                return got
            got.append(
                (int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload, type=VllmEventBatch))
            )
    finally:
        sock.close()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_dynamos_indexer_agrees_with_a_daemon_that_re_adopted_its_pool(
    endpoints: Endpoints, sig: int
) -> None:
    daemon = serve(endpoints, "--restore")
    indexers: list[Indexer] = []
    engine: Client | None = None
    try:
        old = ReplayingIndexer(endpoints)  # follows the daemon across its restarts
        indexers.append(old)
        engine = Client.connect(endpoints.request, map_memory=False, heartbeat=False)
        heard(engine, old)
        for n in (*COMMITTED, *BULK):
            commit(engine, prompt(n))
        engine.allocate(1, prompt(PARTIAL), compute_last=False)
        engine.commit(1, prompt(PARTIAL)[: 2 * PAGE])
        engine.allocate(2, prompt(UNCOMMITTED), compute_last=False)
        assert agree(engine, old) == HELD
        committed = len(engine.snapshot().pages)
        last_seq = replayed(endpoints)[-1][0]

        daemon.stop(sig)
        daemon = serve(endpoints, "--restore")
        readopted = re.search(r"re-adopted (\d+) committed pages", daemon.output)
        assert readopted and int(readopted[1]) == committed, daemon.output
        with Client.connect(endpoints.request, map_memory=False) as new:
            hashes = {block_hash(page.key) for page in new.snapshot().pages}
            assert len(hashes) == committed and held(new) == HELD

            # What a subscriber that replays now finds: AllBlocksCleared, then the stored
            # events of every re-adopted page, 1 + ceil(pages / 256) messages, numbered
            # after the old daemon's last.
            buffered = replayed(endpoints)
            seqs = [seq for seq, _ in buffered]
            assert seqs[0] > last_seq, "numbered from 0 again: the old indexer drops them"
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
            assert buffered[0][1].events == [AllBlocksCleared()]
            assert len(buffered) == 1 + math.ceil(committed / MAX_EVENTS_PER_MESSAGE)
            events = [e for _, b in buffered[1:] for e in b.events]
            stored = [e for e in events if isinstance(e, BlockStored)]
            assert stored == events
            assert sorted(h for e in stored for h in e.block_hashes) == sorted(hashes)

            # No event since the start: the daemon repeats its last message for a while,
            # so the old indexer sees the gap and replays the new daemon's messages, and
            # one that joins after the start learns them by replay.
            assert agree(new, old) == HELD
            fresh = ReplayingIndexer(endpoints)
            indexers.append(fresh)
            assert agree(new, fresh) == HELD

            deadline = time.monotonic() + 15  # the dead session's pages: withheld a while
            while (free := new.stats().free_pages) == 0 and time.monotonic() < deadline:
                time.sleep(0.2)
            probes = len(new.snapshot().pages) - sum(HELD.values()) // PAGE
            pages = free + probes + 6  # evicts at least 6 pages of the prompts shown
            new.allocate(3, list(range(1 << 20, (1 << 20) + pages * PAGE)), compute_last=False)
            after = agree(new, old)
            assert sum(after.values()) < sum(HELD.values()), "nothing re-adopted was evicted"
            assert agree(new, fresh) == after

        daemon.stop(signal.SIGKILL)  # control: a cold start holds nothing
        daemon = serve(endpoints, "--no-restore")
        with Client.connect(endpoints.request, map_memory=False) as cold:
            heard(cold, old)
            assert agree(cold, old) == dict.fromkeys(SHOWN, 0)
            cold_fresh = ReplayingIndexer(endpoints)
            indexers.append(cold_fresh)
            heard(cold, cold_fresh)
            assert agree(cold, cold_fresh) == dict.fromkeys(SHOWN, 0)
    finally:
        if engine is not None:
            engine.close()
        daemon.stop()
        for indexer in indexers:
            indexer.close()
