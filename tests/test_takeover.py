"""``kvcore serve --takeover`` (issue 40): a new daemon starts in place of the running one,
which stops cleanly; the new one re-adopts the kept pool, so engines attach once and hit
what was committed before.

Real daemons on one endpoint, a real client process under load (tests/takeover_client.py)
that writes a marker into each page it computes and checks the marker of each page it
hits: across the takeover it fails no round, attaches again exactly once, and its first
round after it hits. The old daemon refuses what it read but did not serve
(``stale_epoch``), and a request it took with it ends in StaleEpoch as soon as the client's
channel finds another daemon on the path. The service manager hears READY, MAINPID and
STOPPING (systemd's notify protocol, on a real datagram socket).
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from kvcore_ipc import messages as msg
from kvcore_ipc.channel import DealerChannel, Replaced
from kvcore_ipc.server import EndpointLock
from kvcore_ipc.shm import sweep

from kvcore import Client
from kvcore.daemon.daemon import segment_prefix
from kvcore.daemon_process import DaemonProcess
from kvcore.errors import StaleEpoch

POOL = "name=default,num_layers=2,num_kv_heads=1,head_dim=8,page_size=4,dtype=float32,num_pages=64"
CLIENT = Path(__file__).with_name("takeover_client.py")


@pytest.fixture
def endpoint(tmp_path: Path) -> Iterator[str]:
    endpoint = f"ipc://{tmp_path / 'kvcore.sock'}"
    yield endpoint
    with DaemonProcess("--endpoint", endpoint, "--pool", POOL, "--no-restore"):
        pass  # cold: the manifest goes, the sweep unlinks what the test's daemons kept
    assert not sweep(segment_prefix(endpoint))


def serve(endpoint: str, *flags: str, env: dict[str, str] | None = None) -> DaemonProcess:
    return DaemonProcess(
        "--endpoint", endpoint, "--pool", POOL, "--restore", *flags, env=env
    ).start()


def test_a_takeover_under_load_fails_no_request_and_reattaches_once(endpoint: str) -> None:
    old = serve(endpoint)
    load = subprocess.Popen(
        [sys.executable, str(CLIENT), endpoint, "6"], stdout=subprocess.PIPE, text=True
    )
    new = None
    try:
        assert load.stdout is not None and load.stdout.readline() == "ready\n"
        time.sleep(1.0)  # the client commits its 8 prompts, then hits them
        assert EndpointLock.holder(endpoint) == old.proc.pid  # type: ignore[union-attr]
        new = serve(endpoint, "--takeover")
        assert old.proc.wait(10) == 0  # type: ignore[union-attr]
        assert "kept for the next daemon" in old.output, old.output
        assert f"took over from pid {old.proc.pid}" in new.output, new.output  # type: ignore[union-attr]
        assert "re-adopted" in new.output and "(clean stop;" in new.output, new.output
        out, _ = load.communicate(timeout=30)
        report = json.loads(out)
    finally:
        load.kill()
        if new is not None:
            new.stop()
        old.stop()
    assert report["errors"] == [] and report["wrong"] == 0, report
    assert report["reattaches"] == 1, report  # engines see one re-attach
    assert report["hits_after"] and report["hits_after"][0] > 0, report  # hit at once
    assert report["rounds"] > 50, report


def test_a_request_the_stopped_daemon_took_is_stale_as_soon_as_another_listens(
    endpoint: str,
) -> None:
    old = serve(endpoint)
    channel = DealerChannel(endpoint, timeout_s=20)
    client = Client.connect(endpoint)
    try:
        os.kill(old.proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]
        request = msg.Request(7, msg.GetStats(), client.session, client.epoch)
        channel.send(msgspec.msgpack.encode(request))  # read by no one
        client_call = time.monotonic()
        os.kill(old.proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
        old.stop()
        new = serve(endpoint)
        try:
            with pytest.raises(Replaced):
                channel.recv()
            with pytest.raises(StaleEpoch):
                client.heartbeat()  # answered by the new daemon
            assert time.monotonic() - client_call < 20
            client.reconnect()
            client.heartbeat()
        finally:
            new.stop()
    finally:
        channel.close()
        client.close()


def test_the_service_manager_hears_ready_mainpid_and_stopping(
    endpoint: str, tmp_path: Path
) -> None:
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as manager:
        manager.bind(path)
        manager.settimeout(30)
        env = {**os.environ, "NOTIFY_SOCKET": path}
        old = serve(endpoint, env=env)
        assert manager.recv(4096) == b"READY=1"
        new = serve(endpoint, "--takeover", env=env)
        heard = [manager.recv(4096) for _ in range(3)]
        new_pid = new.proc.pid  # type: ignore[union-attr]
        # the new main pid comes before the old daemon stops, READY once the new one listens
        assert heard[0] == f"MAINPID={new_pid}".encode()
        assert sorted(heard[1:]) == [b"READY=1", b"STOPPING=1"]
        assert old.proc.wait(10) == 0  # type: ignore[union-attr]
        new.stop()
        assert manager.recv(4096) == b"STOPPING=1"


def test_a_takeover_with_no_daemon_starts_as_usual(endpoint: str) -> None:
    daemon = serve(endpoint, "--takeover")
    try:
        assert "--takeover: no daemon held the endpoint" in daemon.output
    finally:
        daemon.stop()


def test_a_lock_that_names_no_pid_is_not_taken_over(tmp_path: Path) -> None:
    """An older daemon's lock (held, no pid in it): nothing to signal, so a clear refusal."""
    lock = os.open(tmp_path / "kvcore.sock.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        daemon = DaemonProcess(
            "--endpoint", f"ipc://{tmp_path / 'kvcore.sock'}", "--pool", POOL, "--takeover"
        )
        with pytest.raises(RuntimeError, match="names no pid"):
            daemon.start()
        assert daemon.stop() == 1  # the endpoint is taken
    finally:
        os.close(lock)


def test_a_takeover_of_a_tcp_endpoint_is_refused_saying_why() -> None:
    daemon = DaemonProcess(
        "--endpoint", "tcp://127.0.0.1:0", "--insecure", "--pool", POOL, "--takeover"
    )
    with pytest.raises(RuntimeError, match="--takeover finds the running daemon"):
        daemon.start()
