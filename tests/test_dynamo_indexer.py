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

from kvcore_ipc.messages import PageStoredEvent
from kvcore_ipc.vllm_events import VllmEventPublisher
from vllm_events_helpers import batch, chain, free_port, removed

from kvcore.prefix import KeySpace, encode_tokens, page_key, root_key

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

    def matched(
        self, tokens: list[int], lora_name: str | None = None, cache_salt: str | None = None
    ) -> int:
        """The longest prefix (tokens) the indexer knows of ``tokens``, over workers, for
        the adapter ``lora_name`` and the cache salt ``cache_salt`` (Dynamo's /query)."""
        body: dict[str, Any] = {"token_ids": tokens, "model_name": "default"}
        if lora_name is not None:
            body["lora_name"] = lora_name
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        reply = self.http("/query", body) or {}
        return max((w["longest_matched"] for w in reply.get("instances", {}).values()), default=0)

    def wait_for(
        self,
        tokens: list[int],
        want: int,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> int:
        deadline = time.monotonic() + 10
        while (got := self.matched(tokens, lora_name, cache_salt)) != want:
            if time.monotonic() > deadline:
                break
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


def spaced_chain(
    tokens: list[int], lora: str = "", salt: str = "", first_page: int = 0
) -> list[PageStoredEvent]:
    """Stored events of ``tokens``' full pages in the default namespace's key space with
    adapter ``lora`` and cache salt ``salt``, keyed by kvcore (spec/hashing.md)."""
    parent = root_key(KeySpace("default", lora=lora, salt=salt))
    events = []
    for i in range(len(tokens) // PAGE):
        page = tokens[i * PAGE : (i + 1) * PAGE]
        key = page_key(parent, encode_tokens(page))
        events.append(
            PageStoredEvent(key, parent, first_page + i, page, "default", lora=lora, salt=salt)
        )
        parent = key
    return events


def test_salts_stay_apart_when_dynamo_can_read_them(
    published: tuple[VllmEventPublisher, Indexer],
) -> None:
    """Dynamo 1.6.1 takes a chain's cache salt from its first block's extra keys when
    it starts with ``dynamo-cache-salt:`` (what Dynamo's frontend hands vLLM as
    ``cache_salt``) and answers /query with ``cache_salt`` = the rest."""
    pub, indexer = published
    prompt = list(range(900, 913))
    pub.publish(batch(spaced_chain(prompt, salt="dynamo-cache-salt:u1")))
    assert indexer.wait_for(prompt, 12, cache_salt="u1") == 12
    assert indexer.matched(prompt, cache_salt="u2") == 0
    assert indexer.matched(prompt) == 0


def test_a_salted_chain_continued_in_a_later_event_keeps_its_salt(
    published: tuple[VllmEventPublisher, Indexer],
) -> None:
    pub, indexer = published
    prompt = list(range(1300, 1313))
    events = spaced_chain(prompt, salt="dynamo-cache-salt:u1")
    pub.publish(batch(events[:1]))
    assert indexer.wait_for(prompt, PAGE, cache_salt="u1") == PAGE
    pub.publish(batch(events[1:]))  # a later commit of the same sequence: no salt in it
    assert indexer.wait_for(prompt, 12, cache_salt="u1") == 12
    assert indexer.matched(prompt) == 0


def test_adapters_stay_apart_through_lora_name(
    published: tuple[VllmEventPublisher, Indexer],
) -> None:
    pub, indexer = published
    prompt = list(range(1100, 1113))
    pub.publish(batch(spaced_chain(prompt, lora="adapter-a", salt="dynamo-cache-salt:u1")))
    assert indexer.wait_for(prompt, 12, lora_name="adapter-a", cache_salt="u1") == 12
    assert indexer.matched(prompt, lora_name="adapter-b", cache_salt="u1") == 0
    assert indexer.matched(prompt, lora_name="adapter-a") == 0
    assert indexer.matched(prompt, cache_salt="u1") == 0


def test_a_bare_vllm_salt_is_one_dynamo_cannot_separate(
    published: tuple[VllmEventPublisher, Indexer],
) -> None:
    """What Dynamo 1.6.1 does with a salt vLLM publishes bare (a request's cache_salt
    that did not come through Dynamo's frontend): it cannot tell it from a LoRA name
    or a multimodal hash, so it indexes the chain as unsalted. kvcore keys it apart
    (a salted allocate does not hit it); only the router's view merges it."""
    pub, indexer = published
    prompt = list(range(1500, 1513))
    pub.publish(batch(spaced_chain(prompt, salt="u1")))
    assert indexer.wait_for(prompt, 12) == 12
    assert indexer.matched(prompt, cache_salt="u1") == 0


def test_all_blocks_cleared_empties_the_publishers_blocks(
    published: tuple[VllmEventPublisher, Indexer],
) -> None:
    pub, indexer = published
    prompt = list(range(500, 508))
    pub.publish(batch(chain(prompt, PAGE)))
    assert indexer.wait_for(prompt, 8) == 8
    pub.cleared()  # what a daemon's new epoch sends
    assert indexer.wait_for(prompt, 0) == 0
