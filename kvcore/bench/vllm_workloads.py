"""The workloads of ``kvcore bench vllm``: each a function of the four engines of one
configuration (:class:`Engines`), the sizes (:class:`Sizes`) and the round's index,
returning one :class:`Outcome`: the figure on the connector's engines, the same on
plain engines fed exactly the same requests, and how their outputs compare
(:class:`Comparison`).

Both sides ask vLLM for the :data:`TOP` log-probabilities of every output token, and
outputs are compared position by position (:func:`compare`):

* where both chose the same token, its log-probability on the connector's side must
  be within :data:`LOGPROB_NATS` of plain's (``max_logprob_diff`` is the largest
  difference seen); further apart is a mismatch (``logprob_mismatches``);
* where they first choose different tokens, the output is a tie if plain's own greedy
  choice was one: plain's two best log-probabilities within :data:`TIE_NATS`, and the
  connector's side took the other of the two (its log-probability again within
  LOGPROB_NATS of plain's for the same token). Anything else is a token mismatch
  (``tokens_match`` false). Past that position the two outputs continue different
  prompts, so nothing after it is compared.

Why ties: vLLM's CPU build is not batch-invariant (a prompt's log-probabilities move by
up to ~2e-5 nats with what else its steps batch, the same on plain vLLM alone), and
the connector moves requests between steps (one whose daemon answer is late waits a
pass), so a near-tie can go either way. That same noise is why LOGPROB_NATS is 1e-3,
50x above it: K/V loaded wrong (a page of another prompt, a stale or torn copy)
moves the log-probabilities of every later position by more. Ties are counted
(``ties``) and bounded (:func:`ties_allowed`).

Every prompt is random tokens from a seed of its own (:func:`tokens`): no two prompts
share a prefix unless a workload builds them to. The plain engine that mirrors B
(``pb``) is fed the measured requests B is fed, in the same order; the one that
mirrors A (``pa``) only chat's turns (A's other requests fill kvcore and are not
measured). Which of the two sides runs a measured unit first follows one rule,
:func:`kvcore_first`, and every unit runs through :func:`_side_by_side`, which lets
the daemon settle after the connector's side. No request of one round, workload or
configuration is a prefix of another's, so what an engine saw before a workload
cannot hit in it."""

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


SHARED_BURSTS = 2  # bursts per round of shared_prefix, each on a prefix of its own
NO_HIT_BURSTS = 4  # bursts per round of no_hit
TIE_NATS = 1e-4  # two log-probabilities this close are a greedy tie (module docstring)
LOGPROB_NATS = 1e-3  # a token's log-probability further from plain's is a mismatch
TOP = 2  # log-probabilities every compared call asks for: the two a tie is between
TOKENS_PER_TIE = 1000  # ties_allowed: one tie per this many compared tokens ...
TIES_FLOOR = 2  # ... and at least this many


@dataclass(frozen=True, slots=True)
class Mismatch:
    """Where one output parts from plain vLLM's other than at a tie: ``prompt``, the
    output's index among the compared outputs of its round in the order they ran
    (chat: turn by turn, turn 1 first); ``position``, the output token's index (from
    0); ``kvcore`` and ``plain``, the tokens there (None past an output's end).
    ``logprob_diff``: for a log-probability mismatch, the difference in nats (the
    tokens are then equal, or a tie); None for a token mismatch."""

    prompt: int
    position: int
    kvcore: int | None
    plain: int | None
    logprob_diff: float | None = None

    def describe(self) -> str:
        where = f"prompt {self.prompt} token {self.position}: {self.kvcore}, plain {self.plain}"
        if self.logprob_diff is None:
            return where
        return f"{where}, log-probabilities {self.logprob_diff:.3g} nats apart"


@dataclass(frozen=True, slots=True)
class Comparison:
    """The connector's outputs against plain vLLM's (module docstring: the rule).
    ``outputs``: outputs compared; ``tokens``: output positions compared (each output's
    up to and including the one where it parts from plain's); ``ties``; ``near_ties``:
    positions compared where plain's two best log-probabilities are within TIE_NATS
    (where a tie can happen); ``max_logprob_diff``: the largest difference, in nats,
    between the two sides' log-probabilities of the connector's token over the
    positions compared; ``mismatches``: every mismatch, in order (per output at most
    one of log-probability, then one of token)."""

    outputs: int = 0
    tokens: int = 0
    ties: int = 0
    near_ties: int = 0
    max_logprob_diff: float = 0.0
    mismatches: tuple[Mismatch, ...] = ()

    @property
    def tokens_match(self) -> bool:
        """Every output equals plain's token for token, but for ties."""
        return all(m.logprob_diff is not None for m in self.mismatches)

    @property
    def logprob_mismatches(self) -> int:
        return sum(m.logprob_diff is not None for m in self.mismatches)

    def then(self, other: Comparison) -> Comparison:
        """This comparison followed by ``other`` (whose prompts are numbered after ours)."""
        later = tuple(replace(m, prompt=m.prompt + self.outputs) for m in other.mismatches)
        return Comparison(
            outputs=self.outputs + other.outputs,
            tokens=self.tokens + other.tokens,
            ties=self.ties + other.ties,
            near_ties=self.near_ties + other.near_ties,
            max_logprob_diff=max(self.max_logprob_diff, other.max_logprob_diff),
            mismatches=self.mismatches + later,
        )


def ties_allowed(compared_tokens: int) -> int:
    """The most ties a sound run may show over ``compared_tokens`` output positions:
    one per :data:`TOKENS_PER_TIE`, at least :data:`TIES_FLOOR`.

    Why: an honest tie needs plain's two best log-probabilities closer than the batch
    noise (~2e-5 nats), which is rare: 3 ties in four 5-round configurations (~36,000
    positions, 2026-12-04), none in 11,520 positions (2026-12-05, where ``near_ties``,
    the positions within TIE_NATS, was 0 too): about one per 10,000. The bound is 10x
    that (a run of the defaults expects ~1 and may show 11), and the floor keeps a
    short run (``--quick``: ~200 positions, ~0.02 ties expected) from failing on one.
    It is a backstop: a connector whose log-probabilities drift by more than TIE_NATS
    also parts from plain's where plain's two best are further apart than that (a token
    mismatch), and one that drifts by more than LOGPROB_NATS fails that check."""
    return max(TIES_FLOOR, compared_tokens // TOKENS_PER_TIE)


@dataclass(frozen=True, slots=True)
class Outcome:
    """One round of one workload. ``kvcore`` / ``plain``: the workload's figure (its
    :attr:`Workload.unit`) on the connector's engines and on the plain ones;
    ``compared``: their outputs compared. Over the measured requests: ``prompt_tokens``,
    ``hit_tokens`` (vLLM's num_cached_tokens summed: its own prefix cache's hits and the
    connector's), ``plain_hit_tokens`` (the same on the plain engines) and
    ``external_tokens`` (what the connector loaded from kvcore, its own count)."""

    kvcore: float
    plain: float
    compared: Comparison
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


def kvcore_first(r: int, k: int) -> bool:
    """Whether the connector's side runs first in unit ``k`` (from 0: a burst, a RAG
    question, a chat turn) of round ``r`` (from 1): when r + k is odd. Units alternate
    within a round, and each round starts on the other side from the round before, so
    a workload with an even number of units a round runs each side first equally often
    in every round, and any other over each two rounds. An engine that starts right
    after another runs a little slower or faster than after a pause (its predecessor's
    threads still spin, caches are cold); always the same order would put that into
    the ratio."""
    return (r + k) % 2 == 1


def shared_prefix(e: Engines, s: Sizes, r: int) -> Outcome:
    """:data:`SHARED_BURSTS` times: a burst of ``requests`` prompts of one fresh prefix
    on A (kvcore then holds the prefix), then the same prefix with other suffixes as a
    burst on B and on pb: mean TTFT of the bursts. With vLLM's prefix cache on, only a
    burst's first request of B loads from kvcore (the rest hit the blocks it filled),
    and pb computes it once. Two bursts, so each side goes first once a round."""
    outcomes = []
    for k in range(SHARED_BURSTS):
        prefix = tokens(s.prefix_tokens, "shared", r, k)
        e.a.generate(
            [prefix + tokens(s.suffix_tokens, "shared-a", r, k, i) for i in range(s.requests)],
            s.new_tokens,
        )
        e.settle()  # A's commits are in before B looks up
        hit = [prefix + tokens(s.suffix_tokens, "shared-b", r, k, i) for i in range(s.requests)]
        outcomes.append(_burst(e, hit, s.new_tokens, r, k, ttft=True))
    return _mean(outcomes)


def no_hit(e: Engines, s: Sizes, r: int) -> Outcome:
    """:data:`NO_HIT_BURSTS` bursts of ``requests`` prompts that nothing holds, each on B
    and on pb: output tokens/s over the bursts (what the connector costs when nothing
    hits). One burst is well under a second here, so a round takes several to keep
    noise out of the ratio."""
    length = s.prefix_tokens + s.suffix_tokens
    outcomes = []
    for k in range(NO_HIT_BURSTS):
        cold = [tokens(length, "no-hit", r, k, i) for i in range(s.requests)]
        outcomes.append(_burst(e, cold, s.new_tokens, r, k, ttft=False))
    return _mean(outcomes)


def rag(e: Engines, s: Sizes, r: int) -> Outcome:
    """``docs`` fresh documents, each read once on A (document + a question; one burst,
    not measured); then on B and on pb one new question per document, one request at a
    time: mean TTFT. One at a time, so a TTFT is that of one question (no queueing
    behind the others' prefills)."""
    docs = [tokens(s.doc_tokens, "doc", r, i) for i in range(s.docs)]
    e.a.generate(
        [d + tokens(s.question_tokens, "question-a", r, i) for i, d in enumerate(docs)],
        s.new_tokens,
    )
    e.settle()
    kv: list[dict[str, Any]] = []
    plain: list[dict[str, Any]] = []
    external = 0
    for k, doc in enumerate(docs):
        prompt = [doc + tokens(s.question_tokens, "question-b", r, k)]
        ours, theirs, loaded = _side_by_side(e, e.b, e.pb, prompt, s.new_tokens, r, k)
        kv.append(ours)
        plain.append(theirs)
        external += loaded
    return _outcome(kv, plain, s.docs * (s.doc_tokens + s.question_tokens), external)


def chat(e: Engines, s: Sizes, r: int) -> Outcome:
    """``conversations`` conversations of ``turns`` turns, turn 1 on A, 2 on B, 3 on A, ...
    (pa and pb alternate alike). Turn k+1's prompt is turn k's prompt + turn k's answer
    (the connector's engines' tokens, so both sides run the same prompts) + a new user
    message. Each turn's requests go as one burst (the conversations are concurrent);
    figures are over turns >= 2: mean TTFT, and hit tokens / prompt tokens, which reach
    past the previous turn's prompt into its answer only if the connector commits pages
    of generated tokens (vLLM computes K/V for every answer token but the last: the
    last was sampled, never fed back). Turn 1 hits nothing: compared, not measured."""
    history = [tokens(s.first_tokens, "chat", r, c) for c in range(s.conversations)]
    kv: list[dict[str, Any]] = []
    plain: list[dict[str, Any]] = []
    first = Comparison()
    prompt_tokens, external = 0, 0
    for turn in range(1, s.turns + 1):
        engine, mirror = (e.a, e.pa) if turn % 2 else (e.b, e.pb)
        answers, mirrored, loaded = _side_by_side(
            e, engine, mirror, history, s.answer_tokens, r, turn - 1
        )
        if turn == 1:
            first = compare([answers], [mirrored])
        else:
            kv.append(answers)
            plain.append(mirrored)
            prompt_tokens += sum(len(h) for h in history)
            external += loaded
        user = [tokens(s.user_tokens, "user", r, c, turn) for c in range(s.conversations)]
        history = [h + a + u for h, a, u in zip(history, answers["tokens"], user, strict=True)]
    outcome = _outcome(kv, plain, prompt_tokens, external)
    return replace(outcome, compared=first.then(outcome.compared))


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


def _side_by_side(
    e: Engines, kvcore: Engine, plain: Engine, prompts: list[list[int]], new: int, r: int, k: int
) -> tuple[dict[str, Any], dict[str, Any], int]:
    """Unit ``k`` of round ``r``: ``prompts`` as one batch on ``kvcore`` and on ``plain``,
    in :func:`kvcore_first`'s order; the generate results of both and the prompt tokens
    the connector loaded from kvcore. The daemon settles right after the connector's
    side, before plain's side or the next unit: the connector sends its commits from
    its own thread, and they must neither take cores from plain's run nor race the
    next unit's lookups."""
    theirs = None if kvcore_first(r, k) else plain.generate(prompts, new, logprobs=TOP)
    before = _external(kvcore)
    ours = kvcore.generate(prompts, new, logprobs=TOP)
    loaded = _external(kvcore) - before
    e.settle()
    if theirs is None:
        theirs = plain.generate(prompts, new, logprobs=TOP)
    return ours, theirs, loaded


def _burst(
    e: Engines, prompts: list[list[int]], new: int, r: int, k: int, *, ttft: bool
) -> Outcome:
    """``prompts`` as one burst on B and on pb (unit ``k`` of round ``r``): mean TTFT
    (seconds) if ``ttft``, else output tokens/s."""
    kv, pl, external = _side_by_side(e, e.b, e.pb, prompts, new, r, k)
    outcome = _outcome([kv], [pl], sum(map(len, prompts)), external)
    return outcome if ttft else replace(outcome, kvcore=_throughput(kv), plain=_throughput(pl))


def _mean(outcomes: list[Outcome]) -> Outcome:
    """Bursts of one round as one outcome: the mean figure of each side, the rest summed."""
    compared = Comparison()
    for o in outcomes:
        compared = compared.then(o.compared)
    return Outcome(
        kvcore=statistics.fmean(o.kvcore for o in outcomes),
        plain=statistics.fmean(o.plain for o in outcomes),
        compared=compared,
        prompt_tokens=sum(o.prompt_tokens for o in outcomes),
        hit_tokens=sum(o.hit_tokens for o in outcomes),
        plain_hit_tokens=sum(o.plain_hit_tokens for o in outcomes),
        external_tokens=sum(o.external_tokens for o in outcomes),
    )


def _outcome(
    kv: list[dict[str, Any]], plain: list[dict[str, Any]], prompt_tokens: int, external: int
) -> Outcome:
    """Mean TTFT (seconds) over every measured request of generate results ``kv`` and
    their counterparts ``plain``."""
    return Outcome(
        kvcore=_mean_ttft(kv),
        plain=_mean_ttft(plain),
        compared=compare(kv, plain),
        prompt_tokens=prompt_tokens,
        hit_tokens=sum(sum(res["cached"]) for res in kv),
        plain_hit_tokens=sum(sum(res["cached"]) for res in plain),
        external_tokens=external,
    )


def compare(kv: list[dict[str, Any]], plain: list[dict[str, Any]]) -> Comparison:
    """Every output of generate results ``kv`` against its counterpart's in ``plain``
    (module docstring: the rule); both asked for :data:`TOP` log-probabilities."""
    result = Comparison()
    for k, p in zip(kv, plain, strict=True):
        for output in zip(k["tokens"], p["tokens"], k["logprobs"], p["logprobs"], strict=True):
            result = result.then(_compare_output(*output))
    return result


def _compare_output(
    ours: list[int] | None,
    theirs: list[int] | None,
    our_top: list[list[list[Any]]] | None,
    top: list[list[list[Any]]] | None,
) -> Comparison:
    """One output (numbered 0) against plain's: the tokens of each side and, per
    position, each side's ``[token, log-probability]`` pairs, best first."""
    ours, theirs, our_top, top = ours or [], theirs or [], our_top or [], top or []
    common = min(len(ours), len(theirs))
    at = next((i for i in range(common) if ours[i] != theirs[i]), common)  # where it parts
    parts = at < max(len(ours), len(theirs))  # else equal
    tie = at < common and _near_tie(top[at]) and ours[at] in (t for t, _ in top[at][:TOP])
    diffs = [_logprob_diff(our_top[i], top[i], ours[i]) for i in range(at + tie)]
    mismatches = []
    off = next((i for i, d in enumerate(diffs) if d > LOGPROB_NATS), None)
    if off is not None:
        mismatches.append(Mismatch(0, off, ours[off], theirs[off], diffs[off]))
    if parts and not tie:
        mismatches.append(Mismatch(0, at, _token(ours, at), _token(theirs, at)))
    return Comparison(
        outputs=1,
        tokens=at + parts,
        ties=int(tie),
        near_ties=sum(_near_tie(top[i]) for i in range(min(at + parts, common))),
        max_logprob_diff=max(diffs, default=0.0),
        mismatches=tuple(mismatches),
    )


def _near_tie(top: list[list[Any]]) -> bool:
    """Plain's two best log-probabilities at a position (``top``: best first) are a tie."""
    best = top[:TOP]
    return len(best) == TOP and best[0][1] - best[1][1] <= TIE_NATS


def _token(output: list[int], i: int) -> int | None:
    return output[i] if i < len(output) else None


def _logprob_diff(ours: list[list[Any]], theirs: list[list[Any]], token: int) -> float:
    """|the connector's log-probability of ``token`` - plain's| at one position, from
    each side's ``[token, log-probability]`` pairs (vLLM always includes the sampled
    token, and a tie's token is one of plain's best two)."""
    mine = next((lp for t, lp in ours if t == token), None)
    other = next((lp for t, lp in theirs if t == token), None)
    assert mine is not None and other is not None, f"token {token} not in {ours} or {theirs}"
    return abs(float(mine) - float(other))


def _external(engine: Engine) -> int:
    """Prompt tokens the connector of ``engine`` has loaded from kvcore since start-up."""
    return int(engine.stats()["external_hit_tokens"])


def _mean_ttft(results: list[dict[str, Any]]) -> float:
    return statistics.fmean(t for res in results for t in res["ttft"] if t is not None)


def _throughput(result: dict[str, Any]) -> float:
    """Output tokens per second of one generate call (its wall time)."""
    return sum(len(t) for t in result["tokens"] if t is not None) / float(result["wall"])
