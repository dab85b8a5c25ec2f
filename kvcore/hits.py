"""Where a pool's prefix hits come from: per namespace, per medium, and the busiest prefixes.

A :class:`HitBook` belongs to one pool's Manager, which records every allocation's
query and hit (tokens) in it; a holder of lower tiers (kvcore.daemon.tiering) adds
which of those hit tokens its tiers brought up, by medium. The rest of a hit was in
the pool already::

    hit_tokens[ns]["pool"] = hits[ns] - sum(lower[ns][medium] for host, disk, remote)

Bounded whatever clients send: at most :data:`MAX_NAMESPACES` namespaces are counted
by name, later ones together under :data:`OTHER_NAMESPACE` (a client may name its
namespace so too: it only shares a row); at most :data:`BUSIEST` prefixes are
tracked, by the space-saving rule (a new prefix replaces the least-hit one and
inherits its count, so a prefix's count is an upper bound off by at most what it
inherited). O(1) per allocation, O(BUSIEST) when a new prefix replaces another.
No I/O, no clock: the daemon reads it at its stats.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcore.prefix import DEFAULT_NAMESPACE, PrefixKey

MEDIA = ("pool", "host", "disk", "remote")  # where a hit's pages were when it was asked
MAX_NAMESPACES = 64  # namespaces counted by name, per pool; then OTHER_NAMESPACE
OTHER_NAMESPACE = "(other)"
BUSIEST = 16  # prefixes tracked per pool


@dataclass(slots=True)
class NamespaceCount:
    """Tokens of one namespace's allocations: asked, hit, and of the hit, what each lower
    tier brought up (medium -> tokens). Written by the book's owners only."""

    query_tokens: int = 0
    hit_tokens: int = 0
    lower: dict[str, int] = field(default_factory=dict)

    def by_medium(self) -> dict[str, int]:
        """Hit tokens by medium, "pool" first; media with none left out."""
        pool = self.hit_tokens - sum(self.lower.values())
        assert pool >= 0, (
            f"lower tiers brought up {self.lower}, more than the {self.hit_tokens} hit"
        )
        split = {"pool": pool, **self.lower}
        return {medium: tokens for medium, tokens in split.items() if tokens}


@dataclass(slots=True)
class PrefixCount:
    """One tracked prefix, named by its first page's key in ``namespace``."""

    namespace: str
    hit_tokens: int = 0  # tokens of the hits that began with this page (space-saving bound)
    hits: int = 0  # allocations that hit it


class HitBook:
    """Per-namespace and per-prefix hit counters of one pool (module docstring)."""

    __slots__ = ("busiest", "hit_tokens", "namespaces", "query_tokens")

    def __init__(self) -> None:
        self.query_tokens = 0  # every allocation's, exact whatever the namespace bound
        self.hit_tokens = 0
        self.namespaces: dict[str, NamespaceCount] = {}
        self.busiest: dict[PrefixKey, PrefixCount] = {}

    def record(
        self, namespace: str | None, query_tokens: int, hit_tokens: int, first: PrefixKey | None
    ) -> None:
        """One allocation of ``query_tokens`` in ``namespace`` (None: the default one),
        ``hit_tokens`` of them cached, its hit starting at the page keyed ``first``
        (None: no hit to name)."""
        namespace = DEFAULT_NAMESPACE if namespace is None else namespace
        self.query_tokens += query_tokens
        self.hit_tokens += hit_tokens
        count = self._namespace(namespace)
        count.query_tokens += query_tokens
        count.hit_tokens += hit_tokens
        if first is not None and hit_tokens:
            self._busy(first, namespace, hit_tokens)

    def lower(self, namespace: str | None, medium: str, tokens: int) -> None:
        """Of ``namespace``'s latest recorded hit, ``tokens`` were brought up from the
        lower tier ``medium`` (called after :meth:`record` of that allocation)."""
        namespace = DEFAULT_NAMESPACE if namespace is None else namespace
        assert medium in MEDIA[1:], f"{medium!r} is not a lower tier"
        lower = self._namespace(namespace).lower
        lower[medium] = lower.get(medium, 0) + tokens

    def _namespace(self, namespace: str) -> NamespaceCount:
        count = self.namespaces.get(namespace)
        if count is None:
            if len(self.namespaces) >= MAX_NAMESPACES:
                namespace = OTHER_NAMESPACE
            count = self.namespaces.setdefault(namespace, NamespaceCount())
        return count

    def _busy(self, key: PrefixKey, namespace: str, tokens: int) -> None:
        count = self.busiest.get(key)
        if count is None:
            if len(self.busiest) >= BUSIEST:
                least = min(self.busiest, key=lambda k: self.busiest[k].hit_tokens)
                inherited = self.busiest.pop(least)
                count = PrefixCount(namespace, inherited.hit_tokens, inherited.hits)
            else:
                count = PrefixCount(namespace)
            self.busiest[key] = count
        count.hit_tokens += tokens
        count.hits += 1

    def check_integrity(self) -> None:
        """Assert the bounds and that the namespaces add up to the totals."""
        assert len(self.namespaces) <= MAX_NAMESPACES + 1, "namespace bound broken"
        assert len(self.busiest) <= BUSIEST, "prefix bound broken"
        counts = self.namespaces.values()
        assert sum(c.query_tokens for c in counts) == self.query_tokens, "queries do not add up"
        assert sum(c.hit_tokens for c in counts) == self.hit_tokens, "hits do not add up"
        for count in counts:
            count.by_medium()  # asserts the lower tiers brought up no more than was hit


# Seconds to bring one request's pages up from one lower tier (read, verify, copy):
# host copies take tens of microseconds; disk and remote reads, milliseconds and more.
PROMOTION_BUCKETS_S = (1e-4, 2.5e-4, 1e-3, 2.5e-3, 1e-2, 2.5e-2, 0.1, 0.25, 1.0)


@dataclass(slots=True)
class Histogram:
    """Observations in seconds over fixed bounds (:data:`PROMOTION_BUCKETS_S`):
    ``counts[i]`` observations at most ``bounds[i]`` and above the bound before,
    ``counts[-1]`` those above the last; ``sum_s`` their total. Not cumulative."""

    bounds: tuple[float, ...] = PROMOTION_BUCKETS_S
    counts: list[int] = field(default_factory=lambda: [0] * (len(PROMOTION_BUCKETS_S) + 1))
    sum_s: float = 0.0

    def observe(self, seconds: float) -> None:
        self.sum_s += seconds
        for i, bound in enumerate(self.bounds):
            if seconds <= bound:
                self.counts[i] += 1
                return
        self.counts[-1] += 1
