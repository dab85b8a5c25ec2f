"""Daemon configuration: every bad value is a clear BadRequest, never a traceback."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from kvcore.config import (
    POOL_KEYS,
    PoolConfig,
    ServiceConfig,
    TenantConfig,
    apply_env,
    load_toml,
    parse_pool_spec,
)
from kvcore.daemon.daemon import check_shm
from kvcore.daemon.serve import add_arguments, build_config
from kvcore.daemon_process import DaemonProcess
from kvcore.errors import BadRequest
from kvcore.layout import DTYPE_SIZES, KINDS
from kvcore.sizes import parse_size


@pytest.mark.parametrize(
    "bad",
    [
        {"lease_timeout_s": 0.0},
        {"lease_timeout_s": float("inf")},
        {"lease_timeout_s": float("nan")},
        {"max_frame_bytes": 100},
        {"max_frame_bytes": 10**20},
        {"max_batch": 0},
        {"pools": []},
        {"pools": [PoolConfig(), PoolConfig()]},  # the same name twice
        {"pools": [PoolConfig(page_size=0)]},
        {"pools": [PoolConfig(session_max_pages=-1)]},
        {"max_sessions": 0},
        {"max_request_tokens": 0},
        {"fence_timeout_s": float("nan")},
        {"socket_mode": 0o666},  # wider than 0600 only with tenants
        {"socket_mode": 0o1777, "tenants": [TenantConfig(name="t")]},
        {"tenants": [TenantConfig(name="t", keys=["short"])]},
        {"tenants": [TenantConfig(name="")]},  # "" is the operator's grant
        {"tenants": [TenantConfig(name="t"), TenantConfig(name="t")]},
        {"max_sessions_per_process": 0},
        {"max_sessions": 8, "max_sessions_per_tenant": 9},
    ],
)
def test_bad_service_settings_are_rejected(bad: dict[str, object]) -> None:
    with pytest.raises(BadRequest):
        ServiceConfig(**bad).validate()  # type: ignore[arg-type]


def test_one_credential_in_two_tenants_is_refused_naming_both() -> None:
    """Two entries for one uid (or key): the later one used to win silently."""
    key = "x" * 40
    for first, second in (
        (TenantConfig(name="alice", uids=[1000]), TenantConfig(name="bob", uids=[1000])),
        (TenantConfig(name="alice", keys=[key]), TenantConfig(name="bob", keys=[key])),
    ):
        with pytest.raises(BadRequest, match="tenants 'alice' and 'bob' both name"):
            ServiceConfig(tenants=[first, second]).validate()


def test_session_bounds_come_from_the_file_and_the_flags(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    toml = tmp_path / "kvcore.toml"
    toml.write_text("max_sessions_per_tenant = 7\n")
    args = parser.parse_args(["--config", str(toml), "--max-sessions-per-process", "3"])
    config = build_config(args)
    assert (config.max_sessions_per_process, config.max_sessions_per_tenant) == (3, 7)


def test_pool_spec_parses_ascii_digits_only() -> None:
    pool = parse_pool_spec("name=a,num-layers=2,size=64MiB")
    assert (pool.name, pool.num_layers, parse_size(pool.size)) == ("a", 2, 64 << 20)
    for spec in ("num_layers=²", "num_layers", "colour=red"):
        with pytest.raises(BadRequest):
            parse_pool_spec(spec)


# Text for a setting of each declared type, and what it converts to.
SAMPLES: dict[object, tuple[str, object]] = {
    int: ("3", 3),
    float: ("0.5", 0.5),
    bool: ("true", True),
    str: ("x", "x"),
    int | str: ("4GiB", "4GiB"),
    int | None: ("5", 5),
}


def test_a_pool_setting_converts_one_way_from_flags_and_environment() -> None:
    """Every --pool key (TierConfig's by their flag names) converts its text to its field's
    type, and its KVCORE_POOL_<KEY> variable gives the same pool: a new pool setting is
    one field. A bad value names the flag or variable and the value."""
    for key, (is_tier, field) in POOL_KEYS.items():
        declared = getattr(field.type, "__origin__", field.type)  # Annotated: its type
        text, value = SAMPLES[declared]
        flagged = parse_pool_spec(f"{key}={text}")
        env = apply_env(ServiceConfig(), {f"KVCORE_POOL_{key.upper()}": text}).pools[0]
        assert flagged == env, key
        assert getattr(flagged.tiers if is_tier else flagged, field.name) == value, key
    assert parse_size(parse_pool_spec("size=4096").size) == 4096  # a byte count as text
    for key, text in (("tier_encrypt", "maybe"), ("remote_timeout_s", "abc"), ("shards", "")):
        with pytest.raises(BadRequest, match=f"--pool {key}={text!r}"):
            parse_pool_spec(f"name=a,{key}={text}")
        var = f"KVCORE_POOL_{key.upper()}"
        with pytest.raises(BadRequest, match=f"{var}={text!r}"):
            apply_env(ServiceConfig(), {var: text})
    with pytest.raises(BadRequest, match=r"KVCORE_POOLS 'colour=red'.*unknown key"):
        apply_env(ServiceConfig(), {"KVCORE_POOLS": "colour=red"})


LATENT = {"num_layers": 2, "num_kv_heads": 1, "head_dim": 576, "num_pages": 8}


@pytest.mark.parametrize("dtype", sorted(DTYPE_SIZES))
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_dtype_and_kind_comes_from_flags_file_and_environment(
    tmp_path: Path, dtype: str, kind: str
) -> None:
    """fp8 and latent pools, as any: --pool (through the daemon's command line), the TOML
    file, KVCORE_POOLS and KVCORE_POOL_<KEY> give the same valid pool."""
    settings = {**LATENT, "dtype": dtype, "kind": kind}
    spec = ",".join(f"{key}={value}" for key, value in settings.items())
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    toml = tmp_path / "kvcore.toml"
    toml.write_text(
        "[[pools]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items())
    )
    env = {f"KVCORE_POOL_{key.upper()}": str(value) for key, value in settings.items()}
    pools = [
        build_config(parser.parse_args(["--pool", spec])).pools[0],
        load_toml(toml).pools[0],
        apply_env(ServiceConfig(), {"KVCORE_POOLS": spec}).pools[0],
        apply_env(ServiceConfig(), env).pools[0],
    ]
    for pool in pools:
        pool.validate()
        assert (pool.layout().dtype, pool.layout().kind) == (dtype, kind)
    assert pools.count(pools[0]) == len(pools)


@pytest.mark.parametrize(("key", "allowed"), [("dtype", DTYPE_SIZES), ("kind", KINDS)])
def test_a_bad_dtype_or_kind_names_the_allowed_values(
    tmp_path: Path, key: str, allowed: dict[str, int]
) -> None:
    toml = tmp_path / "kvcore.toml"
    toml.write_text(f'[[pools]]\nnum_pages = 8\n{key} = "fp9"\n')
    for config in (
        ServiceConfig(pools=[parse_pool_spec(f"num_pages=8,{key}=fp9")]),
        load_toml(toml),
        apply_env(ServiceConfig(), {f"KVCORE_POOL_{key.upper()}": "fp9"}),
    ):
        with pytest.raises(BadRequest, match="fp9") as refused:
            config.validate()
        assert all(name in str(refused.value) for name in allowed)


def test_environment_overrides_the_file_and_flags_override_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    toml = tmp_path / "kvcore.toml"
    toml.write_text('lease_timeout_s = 7.0\nevents = ""\n[[pools]]\nname = "a"\nnum_pages = 8\n')
    env = {
        "KVCORE_LEASE_TIMEOUT_S": "5",
        "KVCORE_EVENTS": "auto",
        "KVCORE_INSECURE": "true",
        "KVCORE_METRICS_PORT": "0",
        "KVCORE_POOL_NUM_LAYERS": "4",
        "KVCORE_UNRELATED": "x",
    }
    config = apply_env(load_toml(toml), env)
    assert (config.lease_timeout_s, config.events, config.insecure) == (5.0, "auto", True)
    assert config.metrics_port == 0
    assert [(p.name, p.num_layers, p.num_pages) for p in config.pools] == [("a", 4, 8)]
    pools = apply_env(ServiceConfig(), {"KVCORE_POOLS": "name=x,num_pages=4;name=y,num_pages=2"})
    assert [(p.name, p.num_pages) for p in pools.pools] == [("x", 4), ("y", 2)]
    with pytest.raises(BadRequest, match="KVCORE_MAX_BATCH"):
        apply_env(ServiceConfig(), {"KVCORE_MAX_BATCH": "many"})
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    config = build_config(parser.parse_args(["--config", str(toml), "--lease-timeout", "3"]))
    assert (config.lease_timeout_s, config.events) == (3.0, "auto")  # flag > env > file


def test_host_pools_larger_than_shared_memory_are_refused() -> None:
    free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
    huge = ServiceConfig(pools=[PoolConfig(size=free + (1 << 30))])
    with pytest.raises(BadRequest, match=r"GiB free .* --shm-size"):
        check_shm(huge)
    check_shm(ServiceConfig(pools=[PoolConfig(num_pages=8)]))


def test_what_the_endpoints_old_segments_hold_counts_as_free() -> None:
    """A restart re-adopts (or unlinks) the last daemon's segments: their bytes are the
    new pools' room, so a full pool that fit before still fits."""
    prefix, held = "kvcore-test-check-shm", 64 << 20
    path = f"/dev/shm/{prefix}-1-000000000000"
    with open(path, "wb") as f:
        f.write(b"\1" * held)
    try:
        free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
        config = ServiceConfig(pools=[PoolConfig(size=free + held // 2)])
        with pytest.raises(BadRequest, match="GiB free"):
            check_shm(config)
        check_shm(config, prefix=prefix)
    finally:
        os.unlink(path)


def test_debug_logs_the_effective_configuration() -> None:
    env = {**os.environ, "KVCORE_LEASE_TIMEOUT_S": "5"}
    pool = "num_layers=1,num_kv_heads=1,head_dim=576,dtype=float8_e4m3fn,kind=latent,num_pages=8"
    with DaemonProcess.private("--pool", pool, "--log-level", "DEBUG", env=env) as d:
        line = next(ln for ln in d.lines if "effective configuration" in ln)
    assert '"lease_timeout_s": 5.0' in line and '"num_pages": 8' in line
    assert '"dtype": "float8_e4m3fn", "kind": "latent"' in line  # and the daemon serves it
