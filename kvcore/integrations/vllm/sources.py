"""Which cache tier supplied a request's external hit, in vLLM's terms (``CacheHitSource``).

vLLM asks the connector right after ``update_state_after_alloc``
(``get_external_cache_hit_sources``) and reports the split as
``vllm:prompt_tokens_cached_by_source``. The external tokens are the range after
vLLM's own prefix hit (on by default), which kvcore's allocation covered too::

    prompt     0              local            local + external
    vLLM       | its own hit  |                |
    kvcore     | sources: pool ... host ... disk ... (Allocation.sources runs)
    reported                  [ intersection ) by medium, then mapped below

so the split intersects that range with the allocation's runs
(:func:`kvcore.integrations.hit_media.media_in`), never scales them. A kvcore medium
maps to vLLM's source as:

======== ==========================================================================
kvcore   vLLM
======== ==========================================================================
pool     HOST for a pool in host memory (device "cpu"), DEVICE for a cuda pool
         (local HBM, shared by CUDA IPC): :func:`pool_source`
host     HOST (the daemon's host tier)
disk     DISK
remote   P2P (a Mooncake Store, other nodes; as vLLM's own mooncake connector reports)
======== ==========================================================================

What cannot be attributed (the request's record gone, tokens past the runs) is the
pool's: the counts always add up to ``num_external_tokens``, only non-zero entries are
returned, and nothing here raises.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvcore.integrations.hit_media import POOL, media_in

LOWER_TIER_SOURCE: dict[str, CacheHitSource] = {
    "host": CacheHitSource.HOST,
    "disk": CacheHitSource.DISK,
    "remote": CacheHitSource.P2P,
}
"""vLLM's source of each of kvcore's lower tiers (the pool's: :func:`pool_source`)."""


def pool_source(device: str) -> CacheHitSource:
    """vLLM's source of pages that were in the daemon's pool: HOST for a host pool
    (``device`` "cpu"), DEVICE for a cuda pool ("cuda:N")."""
    return CacheHitSource.HOST if device == "cpu" else CacheHitSource.DEVICE


def hit_sources(
    sources: Sequence[tuple[str, int]], start: int, count: int, pool: CacheHitSource
) -> dict[CacheHitSource, int]:
    """The ``count`` external tokens from token ``start`` (vLLM's own hit) by vLLM's
    source: ``sources`` are the request's allocation's runs (medium, tokens), ``pool``
    the source of the pool's pages (:func:`pool_source`). Non-zero entries only; they add
    up to ``count`` (none for ``count`` <= 0)."""
    split: dict[CacheHitSource, int] = {}
    for medium, tokens in media_in(sources, start, start + count).items():
        source = pool if medium == POOL else LOWER_TIER_SOURCE[medium]
        split[source] = split.get(source, 0) + tokens
    return split
