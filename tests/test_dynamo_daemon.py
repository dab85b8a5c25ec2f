"""End to end: a daemon started with ``--events-format vllm`` feeds Dynamo's standalone
KV indexer; engines commit through kvcore and the indexer answers each prompt's cached
length, and less after eviction."""

from __future__ import annotations

import importlib.util
import random
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from kvcore_ipc.messages import PageStoredEvent

if importlib.util.find_spec("dynamo") is None or importlib.util.find_spec("dynamo.indexer") is None:
    pytest.skip(
        "Dynamo's indexer is not installed (pip install --no-deps ai-dynamo==1.6.1 "
        "ai-dynamo-runtime==1.6.1)",
        allow_module_level=True,
    )
_help = subprocess.run(
    [sys.executable, "-m", "kvcore.daemon", "--help"], capture_output=True, text=True, timeout=60
).stdout
if "--events-format" not in _help or "tokens" not in PageStoredEvent.__struct_fields__:
    pytest.skip("this daemon has no --events-format vllm yet", allow_module_level=True)

from test_dynamo_indexer import Indexer  # noqa: E402
from vllm_events_helpers import free_port  # noqa: E402

from kvcore import Client  # noqa: E402
from kvcore.daemon_process import DaemonProcess  # noqa: E402

PAGE = 4
POOL = f"name=default,num_layers=1,num_kv_heads=1,head_dim=8,page_size={PAGE},dtype=float32,num_pages=16"


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[DaemonProcess, Indexer]]:
    events = f"tcp://127.0.0.1:{free_port()}"
    with DaemonProcess.private(
        "--pool", POOL, "--events", events, "--events-format", "vllm", "--insecure"
    ) as d:
        indexer = Indexer(events, PAGE)
        try:
            with Client.connect(d.endpoint, map_memory=False) as client:
                deadline = time.monotonic() + 30
                while True:  # wait out ZeroMQ's slow joiner with fresh probe prompts
                    probe = [random.randrange(10_000, 20_000) for _ in range(PAGE + 1)]
                    commit(client, probe)
                    if indexer.wait_for(probe, PAGE) == PAGE:
                        break
                    assert time.monotonic() < deadline, "the indexer never heard the daemon"
            yield d, indexer
        finally:
            indexer.close()


def commit(client: Client, tokens: list[int]) -> None:
    seq = random.getrandbits(63)
    client.allocate(seq, tokens)
    client.commit(seq, tokens)  # the K/V bytes do not matter to the index
    client.free(seq)


def test_the_indexer_answers_what_engines_committed_and_less_after_eviction(
    stack: tuple[DaemonProcess, Indexer],
) -> None:
    daemon, indexer = stack
    prompt = list(range(100, 114))  # 3 full pages + 2 tokens
    with Client.connect(daemon.endpoint, map_memory=False) as client:
        commit(client, prompt)
        assert indexer.wait_for(prompt, 12) == 12
        seq = random.getrandbits(63)
        client.allocate(seq, list(range(500, 500 + 15 * PAGE)))  # needs cached pages: evicts
        assert indexer.wait_for(prompt, 0) < 12
        client.free(seq)


def test_a_namespace_is_queried_as_its_lora_name(stack: tuple[DaemonProcess, Indexer]) -> None:
    daemon, indexer = stack
    prompt = list(range(700, 709))
    with Client.connect(daemon.endpoint, namespace="tenant-a", map_memory=False) as client:
        commit(client, prompt)
    assert indexer.wait_for(prompt, 8, lora_name="tenant-a") == 8
    assert indexer.matched(prompt) == 0
