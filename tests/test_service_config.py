"""Daemon configuration: every bad value is a clear BadRequest, never a traceback."""

from __future__ import annotations

import pytest

from kvcore.config import PoolConfig, ServiceConfig, TenantConfig, parse_pool_spec, parse_size
from kvcore.errors import BadRequest


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
    ],
)
def test_bad_service_settings_are_rejected(bad: dict[str, object]) -> None:
    with pytest.raises(BadRequest):
        ServiceConfig(**bad).validate()  # type: ignore[arg-type]


def test_pool_spec_parses_ascii_digits_only() -> None:
    pool = parse_pool_spec("name=a,num-layers=2,size=64MiB")
    assert (pool.name, pool.num_layers, parse_size(pool.size)) == ("a", 2, 64 << 20)
    for spec in ("num_layers=²", "num_layers", "colour=red"):
        with pytest.raises(BadRequest):
            parse_pool_spec(spec)
