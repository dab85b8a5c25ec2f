"""A TieredManager over a tiny pool with a host tier (optional) and a disk tier below
it, as the tiered-manager property tests drive it (tests/test_daemon_tiers_manager.py,
tests/test_daemon_tiers_pages.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvcore.daemon.tiering import TieredManager
from kvcore.layout import KVLayout
from kvcore.tiers import DiskTier, HostTier, TierStack

PAGE = 2
LAYOUT = KVLayout(
    num_layers=2, num_kv_heads=1, head_dim=4, page_size=PAGE, dtype="float32", num_pages=6
)


@dataclass
class Tiered:
    manager: TieredManager
    stack: TierStack  # close() it when done
    views: list[torch.Tensor]  # the engine's side: one view per layer


def tiered(layout: KVLayout, host_pages: int, eviction: str, directory: Path) -> Tiered:
    """A pool of ``layout``, ``host_pages`` host slots (0: no host tier) and a disk tier
    of 8 pages in ``directory``, all evicting by ``eviction``."""
    memory = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    host = HostTier(layout, host_pages, eviction=eviction) if host_pages else None
    disk = DiskTier(layout, directory, 8 * (layout.page_bytes + 80), eviction=eviction)
    stack = TierStack(host, disk)
    manager = TieredManager(layout, memory, stack, eviction=eviction)
    return Tiered(manager, stack, layout.layer_views(memory))
