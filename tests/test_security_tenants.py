"""The trust model (docs/security.md): a session's pools and namespaces are fixed at attach
by its credentials (CURVE key on tcp://, kernel-reported uid on ipc://); stats, snapshots
and events show a tenant only what its grant covers."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from curve_helpers import curve_tenants
from kvcore_ipc.events import EventSubscriber

from kvcore import Client, KeySpace
from kvcore.daemon_process import DaemonProcess
from kvcore.errors import Forbidden, KVCoreError

POOLS = """
[[pools]]
name = "a"
num_layers = 1
num_kv_heads = 1
head_dim = 8
page_size = 4
dtype = "float16"
num_pages = 32
[[pools]]
name = "b"
num_layers = 1
num_kv_heads = 1
head_dim = 8
page_size = 4
dtype = "float16"
num_pages = 32
"""


@pytest.fixture(scope="module")
def curve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    if not zmq.has("curve"):
        pytest.skip("libzmq without CURVE")
    tenants = {"alice": 'namespaces = ["alice"]\npools = ["a"]', "ops": ""}
    head = f'events = "tcp://127.0.0.1:*"\n{POOLS}'
    with curve_tenants(tmp_path_factory.mktemp("tenants"), head, tenants) as (daemon, server, keys):
        yield {"endpoint": daemon.endpoint, "server": server, **keys}


def _as(curve: dict[str, object], who: str, **kw: object) -> Client:
    return Client.connect(
        curve["endpoint"],
        map_memory=False,
        curve_server_key=curve["server"],
        curve_keypair=curve[who],
        **kw,
    )  # type: ignore[arg-type]


def test_a_tenant_gets_only_its_pools_and_namespaces(curve: dict[str, object]) -> None:
    with pytest.raises(Forbidden, match="pool 'b'"):
        _as(curve, "alice", pool="b", namespace="alice")
    with pytest.raises(Forbidden, match="namespace 'bob'"):
        _as(curve, "alice", pool="a", namespace="bob")
    with _as(curve, "ops", pool="a", namespace="bob") as bob:
        prompt = list(range(9))
        bob.allocate(1, prompt)
        bob.commit(1, prompt)
        bob.allocate(3, prompt)  # a hit: bob's row and busiest prefix in the stats
        with _as(curve, "alice", pool="a", namespace="alice") as alice:
            assert alice.lookup(prompt).num_cached_tokens == 0
            with pytest.raises(Forbidden):
                alice.lookup(
                    prompt, KeySpace(namespace="bob")
                )  # no reading another tenant's prefixes
            with pytest.raises(Forbidden):
                alice.allocate(2, prompt, KeySpace(namespace="bob"))  # nor poisoning them
            with pytest.raises(Forbidden):
                alice.snapshot()  # every namespace's keys
            seen = alice.daemon_stats()
            assert [p.name for p in seen.pools] == ["a"]
            assert {s.namespace for s in seen.sessions} == {"alice"}
            (a,) = seen.pools  # neither bob's hit figures nor his busiest prefix
            assert not a.namespaces and not a.busiest
            everything = bob.daemon_stats()
            assert {p.name for p in everything.pools} == {"a", "b"}
            assert {s.namespace for s in everything.sessions} == {"alice", "bob"}
            (a,) = [p for p in everything.pools if p.name == "a"]
            assert [r.namespace for r in a.namespaces] == ["bob"] and a.busiest[
                0
            ].namespace == "bob"
            assert bob.lookup(prompt, KeySpace(namespace="alice")).num_cached_tokens == 0  # ops may
            bob.check_integrity()


def test_only_a_grant_of_every_namespace_gets_the_events(curve: dict[str, object]) -> None:
    with _as(curve, "ops", pool="a") as ops:
        events = ops.attach_info.events
        subs = {
            who: EventSubscriber(
                events,
                curve_server_key=curve["server"],  # type: ignore[arg-type]
                curve_keypair=curve[who],
            )  # type: ignore[arg-type]
            for who in ("alice", "ops")
        }
        time.sleep(0.3)
        ops.allocate(5, list(range(100, 109)))
        ops.commit(5, list(range(100, 109)))
        assert subs["ops"].recv(3000) is not None
        assert subs["alice"].recv(300) is None
        for sub in subs.values():
            sub.close()


def _as_uid(uid: int, endpoint: str) -> dict[str, object]:
    """Run the checks in a forked child that switched to ``uid``; its findings."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no exception may escape
        result: dict[str, object] = {}
        try:
            os.setgid(uid)
            os.setuid(uid)
            try:
                with Client.connect(endpoint, pool="b", namespace="alice", map_memory=False):
                    result["pool_b"] = "ok"
            except KVCoreError as exc:
                result["pool_b"] = exc.code
            try:
                with Client.connect(endpoint, pool="a", namespace="alice") as c:
                    result["attach"] = "ok"
                    result["mapped"] = c.kv_caches[0].shape[0]
                    result["pools"] = [p.name for p in c.daemon_stats().pools]
                    try:
                        c.lookup([1, 2, 3, 4, 5], KeySpace(namespace="root-only"))
                        result["other_ns"] = "ok"
                    except KVCoreError as exc:
                        result["other_ns"] = exc.code
            except KVCoreError as exc:
                result["attach"] = exc.code
            segments = [e for e in os.listdir("/dev/shm") if e.startswith("kvcore-")]
            result["segments_readable"] = sum(os.access(f"/dev/shm/{e}", os.R_OK) for e in segments)
        except BaseException as exc:
            result["crash"] = repr(exc)
        os.write(write, json.dumps(result).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        found: dict[str, object] = json.loads(pipe.read() or "{}")
    os.waitpid(pid, 0)
    return found


def test_on_ipc_the_peers_uid_decides(tmp_path: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to run a client as another uid")
    import torch  # noqa: F401  (the child maps the pool; it cannot read root's site-packages)

    shared = Path(tempfile.mkdtemp(prefix="kvcore-tenants-"))  # /tmp/...: others can traverse
    try:
        shared.chmod(0o755)
        config = tmp_path / "kvcore.toml"
        pools = POOLS.replace('name = "a"\n', 'name = "a"\ngroup = "4242"\n')  # a's tenants map it
        config.write_text(
            f'socket_mode = 0o666\n{pools}[[tenants]]\nname = "alice"\n'
            f'uids = [4242]\nnamespaces = ["alice"]\npools = ["a"]\n'
        )
        endpoint = f"ipc://{shared / 'd.sock'}"
        with DaemonProcess("--config", str(config), "--endpoint", endpoint):
            alice = _as_uid(4242, endpoint)
            assert alice == {
                "pool_b": "forbidden",
                "attach": "ok",
                "mapped": 32,
                "pools": ["a"],
                "other_ns": "forbidden",
                "segments_readable": 1,
            }, alice
            stranger = _as_uid(4243, endpoint)
            assert stranger == {
                "pool_b": "forbidden",
                "attach": "forbidden",
                "segments_readable": 0,
            }, stranger
    finally:
        shutil.rmtree(shared, ignore_errors=True)
