"""A pool's tier configuration: TOML and --pool flags give the same TierConfig; tiers are
off by default; a misdeclared tier is a BadRequest naming the pool."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest

from kvcore.config import PoolConfig, ServiceConfig, TierConfig, parse_pool_spec
from kvcore.daemon.tiering import TieredManager, open_stack
from kvcore.errors import BadRequest
from kvcore.layout import KVLayout

LAYOUT = KVLayout(
    num_layers=1, num_kv_heads=1, head_dim=8, page_size=4, dtype="float16", num_pages=8
)


def test_tiers_are_off_by_default() -> None:
    assert not PoolConfig().tiers.enabled
    assert not parse_pool_spec("name=a,num_pages=8").tiers.enabled


def test_flags_and_toml_agree(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    flags = parse_pool_spec(
        f"name=a,num_pages=8,host_tier=1MiB,disk_tier={disk},"
        "disk_tier_size=2MiB,remote_master=127.0.0.1:1,"
        "remote_metadata=http://127.0.0.1:2/metadata,remote_timeout_s=0.5"
    )
    toml = f"""
[[pools]]
name = "a"
num_pages = 8
[pools.tiers]
host = "1MiB"
disk = "{disk}"
disk_size = "2MiB"
remote_master = "127.0.0.1:1"
remote_metadata = "http://127.0.0.1:2/metadata"
remote_timeout_s = 0.5
"""
    (from_file,) = msgspec.toml.decode(toml.encode(), type=ServiceConfig).pools
    assert from_file.tiers.enabled and from_file.tiers.host_bytes() == 1 << 20
    assert from_file.tiers.disk_bytes() == flags.tiers.disk_bytes() == 2 << 20
    assert from_file.tiers.host_bytes() == flags.tiers.host_bytes()
    for field in ("disk", "remote_master", "remote_metadata", "remote_timeout_s"):
        assert getattr(from_file.tiers, field) == getattr(flags.tiers, field)


@pytest.mark.parametrize(
    "tiers",
    [
        TierConfig(host=10),  # less than one page
        TierConfig(disk="/tmp/x", disk_size=10),
        TierConfig(remote_master="127.0.0.1:1"),  # no metadata server
        TierConfig(host="1MiB", remote_timeout_s=0.0),
    ],
)
def test_a_misdeclared_tier_is_a_bad_request(tiers: TierConfig) -> None:
    with pytest.raises(BadRequest, match="pool 'p'"):
        open_stack(LAYOUT, tiers, "p")


def test_open_stack_builds_the_declared_tiers(tmp_path: Path) -> None:
    import torch

    page = LAYOUT.page_bytes
    tiers = TierConfig(host=4 * page, disk=str(tmp_path / "d"), disk_size=16 * page)
    stack = open_stack(LAYOUT, tiers, "p")
    try:
        assert stack.host is not None and stack.host.capacity_pages == 4
        assert stack.disk is not None and stack.remote is None
        views = LAYOUT.layer_views(torch.zeros(LAYOUT.total_bytes, dtype=torch.uint8))
        manager = TieredManager(LAYOUT, views, stack)
        assert set(manager.tier_stats()) == {"host", "disk"}
        manager.check_integrity()
    finally:
        stack.close()


def test_the_deployment_secret_reaches_the_disk_tier(tmp_path: Path) -> None:
    """--pool tier_secret_file= (as the TOML's secret_file) keys the disk tier's entries;
    a secret others may read is refused at start."""
    secret = tmp_path / "secret"
    secret.write_text(os.urandom(32).hex())  # as docs/tiers.md makes one: text, not raw bytes
    secret.chmod(0o600)
    spec = f"name=a,num_pages=8,disk_tier={tmp_path / 'd'},disk_tier_size=1MiB"
    pool = parse_pool_spec(f"{spec},tier_secret_file={secret},tier_encrypt=false")
    assert pool.tiers.secret_file == str(secret) and pool.tiers.encrypt is False
    stack = open_stack(LAYOUT, pool.tiers, "a")
    try:
        assert stack.disk is not None and stack.disk._framing.keyed
    finally:
        stack.close()
    secret.chmod(0o644)
    with pytest.raises(BadRequest):
        open_stack(LAYOUT, pool.tiers, "a")
    with pytest.raises(BadRequest, match="tier_encrypt"):
        parse_pool_spec(f"{spec},tier_encrypt=maybe")
