"""Lower tiers below a pool: host memory, a disk directory, a Mooncake store.

Stacked by layer: ``base`` (keys, counters, the contract), ``codec`` (the
framing of a checksummed entry), ``secret`` (the deployment's shared secret
and what it derives) and ``keyed`` (the framing of a MAC'd, optionally
encrypted entry), ``directory`` (a tier directory opened and checked by
descriptor), ``transfer`` (pool <-> page batches in bulk),
then one module per medium (``worker``: bounded calls into the store),
``stack`` (the tiers of one pool, top down, as kvcore.daemon.tiering drives
them). What a pool declares (TierConfig) is part of kvcore.config.

Importing this package loads ``base`` and ``transfer`` only (neither imports
torch). The tier implementations load on first use of their names
(``from kvcore.tiers import DiskTier``): the remote tier's worker registers an
atexit hook, which no process that never builds a tier should carry. Each
tier imports torch or mooncake when it is built.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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
from kvcore.tiers.transfer import gather_pages, scatter_pages

if TYPE_CHECKING:
    from kvcore.tiers.disk import DiskTier
    from kvcore.tiers.host import HostTier, Spilled
    from kvcore.tiers.remote import RemoteConfig, RemoteTier, mooncake_available
    from kvcore.tiers.stack import Run, TierStack

# the names of the tier implementations -> their modules, imported on first use
_LAZY = {
    "DiskTier": "disk",
    "HostTier": "host",
    "Spilled": "host",
    "RemoteConfig": "remote",
    "RemoteTier": "remote",
    "mooncake_available": "remote",
    "Run": "stack",
    "TierStack": "stack",
}

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


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvcore.tiers' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kvcore.tiers.{module}"), name)
