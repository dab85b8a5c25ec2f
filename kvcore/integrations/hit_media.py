"""Where a prefix hit's tokens were when the daemon was asked, for every engine's figures.

An allocation's ``sources`` (:class:`kvcore.results.Allocation`) are runs ``(medium,
tokens)`` in chain order, adding up to its ``num_cached_tokens``: "pool" (the daemon's
pool itself), or the lower tier that brought the pages up ("host", "disk", "remote";
:data:`kvcore.hits.MEDIA`). An empty list means every hit token was in the pool. An
engine reports a range of those tokens (vLLM: the ones past its own prefix cache) by
intersecting it with the runs' cumulative offsets::

    tokens    0          64                 192        256
    runs      | pool 64  | host 128         | disk 64  |  (past the runs: the pool's)
    range               [start ............. stop)
    split               host 128 - (start - 64)   disk stop - 192

Tokens of the range past the runs (a hit that grew after the allocation: pages the
request saved itself) were in the pool, and so is anything this module cannot tell (a
medium it does not know, a run of a negative count): every split adds up to the
range's length and never raises. Pure functions: no daemon, no engine.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcore.hits import MEDIA

POOL = MEDIA[0]


def media_in(sources: Sequence[tuple[str, int]], start: int, stop: int) -> dict[str, int]:
    """Tokens ``[start, stop)`` of a hit by the medium they came from (``sources``: an
    allocation's runs); only media with tokens, and their counts add up to ``stop - start``
    (0 tokens, an empty dict, for an empty or reversed range)."""
    split: dict[str, int] = {}
    start = max(start, 0)
    offset = 0
    for medium, tokens in sources:
        lo, hi = max(start, offset), min(stop, offset + max(tokens, 0))
        offset += max(tokens, 0)
        if hi > lo:
            known = medium if medium in MEDIA else POOL
            split[known] = split.get(known, 0) + hi - lo
    rest = stop - max(start, offset)  # past the runs: in the pool
    if rest > 0:
        split[POOL] = split.get(POOL, 0) + rest
    return split


def add_media(total: dict[str, int], split: dict[str, int]) -> None:
    """Add ``split`` (medium -> count) into ``total``."""
    for medium, n in split.items():
        total[medium] = total.get(medium, 0) + n
