"""Seeded workloads as block traces (kvcore/bench/block_trace.py), for ``kvcore bench
trace --workload NAME``: traffic that is not the shared trace, to choose an eviction
policy on more than one kind of reuse.

Every generator returns :class:`~kvcore.bench.block_trace.BlockRequest` s sorted by
arrival.
``hash_ids`` names the prompt as a chain of 512-token blocks (the last one may be
partial); equal ids at equal positions mean equal prefixes and ids are unique
per prefix, exactly as chained hashes are. Prompts are built from *segments*
(a system prompt, a document, a user turn, ...), each a run of fresh tokens; a
block's id interns (parent id, the segment pieces it holds), so two prompts share
exactly the leading full blocks whose contents agree. Same seed, same output.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Callable

from kvcore.bench.block_trace import BLOCK_TOKENS as BLOCK
from kvcore.bench.block_trace import BlockRequest

Request = BlockRequest
Segment = tuple[int, int]  # (segment uid, length in tokens)


class _Blocks:
    """Interns block contents into chained block ids and fresh segment uids."""

    def __init__(self) -> None:
        self.ids: dict[tuple[int, tuple[tuple[int, int, int], ...]], int] = {}
        self.next_seg = 0

    def segment(self, length: int) -> Segment:
        self.next_seg += 1
        return (self.next_seg, max(1, int(length)))

    def hash_ids(self, segments: list[Segment]) -> list[int]:
        out: list[int] = []
        parent, filled = -1, 0
        pieces: list[tuple[int, int, int]] = []
        for uid, length in segments:
            off = 0
            while off < length:
                take = min(length - off, BLOCK - filled)
                pieces.append((uid, off, off + take))
                off += take
                filled += take
                if filled == BLOCK:
                    parent = self.ids.setdefault((parent, tuple(pieces)), len(self.ids))
                    out.append(parent)
                    pieces, filled = [], 0
        if pieces:
            out.append(self.ids.setdefault((parent, tuple(pieces)), len(self.ids)))
        return out


def _lognormal(rng: random.Random, median: float, sigma: float, lo: float, hi: float) -> int:
    return int(min(hi, max(lo, rng.lognormvariate(math.log(median), sigma))))


def _request(blocks: _Blocks, t_ms: float, segments: list[Segment], output: int) -> Request:
    length = sum(n for _, n in segments)
    return BlockRequest(float(int(t_ms)), length, output, tuple(blocks.hash_ids(segments)))


def _zipf_sampler(rng: random.Random, n: int, s: float) -> Callable[[], int]:
    weights = [1.0 / (k + 1) ** s for k in range(n)]
    order = list(range(n))
    rng.shuffle(order)  # popularity rank is unrelated to creation order
    cum: list[float] = []
    acc = 0.0
    for w in weights:
        acc += w
        cum.append(acc)
    return lambda: order[min(n - 1, bisect.bisect_left(cum, rng.random() * acc))]


def chat(
    seed: int = 1,
    conversations: int = 900,
    rate_per_s: float = 0.5,
    think_s: float = 60.0,
    max_context: int = 48_000,
    blocks: _Blocks | None = None,
    t0_ms: float = 0.0,
) -> list[Request]:
    """Multi-turn chat: conversations arrive as a Poisson process (``rate_per_s``
    conversations per second) and interleave. Each starts with one of 4 shared
    system prompts (Zipf-popular, 600-3,000 tokens); ~30% open with a pasted
    document (lognormal, median 4,000 tokens). Turn k's prompt = turn k-1's prompt
    + its answer (median 400 tokens) + a new user message (median 150 tokens), so
    it reuses every earlier full block. Turns per conversation are long-tailed
    (Pareto, median ~3, up to 40); the gap between turns is exponential with mean
    ``think_s`` seconds. A conversation ends early once it passes ``max_context``
    tokens."""
    rng = random.Random(seed)
    b = blocks or _Blocks()
    systems = [b.segment(rng.randint(600, 3000)) for _ in range(4)]
    pick_system = _zipf_sampler(rng, len(systems), 1.0)
    events: list[tuple[float, int, list[Segment], int]] = []
    t = t0_ms
    for c in range(conversations):
        t += rng.expovariate(rate_per_s) * 1000
        segs = [systems[pick_system()]]
        if rng.random() < 0.3:
            segs.append(b.segment(_lognormal(rng, 4000, 0.8, 500, 30_000)))
        turns = min(40, int(rng.paretovariate(1.1)) + rng.randint(0, 2))
        tt = t
        for _k in range(turns):
            segs = [*segs, b.segment(_lognormal(rng, 150, 1.0, 10, 4000))]
            if sum(n for _, n in segs) > max_context:
                break
            answer = _lognormal(rng, 400, 0.8, 20, 4000)
            events.append((tt, c, segs, answer))
            segs = [*segs, b.segment(answer)]
            tt += rng.expovariate(1 / think_s) * 1000
    events.sort(key=lambda e: (e[0], e[1]))
    return [_request(b, ts, segs, out) for ts, _, segs, out in events]


def rag(
    seed: int = 2,
    requests: int = 4000,
    documents: int = 3000,
    zipf_s: float = 0.9,
    rate_per_s: float = 2.0,
    blocks: _Blocks | None = None,
    t0_ms: float = 0.0,
) -> list[Request]:
    """Documents / RAG: a corpus of ``documents`` documents (lognormal length,
    median 6,000 tokens, 1,000-40,000), requested with Zipf(``zipf_s``)
    popularity. Each request = one of 2 shared system prompts (800 / 1,500
    tokens) + the document + a unique question (median 120 tokens). Poisson
    arrivals, ``rate_per_s`` requests per second."""
    rng = random.Random(seed)
    b = blocks or _Blocks()
    systems = [b.segment(800), b.segment(1500)]
    docs = [b.segment(_lognormal(rng, 6000, 0.7, 1000, 40_000)) for _ in range(documents)]
    pick = _zipf_sampler(rng, documents, zipf_s)
    out: list[Request] = []
    t = t0_ms
    for _ in range(requests):
        t += rng.expovariate(rate_per_s) * 1000
        d = pick()
        segs = [systems[d % 2], docs[d], b.segment(_lognormal(rng, 120, 0.8, 10, 2000))]
        out.append(_request(b, t, segs, _lognormal(rng, 200, 0.8, 10, 2000)))
    return out


def agentic(
    seed: int = 4,
    sessions: int = 500,
    rate_per_s: float = 0.4,
    max_context: int = 64_000,
    blocks: _Blocks | None = None,
) -> list[Request]:
    """Agentic / tool use: sessions arrive as a Poisson process (``rate_per_s``
    per second). Each uses one of 3 agent frameworks whose shared tool/system
    prefix is 4,000-14,000 tokens, then a task (median 300 tokens). Each step's
    prompt = the previous prompt + the model's action (median 120 tokens) + a
    tool result (lognormal, median 800 tokens, up to 8,000); steps per session
    are long-tailed (Pareto, median ~8, up to 80), 1-15 s apart; a session stops
    at ``max_context`` tokens."""
    rng = random.Random(seed)
    b = blocks or _Blocks()
    prefixes = [b.segment(rng.randint(4000, 14_000)) for _ in range(3)]
    events: list[tuple[float, int, list[Segment], int]] = []
    t = 0.0
    for s in range(sessions):
        t += rng.expovariate(rate_per_s) * 1000
        segs = [
            prefixes[rng.choices(range(3), weights=(5, 3, 2))[0]],
            b.segment(_lognormal(rng, 300, 1.0, 20, 5000)),
        ]
        steps = min(80, int(4 * rng.paretovariate(1.2)))
        tt = t
        for _ in range(steps):
            action = _lognormal(rng, 120, 0.8, 10, 1500)
            events.append((tt, s, segs, action))
            segs = [*segs, b.segment(action), b.segment(_lognormal(rng, 800, 1.1, 20, 8000))]
            if sum(n for _, n in segs) > max_context:
                break
            tt += rng.uniform(1, 15) * 1000
    events.sort(key=lambda e: (e[0], e[1]))
    return [_request(b, ts, segs, out) for ts, _, segs, out in events]


def mixed(seed: int = 3, scan_share: float = 0.2) -> list[Request]:
    """Mix of chat, RAG (Zipf 0.9) and one-off unique long prompts (scans,
    lognormal median 12,000 tokens, 2,000-60,000), merged by timestamp over the
    same period; scans are ``scan_share`` of all requests."""
    rng = random.Random(seed)
    b = _Blocks()
    reqs = chat(seed * 10 + 1, conversations=500, blocks=b) + rag(
        seed * 10 + 2, requests=2000, documents=2000, rate_per_s=2000 / 1000, blocks=b
    )
    span = max(r.timestamp_ms for r in reqs)
    n_scan = int(len(reqs) * scan_share / (1 - scan_share))
    for _ in range(n_scan):
        seg = b.segment(_lognormal(rng, 12_000, 0.7, 2000, 60_000))
        reqs.append(_request(b, rng.uniform(0, span), [seg], _lognormal(rng, 200, 0.8, 10, 2000)))
    reqs.sort(key=lambda r: r.timestamp_ms)
    return reqs


WORKLOADS: dict[str, Callable[[int], list[Request]]] = {
    "chat": lambda seed: chat(seed),
    "rag-z0.6": lambda seed: rag(seed, zipf_s=0.6),
    "rag-z0.9": lambda seed: rag(seed, zipf_s=0.9),
    "rag-z1.2": lambda seed: rag(seed, zipf_s=1.2),
    "mixed": lambda seed: mixed(seed),
    "agentic": lambda seed: agentic(seed),
}
"""name -> the workload of a seed (the study in docs/concepts.md used seeds 1, 2, 2, 2, 3, 4)."""
