"""The SGLang harness against SGLang's own backends, before any kvcore code is under it.

Process 1 backs pages up through SGLang's controller, process 2 (a fresh host pool)
prefetches them back through the controller's threads; the pages must come back byte for
byte, the hit count must be the written prefix, and a prompt never written must hit 0.
Two backends: SGLang's built-in ``file`` (its generic page path: batch_exists, batch_get,
batch_set), and the same files behind the zero-copy calls the kvcore backend will get
(``dynamic`` + ``interface_v1``: batch_get_v1 / batch_set_v1 with host indices).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sglang_helpers import run_harness

PAGE = 16
WRITTEN = list(range(1000, 1000 + 4 * PAGE + 5))  # 4 whole pages; the 5-token tail is cut
SHARED_HEAD = WRITTEN[: 2 * PAGE] + list(range(7000, 7000 + 2 * PAGE))  # first 2 pages hit
NEVER = list(range(9000, 9000 + 3 * PAGE))


def spec(op: str, backend: str, extra: dict[str, Any], host_layout: str, **more: Any) -> dict:
    return {
        "op": op,
        "backend": backend,
        "extra_config": {"prefetch_threshold": PAGE, **extra},
        "layout": {
            "num_layers": 2,
            "num_kv_heads": 2,
            "head_dim": 16,
            "dtype": "bfloat16",
            "page_size": PAGE,
            "host_layout": host_layout,
        },
        "model_name": "kvcore/tiny",
        **more,
    }


def write_then_fetch(
    backend: str, extra: dict[str, Any], host_layout: str, store: Path, **more: Any
) -> tuple[dict, dict]:
    env = {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(store)}
    w = run_harness(spec("write", backend, extra, host_layout, prompts=[WRITTEN], **more), env=env)
    f = run_harness(
        spec("fetch", backend, extra, host_layout, prompts=[WRITTEN, SHARED_HEAD, NEVER], **more),
        env=env,
    )
    return w, f


def check_round_trip(w: dict, f: dict) -> None:
    (wrote,) = w["prompts"]
    full, head, never = f["prompts"]
    assert wrote["completed_tokens"] == 4 * PAGE
    assert full["hit_tokens"] == full["fetched_tokens"] == 4 * PAGE
    assert full["keys"] == wrote["keys"]
    assert full["sha256"] == wrote["sha256"] == full["expected_sha256"]
    assert head["hit_tokens"] == head["fetched_tokens"] == 2 * PAGE
    assert head["page_sha256"] == wrote["page_sha256"][:2]
    assert never["hit_tokens"] == never["fetched_tokens"] == 0


@pytest.mark.timeout(120)
def test_file_backend_round_trip(tmp_path: Path) -> None:
    w, f = write_then_fetch("file", {}, "layer_first", tmp_path / "store")
    check_round_trip(w, f)
    assert w["controller"] == f["controller"] == "HybridCacheController"
    assert f["backend_class"] == "sglang.srt.mem_cache.hicache_storage.HiCacheFile"
    assert (f["page_get"], w["page_set"]) == ("_generic_page_get", "_generic_page_set")
    assert f["storage_config"]["model_name"] == "kvcore/tiny"
    # The file backend names a page <key>_<model with "/" as "-">_<tp rank>_<tp size>.bin.
    names = sorted(p.name for p in (tmp_path / "store").glob("*.bin"))
    assert names == sorted(f"{k}_kvcore-tiny_0_1.bin" for k in w["prompts"][0]["keys"])


@pytest.mark.timeout(120)
def test_dynamic_zero_copy_round_trip(tmp_path: Path) -> None:
    extra = {
        "backend_name": "file-v1",
        "module_path": "sglang_harness",
        "class_name": "FileV1Storage",
        "interface_v1": 1,
        "hicache_storage_pass_prefix_keys": True,
    }
    w, f = write_then_fetch("dynamic", extra, "page_first", tmp_path / "store", chunk_pages=2)
    check_round_trip(w, f)
    assert f["backend_class"] == "sglang_harness.FileV1Storage"
    assert (f["page_get"], w["page_set"]) == ("_page_get_zero_copy", "_page_set_zero_copy")
    assert f["pass_prefix_keys"] is True
    # Written as two 2-page nodes: the second's prefix_keys are the first node's keys.
    assert [(c["op"], c["keys"], c["prefix_keys"]) for c in w["v1_calls"]] == [
        ("set", 2, 0),
        ("set", 2, 2),
    ]
    gets = [c for c in f["v1_calls"] if c["op"] == "get"]
    assert [(c["keys"], c["host_indices"]) for c in gets] == [(4, 4 * PAGE), (2, 2 * PAGE)]
    for call in w["v1_calls"] + gets:
        assert call["dtype"] == "torch.int64" and call["device"] == "cpu"
        assert call["page_starts_aligned"] and call["pages_contiguous"]
