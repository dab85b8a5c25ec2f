"""Ephemeral pools (``--allow-ephemeral``) are the operator's, never a tenant's.

An ``attach`` with ``ephemeral`` makes the daemon create a pool of the client's
layout: a segment of up to 1 GiB and a Manager of up to 2**20 pages (~48 MiB of
the daemon's memory, ~0.1 s of its loop), each under a new name, with no
tenant's or process's quota on them. A tenant could so take the daemon's memory
a pool at a time, up to its session bound (896 pools, ~43 GiB, by default), and
gained nothing it may use: the segment is 0600 of the daemon's user. Now a
tenant's ephemeral attach is ``forbidden``, whatever its pools; the operator's
still works.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from curve_helpers import curve_tenants

from kvcore import Client
from kvcore.daemon_process import DaemonProcess
from kvcore.errors import Forbidden
from kvcore.layout import KVLayout

POOL = """
[[pools]]
name = "a"
num_layers = 1
num_kv_heads = 1
head_dim = 8
page_size = 4
dtype = "float16"
num_pages = 32
"""
LAYOUT = KVLayout(
    num_layers=1, num_kv_heads=1, head_dim=1, page_size=1, dtype="float16", num_pages=1 << 20
)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    if not zmq.has("curve"):
        pytest.skip("libzmq without CURVE")
    tenants = {  # alice: every pool, but a tenant; ops: every namespace too
        "alice": 'namespaces = ["alice"]',
        "ops": 'namespaces = ["*"]',
    }
    tmp = tmp_path_factory.mktemp("ephemeral")
    with curve_tenants(tmp, POOL, tenants, "--allow-ephemeral") as (tcp, server, keys):
        yield {"endpoint": tcp.endpoint, "server": server, **keys}


def _as(daemon: dict[str, object], who: str, pool: str, namespace: str) -> Client:
    return Client.connect(
        daemon["endpoint"],  # type: ignore[arg-type]
        pool=pool,
        namespace=namespace,
        layout=LAYOUT,
        ephemeral=True,
        map_memory=False,
        curve_server_key=daemon["server"],
        curve_keypair=daemon[who],
        timeout_s=10,
    )


@pytest.mark.parametrize("who, namespace", [("alice", "alice"), ("ops", "x")])
def test_a_tenant_may_not_create_an_ephemeral_pool(
    daemon: dict[str, object], who: str, namespace: str
) -> None:
    for i in range(3):  # each would have been a new pool of 2**20 pages
        with pytest.raises(Forbidden, match="ephemeral"):
            _as(daemon, who, f"{who}-{i}", namespace).close()


def test_the_operator_still_creates_ephemeral_pools(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path / 'd.sock'}"
    pool = ("--pool", "num_pages=4,num_layers=1")
    with (
        DaemonProcess("--endpoint", endpoint, *pool, "--allow-ephemeral") as daemon,
        Client.connect(
            daemon.endpoint, pool="mine", layout=LAYOUT, ephemeral=True, map_memory=False
        ) as client,
    ):
        client.allocate(1, [1, 2, 3])
