"""A consumer nobody here wrote: NVIDIA Dynamo's standalone KV indexer
(``python -m dynamo.indexer``, ai-dynamo 1.6.1) reads kvcore's vLLM-format events
unchanged and answers prefix queries over HTTP."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

if importlib.util.find_spec("dynamo") is None or importlib.util.find_spec("dynamo.indexer") is None:
    pytest.skip(
        "Dynamo's indexer is not installed (pip install --no-deps ai-dynamo==1.6.1 "
        "ai-dynamo-runtime==1.6.1)",
        allow_module_level=True,
    )

from kvcore_ipc.vllm_events import VllmEventPublisher
from vllm_events_helpers import batch, chain, free_port, removed

PAGE = 4


class Indexer:
    """``python -m dynamo.indexer`` watching one worker's event endpoint."""

    def __init__(self, endpoint: str, block_size: int) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dynamo.indexer",
                "--port",
                str(self.port),
                "--threads",
                "1",
                "--block-size",
                str(block_size),
                "--workers",
                f"1={endpoint}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while not isinstance(self.http("/workers"), list) or not self.http("/workers"):
            assert time.monotonic() < deadline, "the indexer did not start"
            time.sleep(0.2)

    def http(self, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=data,
            headers={"content-type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=5) as reply:
                return json.loads(reply.read() or b"null")
        except (urllib.error.URLError, OSError):
            return None

    def matched(self, tokens: list[int], lora_name: str | None = None) -> int:
        """The longest prefix (tokens) the indexer knows of ``tokens``, over workers."""
        body: dict[str, Any] = {"token_ids": tokens, "model_name": "default"}
        if lora_name is not None:
            body["lora_name"] = lora_name
        reply = self.http("/query", body) or {}
        return max((w["longest_matched"] for w in reply.get("instances", {}).values()), default=0)

    def wait_for(self, tokens: list[int], want: int, lora_name: str | None = None) -> int:
        deadline = time.monotonic() + 10
        while (got := self.matched(tokens, lora_name)) != want and time.monotonic() < deadline:
            time.sleep(0.05)
        return got

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def published() -> Iterator[tuple[VllmEventPublisher, Indexer]]:
    pub = VllmEventPublisher(f"tcp://127.0.0.1:{free_port()}", page_size=PAGE, medium="CPU")
    indexer = Indexer(pub.endpoint, PAGE)
    try:
        probe = chain([1, 2, 3, 4], PAGE)  # wait out ZeroMQ's slow joiner
        deadline = time.monotonic() + 30
        while indexer.matched([1, 2, 3, 4, 5]) != PAGE:
            assert time.monotonic() < deadline, "the indexer never received an event"
            pub.publish(batch(probe))
            time.sleep(0.1)
        yield pub, indexer
    finally:
        indexer.close()
        pub.close()


def test_the_indexer_answers_the_committed_length_and_less_after_eviction(
    published: tuple[VllmEventPublisher, Indexer],
) -> None:
    pub, indexer = published
    prompt = list(range(100, 118))  # 4 full pages + 2 tokens
    stored = chain(prompt, PAGE)
    pub.publish(batch(stored))
    assert indexer.wait_for(prompt, 16) == 16
    assert indexer.matched([*prompt[:8], 9, 9, 9, 9]) == 8  # diverges in page 2
    pub.publish(batch([removed(stored[2])]))  # evicted: the chain breaks at page 2
    assert indexer.wait_for(prompt, 8) == 8


def test_namespaces_stay_apart_through_lora_name(
    published: tuple[VllmEventPublisher, Indexer],
) -> None:
    pub, indexer = published
    prompt = list(range(300, 312))
    pub.publish(batch(chain(prompt, PAGE, namespace="tenant-a")))
    assert indexer.wait_for(prompt, 12, lora_name="tenant-a") == 12
    assert indexer.matched(prompt) == 0  # the default namespace has none of it
    assert indexer.matched(prompt, lora_name="tenant-b") == 0


def test_all_blocks_cleared_empties_the_publishers_blocks(
    published: tuple[VllmEventPublisher, Indexer],
) -> None:
    pub, indexer = published
    prompt = list(range(500, 508))
    pub.publish(batch(chain(prompt, PAGE)))
    assert indexer.wait_for(prompt, 8) == 8
    pub.cleared()  # what a daemon's new epoch sends
    assert indexer.wait_for(prompt, 0) == 0
