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

from kvcore import KeySpace

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


def commit(client: Client, tokens: list[int], space: KeySpace = KeySpace()) -> None:
    seq = random.getrandbits(63)
    client.allocate(seq, tokens, space)
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


def test_the_indexer_answers_per_salt_and_per_adapter(
    stack: tuple[DaemonProcess, Indexer],
) -> None:
    """Engines commit one prompt under two salts and two adapters (the salts as Dynamo's
    frontend hands them to vLLM, ``dynamo-cache-salt:`` + the salt): the indexer
    answers each salt and adapter its own length, and nothing to the others."""
    daemon, indexer = stack
    prompt = list(range(900, 913))  # 3 full pages + 1 token
    with Client.connect(daemon.endpoint, map_memory=False) as client:
        commit(client, prompt, KeySpace(salt="dynamo-cache-salt:u1"))
        commit(client, prompt, KeySpace(lora="adapter-a"))
        assert indexer.wait_for(prompt, 12, cache_salt="u1") == 12
        assert indexer.wait_for(prompt, 12, lora_name="adapter-a") == 12
        assert indexer.matched(prompt, cache_salt="u2") == 0
        assert indexer.matched(prompt, lora_name="adapter-b") == 0
        assert indexer.matched(prompt) == 0  # neither salt nor adapter: nothing committed
        assert client.lookup(prompt, KeySpace(salt="dynamo-cache-salt:u2")).num_cached_tokens == 0


def test_a_salted_sequence_committed_page_by_page_stays_under_its_salt(
    stack: tuple[DaemonProcess, Indexer],
) -> None:
    """Only a chain's first page names the salt (as vLLM's events do); the pages a
    sequence commits later carry none, and the indexer keeps them under it anyway."""
    daemon, indexer = stack
    prompt = list(range(1300, 1313))
    with Client.connect(daemon.endpoint, map_memory=False) as client:
        seq = random.getrandbits(63)
        client.allocate(
            seq, prompt[: PAGE + 1], KeySpace(salt="dynamo-cache-salt:u7", lora="adapter-a")
        )
        client.commit(seq, prompt[:PAGE])
        assert indexer.wait_for(prompt, PAGE, "adapter-a", "u7") == PAGE
        client.extend(seq, len(prompt) - PAGE - 1)
        client.commit(seq, prompt[PAGE:], start=PAGE)  # a later request: pages 1 and 2
        assert indexer.wait_for(prompt, 12, "adapter-a", "u7") == 12
        assert indexer.matched(prompt, "adapter-a") == 0
        client.free(seq)
