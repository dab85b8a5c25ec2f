"""The contract of a lower tier: keys, counters, and the operations every tier offers.

A tier stores *pages* below the pool: one page is one pool page across every
layer, ``page_bytes`` bytes, in its stored form: a tensor of
``layout.stored_page_shape``, the page's elements in the pool's order with the page
axis dropped (``[num_layers, parts, page_size, num_kv_heads, head_dim]`` for the
layer-major order LPKTH; kvcore.layout). kvcore.tiers.transfer moves them out of
and into a pool in bulk, one run per page when the order is page-major. A batch of
``n`` pages is one tensor ``[n, *stored_page_shape]``; ``parts`` is 2 (K and V) or 1
(an MLA latent vector). Tiers store and return bytes: fp8 and latent pages travel
exactly like the others, every bit pattern kept.

Keys (:data:`TierKey`, 48 bytes)::

    TierKey = layout fingerprint (16 bytes) || prefix key (32 bytes, spec/hashing.md)

The fingerprint (:func:`layout_fingerprint`) hashes what fixes a page's bytes:
layers, kv heads, head dim, page size, dtype, kind, physical order and byte
order, never ``num_pages``. So two pools of one model share entries whatever their sizes,
and a pool of another shape never reads bytes of the wrong shape. Namespaces
are already inside prefix keys (every chain starts at root(namespace)), so
they stay apart in every tier without another field.

Every tier answers the same four questions (:class:`Tier`): ``match`` (how
many leading keys of a chain it holds; read-only), ``get_many`` (the pages of
the leading run it holds and can verify), ``put_many`` (store pages; what it
pushed out to make room) and ``stats``. A tier never raises on a missing,
corrupt or unreachable entry: that is a miss, counted in :class:`TierStats`.
It raises :class:`~kvcore.errors.BadRequest` only for a caller's mistake (a
key of another layout, pages of the wrong shape).
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NewType, Protocol

from kvcore.errors import BadRequest
from kvcore.eviction import EvictionPolicy
from kvcore.layout import AXES, KVLayout
from kvcore.prefix import KEY_BYTES, PrefixKey

if TYPE_CHECKING:
    import torch

TierKey = NewType("TierKey", bytes)

FINGERPRINT_BYTES = 16
TIER_KEY_BYTES = FINGERPRINT_BYTES + KEY_BYTES
_FINGERPRINT_DOMAIN = b"kvcore/tier-layout/v1"


def layout_fingerprint(layout: KVLayout) -> bytes:
    """16 bytes naming the shape of a page's bytes (not the pool's size).

    Equal for two layouts iff they agree on layers, kv heads, head dim, page
    size, dtype, kind, physical order (a page is stored in it), and the machine's
    byte order (the bytes are native-endian).
    """
    text = (
        f"layers={layout.num_layers};kv_heads={layout.num_kv_heads};head_dim={layout.head_dim};"
        f"page_size={layout.page_size};dtype={layout.dtype};order={sys.byteorder}"
    )
    if layout.kind != "kv":  # kv layouts keep the fingerprints they had before kinds
        text += f";kind={layout.kind}"
    if layout.order != AXES:  # layer-major (the identity order) keeps its fingerprint
        text += f";axes={layout.order}"
    message = _FINGERPRINT_DOMAIN + b";" + text.encode()
    return hashlib.blake2b(message, digest_size=FINGERPRINT_BYTES).digest()


def tier_key(fingerprint: bytes, key: PrefixKey) -> TierKey:
    """The tier key of prefix key ``key`` under a layout's fingerprint."""
    if len(fingerprint) != FINGERPRINT_BYTES or len(key) != KEY_BYTES:
        raise BadRequest(
            f"a tier key is a {FINGERPRINT_BYTES}-byte fingerprint and a {KEY_BYTES}-byte "
            f"prefix key, got {len(fingerprint)} and {len(key)} bytes"
        )
    return TierKey(fingerprint + key)


def tier_keys(fingerprint: bytes, keys: Sequence[PrefixKey]) -> list[TierKey]:
    """:func:`tier_key` of each key, in order (one call per chain on the hot path)."""
    return [tier_key(fingerprint, key) for key in keys]


def prefix_of(key: TierKey) -> PrefixKey:
    """The prefix key inside a tier key."""
    return PrefixKey(key[FINGERPRINT_BYTES:])


@dataclass(slots=True)
class TierStats:
    """Counters of one tier, monotonic except the two gauges. Units as named.

    Written only by the tier that owns it; callers get a copy (:meth:`copy`).
    ``hits`` + ``misses`` = pages asked of ``get_many``; ``corrupt`` pages are
    also counted as misses. ``dropped``: pages a put discarded without storing
    them (the remote tier's full queue). ``timeouts``: calls the remote tier
    abandoned at its bound.
    """

    pages: int = 0  # gauge: entries resident now (remote: pages this tier published)
    bytes_used: int = 0  # gauge: bytes those entries take (payload and headers)
    hits: int = 0  # pages returned by get_many
    misses: int = 0  # pages asked of get_many and not returned
    corrupt: int = 0  # entries that failed verification (each also a miss)
    stored: int = 0  # pages written into the tier
    evicted: int = 0  # entries pushed out to make room
    bytes_in: int = 0  # payload bytes written into the tier
    bytes_out: int = 0  # payload bytes read out of the tier
    dropped: int = 0
    timeouts: int = 0

    def copy(self) -> TierStats:
        return TierStats(
            self.pages,
            self.bytes_used,
            self.hits,
            self.misses,
            self.corrupt,
            self.stored,
            self.evicted,
            self.bytes_in,
            self.bytes_out,
            self.dropped,
            self.timeouts,
        )


class LocalKeys:
    """The key view the local tiers (host, disk) share: ``_where`` maps each held key to
    where it lives; ``_order`` holds the same keys in the order of the tier's eviction
    policy (kvcore.eviction: the pool's); ``_stats`` are the tier's counters."""

    _where: dict[TierKey, Any]
    _order: EvictionPolicy[TierKey]
    _stats: TierStats

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def __len__(self) -> int:
        return len(self._where)

    @property
    def eviction(self) -> str:
        """The name of the tier's eviction policy."""
        return self._order.name

    def keys(self) -> list[TierKey]:
        """Held keys (in the policy's iteration order: LRU's is least recent first)."""
        return list(self._order)

    def _store(self, key: TierKey, where: Any) -> None:
        """Hold ``key`` (not held) at ``where``, newest in the policy."""
        self._where[key] = where
        self._order.add(((key, key),))

    def _evict(self) -> tuple[TierKey, Any]:
        """The policy's victim and where it lived, no longer held."""
        (key,) = self._order.evict(1)
        return key, self._where.pop(key)

    def _forget(self, key: TierKey) -> Any:
        """Stop holding ``key`` (held), not as an eviction; where it lived."""
        self._order.drop(key)
        return self._where.pop(key)

    def stats(self) -> TierStats:
        return self._stats.copy()


class Tier(Protocol):
    """What the daemon needs of a lower tier. Not thread-safe unless a tier says so.

    ``medium`` names the tier in stats and events: "host", "disk" or "remote".
    All keys of one call carry this tier's fingerprint (BadRequest otherwise).
    """

    medium: str
    layout: KVLayout
    fingerprint: bytes

    def match(self, keys: Sequence[TierKey]) -> int:
        """How many leading ``keys`` the tier holds now. Read-only: no LRU update, no
        counters, no verification of bytes (``get_many`` may still miss)."""

    def get_many(self, keys: Sequence[TierKey]) -> torch.Tensor:
        """Pages of the longest leading run of ``keys`` held and verified:
        ``[m, *layout.stored_page_shape]``, ``m <= len(keys)``,
        on the CPU; page ``i`` holds exactly the bytes put under ``keys[i]``.
        Refreshes those entries in the LRU; counts m hits and len(keys) - m misses."""

    def put_many(self, keys: Sequence[TierKey], pages: torch.Tensor) -> list[TierKey]:
        """Store ``pages[i]`` under ``keys[i]``; a key already held is only refreshed
        (first write wins in the local tiers; the store keeps what any client of its
        master last wrote, which is why every read verifies). Returns the keys of the
        entries pushed out to make room."""

    def stats(self) -> TierStats: ...

    def check_integrity(self) -> None:
        """Assert the tier's invariants (tests; O(entries))."""


def check_keys(fingerprint: bytes, keys: Sequence[TierKey]) -> None:
    """BadRequest unless every key is a tier key under ``fingerprint``."""
    for key in keys:
        if len(key) != TIER_KEY_BYTES or key[:FINGERPRINT_BYTES] != fingerprint:
            raise BadRequest(
                f"tier key {bytes(key[:8]).hex()}... is not a key of this tier's layout"
            )


def check_pages(layout: KVLayout, keys: Sequence[TierKey], pages: torch.Tensor) -> None:
    """BadRequest unless ``pages`` is ``[len(keys), *stored_page_shape]`` of the layout's
    dtype, on the CPU."""
    shape = (len(keys), *layout.stored_page_shape)
    if tuple(pages.shape) != shape or pages.dtype != layout.torch_dtype():
        raise BadRequest(
            f"pages must be {layout.dtype} {list(shape)}, got {pages.dtype} {list(pages.shape)}"
        )
    if pages.device.type != "cpu":
        raise BadRequest(f"pages must be on the CPU, got {pages.device}")
