"""Request traces as chains of blocks, and the two references a policy is judged against.

A block trace is what Mooncake's trace release publishes (one JSON object per line):
``timestamp`` (ms), ``input_length`` and ``output_length`` (tokens) and ``hash_ids``,
the request's input as a chain of ``block_tokens``-token blocks (512 there), where
equal ids at equal positions mean equal prefixes. A replay gives each id one block of
tokens of its own, so two requests share exactly the leading blocks whose ids they
share; the last block of a request may be partial, and a partial block is never
cached (only full pages are committed).

The references replay the same block sequence as :func:`replay` drives a Manager
(one request at a time: allocate, commit every full page, free), block for block:

* :func:`lru_hits` evicts the least recently released unreferenced block, as the
  Manager's ``eviction="lru"`` does; it equals that Manager to the token
  (tests/test_bench_trace.py);
* :func:`belady_hits` evicts the block whose next use is farthest away (never again
  counts as infinitely far; ties: the deeper block first, so tails go before heads).
  For block hits this is the offline optimum, an upper bound no online policy reaches.

What one request does, with capacity in pages (= blocks)::

    ids        b0 b1 b2 | b3 b4 b5 | b6'          b6': partial, never cached
    hit        the leading ids cached, at most (n - 1) // block_tokens: never the last token
    take       ceil(n / block_tokens) - hit pages: free ones first, then evictions
    commit     every full block not cached yet (one cached after the first miss stays as it is)
    release    tail first: the request's cached blocks become evictable, head most recent
"""

from __future__ import annotations

import gzip
import heapq
import json
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvcore.errors import BadRequest
from kvcore.results import PageManager

BLOCK_TOKENS = 512  # tokens per block of Mooncake's trace release
TRACE_NAME = "mooncake_synthetic_trace.jsonl.gz"


@dataclass(frozen=True, slots=True)
class BlockRequest:
    """One request: arrival time (ms), lengths (tokens) and its input's block ids."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def full_blocks(self, block_tokens: int) -> int:
        """Blocks of the input that are full (the ones a cache may hold)."""
        return self.input_length // block_tokens

    def hit_limit(self, block_tokens: int) -> int:
        """Blocks a hit may cover: every full one, less the last token (an engine computes it)."""
        return max(self.input_length - 1, 0) // block_tokens


def default_trace() -> Path | None:
    """The shared synthetic trace, if this checkout sits beside it (``../shared/traces``
    of the repository or of the working directory); None otherwise."""
    here = Path(__file__).resolve().parents[2]
    for root in (here, Path.cwd()):
        path = root.parent / "shared" / "traces" / TRACE_NAME
        if path.is_file():
            return path
    return None


def load(
    path: str | Path, limit: int | None = None, block_tokens: int = BLOCK_TOKENS
) -> list[BlockRequest]:
    """The first ``limit`` requests (all if None) of the trace at ``path`` (gzip or plain
    JSON lines). BadRequest, naming the line, for a line that is not a request of this
    format: lengths >= 0, ``hash_ids`` non-negative ints, one per ``block_tokens`` tokens
    of input (the last block may be partial)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    requests: list[BlockRequest] = []
    try:
        with opener(path, "rt", encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if limit is not None and len(requests) >= limit:
                    break
                if line.strip():
                    requests.append(_parse(line, block_tokens, f"{path}:{number}"))
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise BadRequest(f"cannot read trace {path}: {exc}") from None
    return requests


def _parse(line: str, block_tokens: int, where: str) -> BlockRequest:
    try:
        raw = json.loads(line)
        ids = tuple(raw["hash_ids"])
        request = BlockRequest(
            float(raw.get("timestamp", 0)), raw["input_length"], raw.get("output_length", 0), ids
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise BadRequest(f"{where}: not a trace request: {exc!r}") from None
    counts = (request.input_length, request.output_length, *ids)
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts):
        raise BadRequest(f"{where}: lengths and hash_ids must be ints >= 0")
    if len(ids) != -(-request.input_length // block_tokens):
        raise BadRequest(
            f"{where}: {len(ids)} hash_ids for {request.input_length} tokens "
            f"of {block_tokens}-token blocks"
        )
    return request


def distinct_blocks(requests: Iterable[BlockRequest]) -> int:
    """Distinct block ids of the trace (partial blocks included): what capacities are
    fractions of."""
    return len({block for request in requests for block in request.hash_ids})


def input_tokens(requests: Iterable[BlockRequest]) -> int:
    return sum(request.input_length for request in requests)


def tokens_of(request: BlockRequest, block_tokens: int) -> list[int]:
    """The request's input tokens: block ``i``'s tokens are all ``hash_ids[i]`` (mod
    2**32), so equal ids at equal positions are equal pages (ids are unique per prefix,
    which makes every chain key unique to its prefix)."""
    tokens: list[int] = []
    for block in request.hash_ids:
        tokens += [block & 0xFFFFFFFF] * block_tokens
    del tokens[request.input_length :]
    return tokens


def replay(
    manager: PageManager,
    requests: Sequence[BlockRequest],
    block_tokens: int,
    progress: Callable[[int], None] = lambda done: None,
) -> int:
    """Serve each request as an engine with this cache would, one at a time: allocate its
    input, commit every full page, free. Returns the input tokens served from the cache;
    ``progress(1)`` after each request."""
    hit = 0
    for seq, request in enumerate(requests):
        tokens = tokens_of(request, block_tokens)
        hit += manager.allocate(seq, tokens).num_cached_tokens
        manager.commit(seq, tokens)
        manager.free(seq)
        progress(1)
    return hit


def lru_hits(requests: Sequence[BlockRequest], capacity: int, block_tokens: int) -> int:
    """Input tokens hit by an LRU prefix cache of ``capacity`` pages (module docstring)."""
    cache: OrderedDict[int, None] = OrderedDict()  # evictable blocks, least recent first
    hit_tokens = 0
    for request in requests:
        ids = request.hash_ids
        hit = _leading_hits(ids, cache, request.hit_limit(block_tokens))
        for block in ids[:hit]:
            del cache[block]  # pinned
        need = len(ids) - hit
        while capacity - hit - len(cache) < need:
            cache.popitem(last=False)
        new = [b for b in ids[hit : request.full_blocks(block_tokens)] if b not in cache]
        held = set(new).union(ids[:hit])
        for block in reversed(ids):  # released tail first: the head ends most recent
            if block in held:
                cache[block] = None
        hit_tokens += hit * block_tokens
    return hit_tokens


def belady_hits(requests: Sequence[BlockRequest], capacity: int, block_tokens: int) -> int:
    """Input tokens hit when every eviction takes the evictable block used again farthest
    in the future (module docstring). O(log pages) per eviction."""
    never = len(requests)
    next_use = _next_uses(requests, never)
    cached: dict[int, tuple[int, int]] = {}  # evictable block -> (next use, depth)
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, block); stale entries skipped
    hit_tokens = 0
    for r, request in enumerate(requests):
        ids = request.hash_ids
        hit = _leading_hits(ids, cached, request.hit_limit(block_tokens))
        for block in ids[:hit]:
            del cached[block]
        need = len(ids) - hit
        while capacity - hit - len(cached) < need:
            far, deep, block = heapq.heappop(heap)
            if cached.get(block) == (-far, -deep):
                del cached[block]
        new = {b for b in ids[hit : request.full_blocks(block_tokens)] if b not in cached}
        for depth, block in enumerate(ids):
            if depth < hit or block in new:
                entry = cached[block] = (next_use[r][depth], depth)
                heapq.heappush(heap, (-entry[0], -depth, block))
        hit_tokens += hit * block_tokens
    return hit_tokens


def _leading_hits(ids: Sequence[int], cached: Container[int], limit: int) -> int:
    """How many leading ``ids`` are in ``cached``, at most ``limit``."""
    hit = 0
    while hit < limit and ids[hit] in cached:
        hit += 1
    return hit


def _next_uses(requests: Sequence[BlockRequest], never: int) -> list[list[int]]:
    """``[r][i]``: the next request after ``r`` whose input holds ``requests[r]``'s block
    ``i``, or ``never``."""
    following: dict[int, int] = {}
    uses: list[list[int]] = [[]] * len(requests)
    for r in range(len(requests) - 1, -1, -1):
        ids = requests[r].hash_ids
        uses[r] = [following.get(block, never) for block in ids]
        for block in ids:
            following[block] = r
    return uses
