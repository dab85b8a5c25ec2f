"""TierStack: spills go host -> disk, lookups find runs across tiers, fetch writes exact pages."""

from __future__ import annotations

from pathlib import Path

import torch

from kvcore.layout import KVLayout
from kvcore.prefix import chain_keys, encode_tokens, root_key
from kvcore.tiers import DiskTier, HostTier, gather_pages, layout_fingerprint, tier_keys
from kvcore.tiers.codec import HEADER_BYTES
from kvcore.tiers.stack import TierStack

LAYOUT = KVLayout(
    num_layers=2, num_kv_heads=1, head_dim=4, page_size=2, dtype="float32", num_pages=8
)
PAGE = (LAYOUT.num_layers, *LAYOUT.page_shape)
KEYS = tier_keys(
    layout_fingerprint(LAYOUT),
    list(chain_keys(root_key("ns"), encode_tokens(range(2 * 6)), LAYOUT.page_size)),
)


def test_spill_locate_fetch(tmp_path: Path) -> None:
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
        pool = LAYOUT.layer_views(torch.zeros(LAYOUT.total_bytes // 4))
        assert stack.fetch(KEYS, runs, pool, [7, 5, 3, 1, 0, 2]) == 4
        assert torch.equal(gather_pages(pool, [7, 5, 3, 1]), pages[:4])
        stats = stack.stats()
        assert stats["host"].hits == 2 and stats["disk"].hits == 2
        assert stack.locate(KEYS[4:]) == []
    finally:
        stack.close()
