"""Tensor parallelism end to end: two vLLM engines of tensor_parallel_size=2 share a
prefix through a pool of two shards (one per rank), and generate what a plain
tensor_parallel_size=1 engine does.

vLLM's CPU build runs TP=2 with the ``mp`` executor (two worker processes, gloo).
Engine A computes and saves the prompts (every rank its own heads into its own
shard; a page is committed once both ranks saved it); engine B, with an empty
prefix cache of its own, loads them on both ranks (external hits of the whole
prefix) and continues. Slow (three engines start, minutes on 2 cores)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_helpers import MODEL, PAGE_SIZE, Engine, vllm_available, write_model

pytestmark = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")

PROMPTS = [
    [(7 * i + 3) % MODEL.vocab_size for i in range(3 * PAGE_SIZE + 5)],  # 3 full pages + 5
    [(11 * i + 1) % MODEL.vocab_size for i in range(2 * PAGE_SIZE + 9)],  # 2 full pages + 9
]
SIZING: dict[str, Any] = {"kv_bytes": 32 << 20, "max_num_seqs": 4, "max_model_len": 512}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from kvcore.daemon_process import DaemonProcess

    tmp = tmp_path_factory.mktemp("tp")
    heads = MODEL.num_kv_heads // 2  # one rank's
    pool = MODEL.pool_flag(page_size=PAGE_SIZE, num_pages=256).replace(
        f"num_kv_heads={MODEL.num_kv_heads}", f"num_kv_heads={heads}"
    )
    with DaemonProcess("--endpoint", f"ipc://{tmp / 'd.sock'}", "--pool", pool + ",shards=2") as d:
        yield d.endpoint


def test_two_tp2_engines_share_a_prefix_through_a_sharded_pool(model: Path, daemon: str) -> None:
    connector = {"endpoint": daemon}
    with (
        Engine(model, None, **SIZING) as plain,
        Engine(model, connector, tensor_parallel_size=2, **SIZING) as a,
    ):
        expected = plain.generate(PROMPTS, max_tokens=6)
        first = a.generate(PROMPTS, max_tokens=6)
    with Engine(model, connector, tensor_parallel_size=2, **SIZING) as b:
        second = b.generate(PROMPTS, max_tokens=6)
        second["external_hit_tokens"] = b.stats()["external_hit_tokens"]
    assert first["tokens"] == expected["tokens"]
    assert second["tokens"] == expected["tokens"]  # both ranks loaded their own heads
    prefix = sum(len(p) // PAGE_SIZE * PAGE_SIZE for p in PROMPTS)
    assert second["external_hit_tokens"] >= prefix
    assert sum(second["cached"]) >= prefix


def test_a_pool_of_other_shards_than_ranks_is_a_layout_mismatch(daemon: str) -> None:
    from kvcore import Client
    from kvcore.errors import LayoutMismatch
    from kvcore.integrations.vllm.ranks import WorkerRank

    with pytest.raises(LayoutMismatch, match=r"2 shard.*expects 4.*shards=4"):
        Client.connect(daemon, map_memory=False, **WorkerRank(3, 4).connect_options())
    with (
        Client.connect(daemon, map_memory=False) as any_count,  # asks for no count
        pytest.raises(LayoutMismatch, match=r"2 shard.*tensor_parallel_size=1.*shards=1"),
    ):
        WorkerRank(0, 1).check(any_count, "default")
    with Client.connect(daemon, map_memory=False, **WorkerRank(1, 2).connect_options()) as rank1:
        WorkerRank(1, 2).check(rank1, "default")
    assert WorkerRank.current() == WorkerRank(0, 1)  # no vLLM process group here
