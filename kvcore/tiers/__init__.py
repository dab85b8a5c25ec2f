"""Lower tiers below a pool: host memory, a disk directory, a Mooncake store.

Stacked by layer: ``base`` (keys, counters, the contract), ``codec`` (the
framing of a checksummed entry), ``transfer`` (pool <-> page batches in bulk),
then one module per medium (``worker``: bounded calls into the store),
``stack`` (the tiers of one pool, top down, as kvcore.daemon.tiering drives
them) and ``config`` (what a pool declares: TierConfig). Importing this
package imports neither torch nor mooncake; each tier imports what it needs
when it is built.
"""

from kvcore.tiers.base import (
    FINGERPRINT_BYTES,
    TIER_KEY_BYTES,
    Tier,
    TierKey,
    TierStats,
    layout_fingerprint,
    prefix_of,
    tier_key,
    tier_keys,
)
from kvcore.tiers.disk import DiskTier
from kvcore.tiers.host import HostTier, Spilled
from kvcore.tiers.remote import RemoteConfig, RemoteTier, mooncake_available
from kvcore.tiers.stack import Run, TierStack
from kvcore.tiers.transfer import gather_pages, scatter_pages

__all__ = [
    "FINGERPRINT_BYTES",
    "TIER_KEY_BYTES",
    "DiskTier",
    "HostTier",
    "RemoteConfig",
    "RemoteTier",
    "Run",
    "Spilled",
    "Tier",
    "TierKey",
    "TierStack",
    "TierStats",
    "gather_pages",
    "layout_fingerprint",
    "mooncake_available",
    "prefix_of",
    "scatter_pages",
    "tier_key",
    "tier_keys",
]
