"""The workloads of ``kvcore bench vllm``: each a function of the four engines of one
configuration (:class:`Engines`), the sizes (:class:`Sizes`) and the repeat's index,
returning one :class:`Outcome`: the figure on the connector's engines, the same on
plain engines fed exactly the same requests, and whether their outputs are equal.

Equal means token for token, except where plain vLLM's own greedy choice was a tie:
vLLM's CPU build is not batch-invariant (a prompt's logits move by up to ~1e-5 nats
with what else its steps batch, the same on plain vLLM alone), and the connector moves
requests between steps (one whose daemon answer is late waits a pass). An output that
first differs at a token where plain's two best log-probabilities are within
:data:`TIE_NATS`, and takes the other of the two, is counted in ``ties``, not as a
mismatch. Wrong K/V (a page of another prompt, a stale or torn copy) moves logits by
far more than that.

Every prompt is random tokens from a seed of its own (:func:`tokens`): no two prompts
share a prefix unless a workload builds them to. The plain engine that mirrors B
(``pb``) is fed the measured requests B is fed, in the same order, right after B; the
one that mirrors A (``pa``) only chat's turns (A's other requests fill kvcore and are
not measured). No request of one repeat, workload or configuration is a prefix of
another's, so what an engine saw before a workload cannot hit in it."""

from __future__ import annotations

import hashlib
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvcore.bench.vllm_engine import MODEL, Engine, settle


@dataclass(frozen=True, slots=True)
class Sizes:
    """Workload sizes, all in tokens except the counts. ``new_tokens``: greedy tokens
    per request of shared_prefix, no_hit and rag; ``answer_tokens``: per chat turn
    (the answer becomes part of the next turn's prompt)."""

    requests: int  # shared_prefix and no_hit: requests per burst
    prefix_tokens: int
    suffix_tokens: int
    new_tokens: int
    docs: int
    doc_tokens: int
    question_tokens: int
    conversations: int
    turns: int
    first_tokens: int  # chat: the first turn's prompt (a system prompt and a first message)
    user_tokens: int  # chat: each later turn's new user message
    answer_tokens: int

    def longest_prompt(self) -> int:
        chat = self.first_tokens + (self.turns - 1) * (self.answer_tokens + self.user_tokens)
        return max(
            self.prefix_tokens + self.suffix_tokens, self.doc_tokens + self.question_tokens, chat
        )


@dataclass(frozen=True, slots=True)
class Engines:
    """One configuration's engines: ``a`` and ``b`` attached through the connector to
    the daemon at ``endpoint``, ``pa`` and ``pb`` without it (module docstring: what each
    is fed)."""

    a: Engine
    b: Engine
    pa: Engine
    pb: Engine
    endpoint: str

    def settle(self) -> None:
        """Wait until the daemon holds no sequence (:func:`~.vllm_engine.settle`); not
        part of any measured time."""
        settle(self.endpoint)


NO_HIT_BURSTS = 4  # bursts per round of no_hit
TIE_NATS = 1e-4  # two log-probabilities this close are a greedy tie (module docstring)
TOP = 2  # log-probabilities every compared call asks for: the two a tie is between


@dataclass(frozen=True, slots=True)
class Outcome:
    """One repeat of one workload. ``kvcore`` / ``plain``: the workload's figure (its
    :attr:`Workload.unit`) on the connector's engines and on the plain ones; ``match``:
    every output equal token for token. Over the measured requests: ``prompt_tokens``,
    ``hit_tokens`` (vLLM's num_cached_tokens summed: its own prefix cache's hits and the
    connector's), ``plain_hit_tokens`` (the same on the plain engines) and
    ``external_tokens`` (what the connector loaded from kvcore, its own count);
    ``ties``: outputs that differ from plain's from a greedy tie on (module docstring;
    ``match`` holds despite them)."""

    kvcore: float
    plain: float
    match: bool
    ties: int
    prompt_tokens: int
    hit_tokens: int
    plain_hit_tokens: int
    external_tokens: int


@dataclass(frozen=True, slots=True)
class Workload:
    """A workload and the record keys of its figures: ``ratio_key`` is the median of
    kvcore / plain; ``hit_key`` (if any) the median of hit_tokens / prompt_tokens."""

    name: str
    run: Callable[[Engines, Sizes, int], Outcome]
    unit: str  # "ttft_ms" (mean time to first token) or "throughput_tok_s" (output tokens/s)
    ratio_key: str
    hit_key: str | None = None


def tokens(length: int, *key: object) -> list[int]:
    """``length`` random tokens seeded by ``key`` (a stable hash: equal in every run)."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return MODEL.prompt(length, int.from_bytes(digest, "little") >> 1)


def shared_prefix(e: Engines, s: Sizes, r: int) -> Outcome:
    """A burst of ``requests`` prompts of one fresh prefix on A (kvcore then holds the
    prefix), then the same prefix with other suffixes as a burst on B and on pb: mean
    TTFT of the burst. With vLLM's prefix cache on, only the burst's first request of B
    loads from kvcore (the rest hit the blocks it filled), and pb computes it once."""
    prefix = tokens(s.prefix_tokens, "shared", r)
    e.a.generate(
        [prefix + tokens(s.suffix_tokens, "shared-a", r, i) for i in range(s.requests)],
        s.new_tokens,
    )
    e.settle()  # A's commits are in before B looks up
    hit = [prefix + tokens(s.suffix_tokens, "shared-b", r, i) for i in range(s.requests)]
    return _burst(e.b, e.pb, hit, s.new_tokens, ttft=True, plain_first=r % 2 == 0)


def no_hit(e: Engines, s: Sizes, r: int) -> Outcome:
    """:data:`NO_HIT_BURSTS` bursts of ``requests`` prompts that nothing holds, each on B
    and on pb (which goes first alternates): output tokens/s over the bursts (what the
    connector costs when nothing hits). One burst is well under a second here, so a
    round takes several, and alternates, to keep order and noise out of the ratio."""
    length = s.prefix_tokens + s.suffix_tokens
    outcomes = []
    for k in range(NO_HIT_BURSTS):
        cold = [tokens(length, "no-hit", r, k, i) for i in range(s.requests)]
        outcomes.append(_burst(e.b, e.pb, cold, s.new_tokens, ttft=False, plain_first=k % 2 == 1))
    return replace(
        outcomes[0],
        kvcore=statistics.fmean(o.kvcore for o in outcomes),
        plain=statistics.fmean(o.plain for o in outcomes),
        match=all(o.match for o in outcomes),
        ties=sum(o.ties for o in outcomes),
        prompt_tokens=sum(o.prompt_tokens for o in outcomes),
        hit_tokens=sum(o.hit_tokens for o in outcomes),
        plain_hit_tokens=sum(o.plain_hit_tokens for o in outcomes),
        external_tokens=sum(o.external_tokens for o in outcomes),
    )


def rag(e: Engines, s: Sizes, r: int) -> Outcome:
    """``docs`` fresh documents, each read once on A (document + a question; one burst,
    not measured); then on B one new question per document, one request at a time, each
    followed by the same request on pb: mean TTFT. One at a time, so a TTFT is that of
    one question (no queueing behind the others' prefills)."""
    docs = [tokens(s.doc_tokens, "doc", r, i) for i in range(s.docs)]
    e.a.generate(
        [d + tokens(s.question_tokens, "question-a", r, i) for i, d in enumerate(docs)],
        s.new_tokens,
    )
    e.settle()
    before = _external(e.b)
    kv: list[dict[str, Any]] = []
    plain: list[dict[str, Any]] = []
    for i, doc in enumerate(docs):  # which engine goes first alternates
        prompt = [doc + tokens(s.question_tokens, "question-b", r, i)]
        if i % 2:
            plain.append(e.pb.generate(prompt, s.new_tokens, logprobs=TOP))
        kv.append(e.b.generate(prompt, s.new_tokens, logprobs=TOP))
        if not i % 2:
            plain.append(e.pb.generate(prompt, s.new_tokens, logprobs=TOP))
    return _outcome(kv, plain, s.docs * (s.doc_tokens + s.question_tokens), _external(e.b) - before)


def chat(e: Engines, s: Sizes, r: int) -> Outcome:
    """``conversations`` conversations of ``turns`` turns, turn 1 on A, 2 on B, 3 on A, ...
    (pa and pb alternate alike). Turn k+1's prompt is turn k's prompt + turn k's answer
    (the connector's engines' tokens, so both sides run the same prompts) + a new user
    message. Each turn's requests go as one burst (the conversations are concurrent);
    figures are over turns >= 2: mean TTFT, and hit tokens / prompt tokens, which reach
    past the previous turn's prompt into its answer only if the connector commits pages
    of generated tokens (vLLM computes K/V for every answer token but the last: the
    last was sampled, never fed back)."""
    history = [tokens(s.first_tokens, "chat", r, c) for c in range(s.conversations)]
    kv: list[dict[str, Any]] = []
    plain: list[dict[str, Any]] = []
    match, ties, prompt_tokens, external = True, 0, 0, 0
    for turn in range(1, s.turns + 1):
        engine, mirror = (e.a, e.pa) if turn % 2 else (e.b, e.pb)
        before = _external(engine)
        answers = engine.generate(history, s.answer_tokens, logprobs=TOP)
        mirrored = mirror.generate(history, s.answer_tokens, logprobs=TOP)
        e.settle()  # this turn's commits are in before the other engine's turn looks up
        if turn == 1:  # hits nothing: not measured, but compared
            match, ties = _compare([answers], [mirrored])
        else:
            kv.append(answers)
            plain.append(mirrored)
            prompt_tokens += sum(len(h) for h in history)
            external += _external(engine) - before
        user = [tokens(s.user_tokens, "user", r, c, turn) for c in range(s.conversations)]
        history = [h + a + u for h, a, u in zip(history, answers["tokens"], user, strict=True)]
    outcome = _outcome(kv, plain, prompt_tokens, external)
    return replace(outcome, match=outcome.match and match, ties=outcome.ties + ties)


WORKLOADS = (
    Workload("shared_prefix", shared_prefix, "ttft_ms", "ttft_hit_ratio"),
    Workload("no_hit", no_hit, "throughput_tok_s", "throughput_no_hit_ratio"),
    Workload("rag", rag, "ttft_ms", "rag_ttft_ratio", "rag_hit_fraction"),
    Workload("chat", chat, "ttft_ms", "chat_ttft_ratio", "chat_hit_fraction"),
)


def warm_up(engines: Sequence[Engine], s: Sizes) -> None:
    """First calls pay for vLLM's warm-up: a burst on each engine, not measured."""
    burst = [tokens(s.longest_prompt(), "warm", i) for i in range(min(4, s.requests))]
    for engine in engines:
        engine.generate(burst, 2, logprobs=TOP)  # as measured calls ask


def _burst(
    kvcore: Engine,
    plain: Engine,
    prompts: list[list[int]],
    new: int,
    *,
    ttft: bool,
    plain_first: bool,
) -> Outcome:
    """``prompts`` as one burst on ``kvcore`` and on ``plain`` (``plain_first``: in that
    order): mean TTFT (seconds) if ``ttft``, else output tokens/s. The order alternates
    over a run: an engine that starts right after another runs a little slower or
    faster than after a pause (its predecessor's threads still spin, caches are cold),
    and always the same order would put that into the ratio."""
    pl = plain.generate(prompts, new, logprobs=TOP) if plain_first else None
    before = _external(kvcore)
    kv = kvcore.generate(prompts, new, logprobs=TOP)
    external = _external(kvcore) - before
    pl = pl or plain.generate(prompts, new, logprobs=TOP)
    outcome = _outcome([kv], [pl], sum(map(len, prompts)), external)
    return outcome if ttft else replace(outcome, kvcore=_throughput(kv), plain=_throughput(pl))


def _outcome(
    kv: list[dict[str, Any]], plain: list[dict[str, Any]], prompt_tokens: int, external: int
) -> Outcome:
    """Mean TTFT (seconds) over every measured request of generate results ``kv`` and
    their counterparts ``plain``."""
    match, ties = _compare(kv, plain)
    return Outcome(
        kvcore=_mean_ttft(kv),
        plain=_mean_ttft(plain),
        match=match,
        ties=ties,
        prompt_tokens=prompt_tokens,
        hit_tokens=sum(sum(res["cached"]) for res in kv),
        plain_hit_tokens=sum(sum(res["cached"]) for res in plain),
        external_tokens=external,
    )


def _compare(kv: list[dict[str, Any]], plain: list[dict[str, Any]]) -> tuple[bool, int]:
    """Whether every output of generate results ``kv`` equals its counterpart's in
    ``plain`` but for greedy ties, and how many part at one (module docstring)."""
    match, ties = True, 0
    for k, p in zip(kv, plain, strict=True):
        for ours, theirs, top in zip(k["tokens"], p["tokens"], p["logprobs"], strict=True):
            if ours == theirs:
                continue
            pairs = enumerate(zip(ours, theirs, strict=False))
            at = next((i for i, (a, b) in pairs if a != b), None)  # None: lengths differ
            best = [] if at is None else top[at][:TOP]
            tie = len(best) == TOP and best[0][1] - best[1][1] <= TIE_NATS
            if tie and ours[at] in (best[0][0], best[1][0]):
                ties += 1
            else:
                match = False
    return match, ties


def _external(engine: Engine) -> int:
    """Prompt tokens the connector of ``engine`` has loaded from kvcore since start-up."""
    return int(engine.stats()["external_hit_tokens"])


def _mean_ttft(results: list[dict[str, Any]]) -> float:
    return statistics.fmean(t for res in results for t in res["ttft"] if t is not None)


def _throughput(result: dict[str, Any]) -> float:
    """Output tokens per second of one generate call (its wall time)."""
    return sum(len(t) for t in result["tokens"] if t is not None) / float(result["wall"])
