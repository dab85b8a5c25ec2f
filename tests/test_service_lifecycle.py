"""`kvcore serve` as a process: defaults, socket mode, clean stop, config, refusals."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvcore import Client
from kvcore.daemon_process import DaemonProcess
from kvcore.errors import Timeout


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["XDG_RUNTIME_DIR"] = str(tmp_path)
    env.pop("KVCORE_ENDPOINT", None)
    return env


TINY = ("--pool", "num_pages=4,num_layers=1")


def _serve(*args: str, timeout: float = 30, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``python -m kvcore.daemon ARGS``, run to its end (``kwargs``: subprocess.run's)."""
    command = [sys.executable, "-m", "kvcore.daemon", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)


def _shm_name(output: str) -> str:
    return output.split("(kvcore-")[1].split(")")[0]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_default_daemon_serves_and_stops_cleanly(
    tmp_path: Path, sig: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = _env(tmp_path)
    daemon = DaemonProcess(env=env).start()
    try:
        sock = tmp_path / "kvcore" / "kvcore.sock"
        assert daemon.endpoint == f"ipc://{sock}"
        assert stat.S_IMODE(sock.stat().st_mode) == 0o600
        assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700
        assert "pool 'default': cpu, 512 pages x 16 tokens" in daemon.output
        assert "256.0 MiB" in daemon.output
        shm = Path("/dev/shm") / f"kvcore-{_shm_name(daemon.output)}"
        assert shm.exists()
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # Client.connect() finds it too
        monkeypatch.delenv("KVCORE_ENDPOINT", raising=False)
        with Client.connect(map_memory=False) as client:
            assert client.layout.num_layers == 16 and client.layout.dtype == "bfloat16"
            assert client.stats().total_pages == 512
    finally:
        code = daemon.stop(sig)
    assert code == 0, daemon.output
    assert not sock.exists()
    assert not shm.exists()
    assert "pools unlinked, socket removed" in daemon.output


def test_tcp_needs_curve_or_insecure(tmp_path: Path) -> None:
    refused = _serve("--endpoint", "tcp://127.0.0.1:*", *TINY, env=_env(tmp_path))
    assert refused.returncode == 2 and "CURVE" in refused.stderr
    tcp = ("--endpoint", "tcp://127.0.0.1:*")
    with DaemonProcess(*tcp, "--insecure", *TINY, env=_env(tmp_path)) as daemon:
        assert daemon.endpoint.startswith("tcp://127.0.0.1:")
        with Client.connect(daemon.endpoint, map_memory=False) as client:
            assert client.stats().total_pages == 4


def test_tcp_with_curve_keys(tmp_path: Path) -> None:
    zmq = pytest.importorskip("zmq")
    if not zmq.has("curve"):
        pytest.skip("libzmq without CURVE")
    from kvcore.keys import create, load_keypair, load_public

    _server_pub, server_secret = create(tmp_path / "server", "daemon")
    _client_pub, client_secret = create(tmp_path / "clients", "engine")
    public = load_public(server_secret)
    curve = ("--curve-secret-key-file", str(server_secret))
    keys = ("--authorized-keys", str(tmp_path / "clients"))
    tcp = ("--endpoint", "tcp://127.0.0.1:*")
    with DaemonProcess(*tcp, *curve, *keys, *TINY, env=_env(tmp_path)) as daemon:
        with Client.connect(
            daemon.endpoint,
            map_memory=False,
            curve_server_key=public,
            curve_keypair=load_keypair(client_secret),
        ) as client:
            assert client.stats().total_pages == 4
        wrong, _ = zmq.curve_keypair()
        with pytest.raises(Timeout):
            Client.connect(daemon.endpoint, map_memory=False, curve_server_key=wrong, timeout_s=0.5)


def test_toml_config_and_flag_override(tmp_path: Path) -> None:
    config = tmp_path / "kvcore.toml"
    config.write_text(
        "lease_timeout_s = 3.5\n"
        '[[pools]]\nname = "small"\nnum_layers = 2\nnum_kv_heads = 2\nhead_dim = 32\n'
        'page_size = 8\ndtype = "float16"\nsize = "1MiB"\n'
        '[[pools]]\nname = "tiny"\nnum_layers = 1\nnum_pages = 3\n'
    )
    endpoint = f"ipc://{tmp_path / 'd.sock'}"
    with DaemonProcess(
        "--config", str(config), "--endpoint", endpoint, "--lease-timeout", "7", env=_env(tmp_path)
    ) as daemon:
        assert "lease 7 s" in daemon.output
        with Client.connect(endpoint, pool="small") as client:
            # 1 MiB / (2 layers * 2 * 8 tokens * 2 heads * 32 dim * 2 bytes) = 256 pages
            assert client.layout.num_pages == 256 and client.layout.page_size == 8
            assert client.kv_caches[1].shape == (256, 2, 8, 2, 32)
            assert {p.name for p in client.daemon_stats().pools} == {"small", "tiny"}


def test_bad_config_exits_with_a_message(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[[pools]]\nname = "x"\ndtype = "int3"\n')
    for args in (["--config", str(bad)], ["--pool", "size=12parsecs"], ["--pool", "bogus=1"]):
        done = _serve("--endpoint", f"ipc://{tmp_path}/x.sock", *args, env=_env(tmp_path))
        assert done.returncode == 2, done
        assert done.stderr.startswith("kvcore serve:"), done.stderr


def test_second_daemon_on_a_live_endpoint_is_refused_and_stale_socket_reused(
    tmp_path: Path,
) -> None:
    endpoint = f"ipc://{tmp_path / 'd.sock'}"
    args = ("--endpoint", endpoint, *TINY)
    with DaemonProcess(*args, env=_env(tmp_path)) as first:
        second = _serve(*args, env=_env(tmp_path))
        assert second.returncode == 1 and "already serves" in second.stderr
        first.stop(signal.SIGKILL)  # dies without cleaning up: the socket file stays
    assert (tmp_path / "d.sock").exists()
    with DaemonProcess(*args, env=_env(tmp_path)), Client.connect(endpoint, map_memory=False) as c:
        assert c.stats().total_pages == 4


def test_a_gone_daemon_fails_fast_and_says_how_to_start_one(tmp_path: Path) -> None:
    """No daemon (never started, or killed with its socket file left): calls fail in about
    a second, not after the 10 s timeout, and `kvcore stats` says the same."""
    missing = f"ipc://{tmp_path}/none.sock"
    start = time.monotonic()
    with pytest.raises(Timeout, match=r"no daemon answers on .* start one with `kvcore serve`"):
        Client.connect(missing, map_memory=False)
    assert time.monotonic() - start < 2.0
    stats = subprocess.run(
        [sys.executable, "-m", "kvcore.cli", "stats", "--endpoint", missing],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert stats.returncode == 1 and "start one with `kvcore serve`" in stats.stderr
    daemon = DaemonProcess.private("--pool", "num_layers=1,num_pages=8").start()
    try:
        client = Client.connect(daemon.endpoint, map_memory=False, heartbeat=False)
        daemon.stop(signal.SIGKILL)  # its socket file stays behind: connections are refused
        start = time.monotonic()
        with pytest.raises(Timeout, match="no daemon answers"):
            client.allocate(1, [1, 2, 3])
        assert time.monotonic() - start < 2.0
        client.close()
    finally:
        daemon.stop(signal.SIGKILL)
        (Path("/dev/shm") / f"kvcore-{_shm_name(daemon.output)}").unlink(missing_ok=True)


def test_a_missing_socket_directory_is_named(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/absent/kvcore.sock"
    refused = _serve("--endpoint", endpoint, timeout=60)
    assert refused.returncode == 2
    assert f"socket directory {tmp_path}/absent does not exist" in refused.stderr
    with pytest.raises(Timeout, match=r"does not exist.*start one with `kvcore serve`"):
        Client.connect(endpoint, map_memory=False)


def test_no_daemon_on_a_tcp_port_fails_fast() -> None:
    with socket.socket() as probe:  # a port nothing listens on once closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(Timeout, match=f"no daemon answers on tcp://127.0.0.1:{port}"):
        Client.connect(f"tcp://127.0.0.1:{port}", map_memory=False)
    assert time.monotonic() - start < 2.0
