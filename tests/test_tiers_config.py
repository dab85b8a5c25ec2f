"""A pool's tier configuration: TOML and --pool flags give the same TierConfig; tiers are
off by default; a misdeclared tier is a BadRequest naming the pool; a remote tier without
the deployment's secret is refused unless the operator opts out (--insecure-remote-tier)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from kvcore.config import (
    POOL_KEYS,
    PoolConfig,
    ServiceConfig,
    TierConfig,
    apply_env,
    parse_pool_spec,
)
from kvcore.daemon.tiering import TieredManager, open_stack
from kvcore.daemon_process import DaemonProcess
from kvcore.errors import BadRequest
from kvcore.layout import KVLayout

LAYOUT = KVLayout(
    num_layers=1, num_kv_heads=1, head_dim=8, page_size=4, dtype="float16", num_pages=8
)


def test_tiers_are_off_by_default() -> None:
    assert not PoolConfig().tiers.enabled
    assert not parse_pool_spec("name=a,num_pages=8").tiers.enabled


def test_flags_toml_and_environment_agree(tmp_path: Path) -> None:
    """Every tier setting, by its --pool flag, its [pools.tiers] key and its
    KVCORE_POOL_<FLAG> variable, gives the same TierConfig."""
    disk, secret = tmp_path / "disk", tmp_path / "secret"
    flags = {
        "host_tier": "1MiB",
        "disk_tier": str(disk),
        "disk_tier_size": "2MiB",
        "remote_master": "127.0.0.1:1",
        "remote_metadata": "http://127.0.0.1:2/metadata",
        "remote_timeout_s": "0.5",
        "remote_local_hostname": "10.0.0.2",
        "tier_secret_file": str(secret),
        "tier_previous_secret_file": f"{secret}.old",
        "tier_encrypt": "true",
    }
    spec = "name=a,num_pages=8," + ",".join(f"{key}={value}" for key, value in flags.items())
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
remote_local_hostname = "10.0.0.2"
secret_file = "{secret}"
previous_secret_file = "{secret}.old"
encrypt = true
"""
    (from_file,) = msgspec.toml.decode(toml.encode(), type=ServiceConfig).pools
    env = {f"KVCORE_POOL_{key.upper()}": value for key, value in flags.items()}
    (from_env,) = apply_env(ServiceConfig(pools=[PoolConfig(name="a", num_pages=8)]), env).pools
    assert parse_pool_spec(spec) == from_file == from_env
    assert from_file.tiers.enabled and from_file.tiers.host_bytes() == 1 << 20
    assert from_file.tiers.disk_bytes() == 2 << 20 and from_file.tiers.encrypt is True
    assert parse_pool_spec("host_tier=4096,disk_tier=7").tiers.host_bytes() == 4096
    assert parse_pool_spec("disk_tier=7").tiers.disk == "7"  # a path, however it reads


def test_the_deployment_guide_names_every_tier_flag() -> None:
    """docs/deploy.md lists the tier settings' --pool keys: a new one is named there too."""
    guide = (Path(__file__).resolve().parent.parent / "docs" / "deploy.md").read_text()
    flags = [key for key, (tier, _) in POOL_KEYS.items() if tier]
    assert "the `remote_*` keys as they are" in guide  # names those wholesale
    assert [key for key in flags if f"`{key}`" not in guide and not key.startswith("remote_")] == []


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
        manager = TieredManager(LAYOUT, torch.zeros(LAYOUT.total_bytes, dtype=torch.uint8), stack)
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


# An absent master (nothing listens on port 1): the tier is built and misses, no store needed.
REMOTE = "remote_master=127.0.0.1:1,remote_metadata=http://127.0.0.1:2/metadata"
REMOTE_POOL = f"name=shared,num_pages=8,num_layers=1,{REMOTE},remote_timeout_s=0.2"
WARNING = "trusts every client of the master"


def _secret(tmp_path: Path) -> Path:
    secret = tmp_path / "tier.secret"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    return secret


def test_a_remote_tier_without_a_secret_is_refused_unless_opted_out(tmp_path: Path) -> None:
    """The refusal is a BadRequest naming the pool, the setting that fixes it and the
    opt-out; a secret, or insecure_remote_tier (TOML, KVCORE_*), lets it validate."""
    config = ServiceConfig(pools=[parse_pool_spec(REMOTE_POOL)])
    with pytest.raises(BadRequest, match="pool 'shared'") as refused:
        config.validate()
    message = str(refused.value)
    assert "tier_secret_file" in message and "secret_file in [pools.tiers]" in message
    assert "--insecure-remote-tier" in message
    apply_env(config, {"KVCORE_INSECURE_REMOTE_TIER": "true"}).validate()
    keyed = parse_pool_spec(f"{REMOTE_POOL},tier_secret_file={_secret(tmp_path)}")
    ServiceConfig(pools=[keyed]).validate()
    toml = """
insecure_remote_tier = true
[[pools]]
name = "shared"
num_pages = 8
[pools.tiers]
remote_master = "127.0.0.1:1"
remote_metadata = "http://127.0.0.1:2/metadata"
"""
    from_file = msgspec.toml.decode(toml.encode(), type=ServiceConfig)
    assert from_file.insecure_remote_tier and from_file.pools[0].tiers.remote_master
    from_file.validate()
    ServiceConfig(pools=[parse_pool_spec("name=local,num_pages=8,host_tier=1MiB")]).validate()


def test_the_daemon_refuses_to_start_a_remote_tier_without_a_secret(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path / 'kvcore.sock'}"
    command = [sys.executable, "-m", "kvcore.daemon", "--endpoint", endpoint]
    done = subprocess.run(
        [*command, "--pool", REMOTE_POOL], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "tier_secret_file" in done.stderr and "--insecure-remote-tier" in done.stderr


def test_the_opt_out_starts_and_still_warns() -> None:
    with DaemonProcess.private("--pool", REMOTE_POOL, "--insecure-remote-tier") as daemon:
        assert "pool 'shared'" in daemon.output
        assert WARNING in daemon.output and "WARNING" in daemon.output


def test_a_secret_starts_without_a_warning(tmp_path: Path) -> None:
    pool = f"{REMOTE_POOL},tier_secret_file={_secret(tmp_path)}"
    with DaemonProcess.private("--pool", pool) as daemon:
        assert "pool 'shared'" in daemon.output
        assert WARNING not in daemon.output
