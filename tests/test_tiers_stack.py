"""TierStack: spills go host -> disk, lookups find runs across tiers, and the daemon's
TieredManager brings those runs into pool pages with the exact bytes spilled."""

from __future__ import annotations

from pathlib import Path

import torch

from kvcore.daemon.tiering import TieredManager
from kvcore.layout import KVLayout
from kvcore.manager import Manager
from kvcore.prefix import PageStored
from kvcore.tiers import DiskTier, HostTier, gather_pages, layout_fingerprint, tier_keys
from kvcore.tiers.codec import HEADER_BYTES
from kvcore.tiers.stack import TierStack

LAYOUT = KVLayout(
    num_layers=2, num_kv_heads=1, head_dim=4, page_size=2, dtype="float32", num_pages=8
)
PAGE = LAYOUT.stored_page_shape  # [L, parts, page_size, H, D]: layer-major
TOKENS = list(range(2 * 6 + 1))  # six full pages, then the token an engine computes
# the tier keys of TOKENS' six pages in the default key space, as the daemon's Manager hashes them
KEYS = tier_keys(layout_fingerprint(LAYOUT), Manager(LAYOUT).plan(TOKENS).keys)


def test_spill_locate_promote(tmp_path: Path) -> None:
    stack = TierStack(
        HostTier(LAYOUT, 2),
        DiskTier(LAYOUT, tmp_path / "d", 8 * (HEADER_BYTES + LAYOUT.page_bytes)),
    )
    try:
        pages = torch.randn(6, *PAGE)
        stack.spill(KEYS[:4], pages[:4])  # host keeps k2 k3; k0 k1 spill to disk
        assert stack.disk is not None and stack.disk.keys() == KEYS[:2]
        runs = stack.locate(KEYS)
        assert [(r.tier.medium, r.start, r.count) for r in runs] == [("disk", 0, 2), ("host", 2, 2)]
        memory = torch.zeros(LAYOUT.total_bytes // 4)
        manager = TieredManager(LAYOUT, memory, stack)  # as the daemon drives the stack
        pool = LAYOUT.pages_view(memory)
        got = manager.allocate(1, TOKENS)  # a pool miss: promotes k0..k3 first
        assert got.num_cached_tokens == 4 * LAYOUT.page_size and len(got.pages) == 7
        assert torch.equal(gather_pages(pool, got.pages[:4]), pages[:4])
        stored = [e for e in manager.take_events() if isinstance(e, PageStored)]
        media = ["disk", "disk", "host", "host"]  # promoted run by run, top tier first
        assert [(e.page, e.medium) for e in stored] == list(zip(got.pages[:4], media, strict=True))
        manager.check_integrity()
        stats = stack.stats()
        assert stats["host"].hits == 2 and stats["disk"].hits == 2
        assert stack.locate(KEYS[4:]) == []
    finally:
        stack.close()
