"""The benchmark trace: seeded, deterministic chat-like requests.

A trace is a list of requests, each with an arrival step, a prompt and the
tokens it will generate. Lengths are long-tailed like chat traffic: log-normal,
clipped. The defaults are calibrated to the ShareGPT means the vLLM paper
reports (161 prompt tokens, 338 output tokens per request), with sigma 1.0
(prompt) and 0.8 (output); outputs are clipped to the serving limit of
``max_new_tokens`` (2048). Arrivals are a Poisson process in steps.

The *shared-prefix variant* (``shared_fraction`` > 0) prepends, to that fraction
of requests, one of ``num_prefixes`` system/RAG prefixes of 512-2048 tokens
(lengths drawn once per trace; each request picks one uniformly)::

    prompt = [ shared prefix (512..2048 tokens) ][ own part (log-normal) ]
    prompt = [ own part (log-normal) ]                       (the other requests)

Determinism: only :meth:`random.Random.random` is used (its stream is fixed
across Python versions for an int seed); log-normal and exponential variates
are derived from it here, so a seed gives the same trace everywhere.

:func:`optimal_hit_tokens` computes, from the tokens alone, the page-granular
optimum of prefix-cache hits for a given admission schedule (see its docstring).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvcore.errors import BadRequest


@dataclass(frozen=True, slots=True)
class TraceConfig:
    """Parameters of a trace; lengths in tokens, rates in requests per step."""

    num_requests: int = 500
    seed: int = 0
    arrival_rate: float = 1.0  # mean requests arriving per step (Poisson)
    prompt_median: int = 98  # log-normal median of the prompt's own part
    prompt_sigma: float = 1.0
    prompt_max: int = 4096  # clip of the own part
    output_median: int = 245
    output_sigma: float = 0.8
    max_new_tokens: int = 2048  # serving limit; outputs are clipped to it
    shared_fraction: float = 0.0  # share of requests that start with a shared prefix
    num_prefixes: int = 4
    prefix_min: int = 512
    prefix_max: int = 2048
    vocab_size: int = 128256

    def __post_init__(self) -> None:
        positive = (
            "num_requests",
            "prompt_median",
            "prompt_max",
            "output_median",
            "max_new_tokens",
            "num_prefixes",
            "prefix_min",
            "vocab_size",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise BadRequest(f"TraceConfig.{name} must be a positive int, got {value!r}")
        if not self.arrival_rate > 0:
            raise BadRequest(f"arrival_rate must be > 0, got {self.arrival_rate}")
        if self.prompt_sigma < 0 or self.output_sigma < 0:
            raise BadRequest("sigmas must be >= 0")
        if not 0.0 <= self.shared_fraction <= 1.0:
            raise BadRequest(f"shared_fraction must be in [0, 1], got {self.shared_fraction}")
        if self.prefix_max < self.prefix_min:
            raise BadRequest("prefix_max must be >= prefix_min")


@dataclass(frozen=True, slots=True)
class Request:
    """One request. ``prompt`` and ``output`` are token ids; ``output`` is exactly
    what the simulated engine generates (``len(output)`` >= 1 steps of work)."""

    rid: int  # 0..num_requests-1, in arrival order
    arrival_step: int
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    prefix_id: int | None  # which shared prefix the prompt starts with, if any


@dataclass(frozen=True, slots=True)
class Trace:
    config: TraceConfig
    prefixes: tuple[tuple[int, ...], ...]
    requests: tuple[Request, ...] = field(repr=False)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(len(r.output) for r in self.requests)


def _normal(rng: random.Random) -> float:
    """A standard normal variate (Box-Muller over rng.random())."""
    u1 = 1.0 - rng.random()  # in (0, 1]
    u2 = rng.random()
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)


def _lognormal(rng: random.Random, median: int, sigma: float, lo: int, hi: int) -> int:
    value = round(median * math.exp(sigma * _normal(rng)))
    return min(max(value, lo), hi)


def _tokens(rng: random.Random, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(int(rng.random() * vocab) for _ in range(n))


def make_trace(config: TraceConfig) -> Trace:
    """The trace of ``config``; equal configs give equal traces."""
    rng = random.Random(config.seed)
    prefixes = (
        tuple(
            _tokens(
                rng,
                config.prefix_min + int(rng.random() * (config.prefix_max - config.prefix_min + 1)),
                config.vocab_size,
            )
            for _ in range(config.num_prefixes)
        )
        if config.shared_fraction > 0
        else ()
    )
    requests: list[Request] = []
    clock = 0.0
    for rid in range(config.num_requests):
        if rid:
            clock += -math.log(1.0 - rng.random()) / config.arrival_rate
        prefix_id: int | None = None
        if prefixes and rng.random() < config.shared_fraction:
            prefix_id = int(rng.random() * len(prefixes))
        own = _lognormal(rng, config.prompt_median, config.prompt_sigma, 1, config.prompt_max)
        out = _lognormal(rng, config.output_median, config.output_sigma, 1, config.max_new_tokens)
        head = prefixes[prefix_id] if prefix_id is not None else ()
        prompt = head + _tokens(rng, own, config.vocab_size)
        requests.append(
            Request(rid, int(clock), prompt, _tokens(rng, out, config.vocab_size), prefix_id)
        )
    return Trace(config, prefixes, tuple(requests))


def optimal_hit_tokens(
    requests: Sequence[Request], admitted_at: Mapping[int, int], page_size: int
) -> dict[int, int]:
    """Per request id, the prompt tokens a perfect page-granular prefix cache serves.

    The optimum of a schedule: request ``r`` first prefilled at step
    ``admitted_at[r.rid]`` can reuse a whole page ``i`` of its prompt only if

    * every page ``0..i`` of its prompt equals, token for token, the same pages
      of the prompt of a request prefilled at a strictly earlier step (prompt
      pages are committed after the prefill that wrote them, so requests
      prefilled in the same step cannot share: their K/V are being computed
      concurrently), and the earlier prompt holds page ``i`` whole;
    * the page does not hold the last prompt token: at most
      ``(len(prompt) - 1) // page_size`` pages, because the engine must run
      that token to get the logits of the first output token.

    The cache is unbounded (nothing is ever evicted), so this is an upper bound
    for any finite pool and exact for one large enough never to evict. Pages
    filled during decode are not counted: in these traces no prompt continues an
    earlier request's output. This uses a trie of token tuples, not
    kvcore's hashing, so it is an independent check of the Manager.
    """
    if page_size < 1:
        raise BadRequest(f"page_size must be >= 1, got {page_size}")
    children: dict[tuple[int, tuple[int, ...]], int] = {}  # (node, page tokens) -> node
    order = sorted(requests, key=lambda r: (admitted_at[r.rid], r.rid))
    hits: dict[int, int] = {}
    start = 0
    while start < len(order):
        step = admitted_at[order[start].rid]
        end = start
        while end < len(order) and admitted_at[order[end].rid] == step:
            end += 1
        group = order[start:end]
        for r in group:  # match against pages committed in earlier steps only
            node, matched = 0, 0
            for i in range((len(r.prompt) - 1) // page_size):
                child = children.get((node, r.prompt[i * page_size : (i + 1) * page_size]))
                if child is None:
                    break
                node, matched = child, matched + 1
            hits[r.rid] = matched * page_size
        for r in group:  # then commit this step's full prompt pages
            node = 0
            for i in range(len(r.prompt) // page_size):
                page = r.prompt[i * page_size : (i + 1) * page_size]
                node = children.setdefault((node, page), len(children) + 1)
        start = end
    return hits
