"""Defect 5: tcp:// admits only listed client keys; the event socket is as closed as the
request socket; an exposed secret key and --insecure are called out."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq
from kvcore_ipc.events import EventSubscriber

from kvcore import Client
from kvcore.daemon_process import DaemonProcess
from kvcore.errors import Timeout
from kvcore.keys import create, load_keypair, load_public

POOL = ("--pool", "num_pages=8,num_layers=1,num_kv_heads=1,head_dim=8,page_size=4")

if not zmq.has("curve"):
    pytest.skip("libzmq without CURVE", allow_module_level=True)


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvcore.daemon", *POOL, *args],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_kvcore_keys_writes_a_private_secret(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvcore.cli", "keys", str(tmp_path / "k"), "me"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done
    secret = tmp_path / "k" / "me.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    public, _ = load_keypair(secret)
    assert load_public(tmp_path / "k" / "me.key") == public and public.decode() in done.stdout


def test_only_authorized_client_keys_attach_and_subscribe(tmp_path: Path) -> None:
    _, server_secret = create(tmp_path / "server", "daemon")
    _, engine_secret = create(tmp_path / "clients", "engine")
    _, stranger_secret = create(tmp_path / "strangers", "stranger")
    server = load_public(server_secret)
    with DaemonProcess(
        "--endpoint",
        "tcp://127.0.0.1:*",
        "--events",
        "tcp://127.0.0.1:*",
        "--curve-secret-key-file",
        str(server_secret),
        "--authorized-keys",
        str(tmp_path / "clients"),
        *POOL,
    ) as daemon:
        engine = Client.connect(
            daemon.endpoint,
            map_memory=False,
            curve_server_key=server,
            curve_keypair=load_keypair(engine_secret),
        )
        with pytest.raises(Timeout):  # a valid key pair that is not listed: no handshake
            Client.connect(
                daemon.endpoint,
                map_memory=False,
                curve_server_key=server,
                curve_keypair=load_keypair(stranger_secret),
                timeout_s=0.5,
            )
        events = engine.attach_info.events
        assert events.startswith("tcp://")
        listed = EventSubscriber(
            events, curve_server_key=server, curve_keypair=load_keypair(engine_secret)
        )
        stranger = EventSubscriber(
            events, curve_server_key=server, curve_keypair=load_keypair(stranger_secret)
        )
        plain = EventSubscriber(events)
        time.sleep(0.3)  # subscriptions travel
        engine.allocate(1, list(range(9)))
        engine.commit(1, list(range(9)))
        got = listed.recv(3000)
        assert got is not None and len(got.events) == 2
        assert stranger.recv(300) is None and plain.recv(300) is None
        for sub in (listed, stranger, plain):
            sub.close()
        engine.close()


def test_curve_without_client_keys_or_with_an_exposed_secret_is_refused(tmp_path: Path) -> None:
    _, secret = create(tmp_path / "server", "daemon")
    done = _serve("--endpoint", "tcp://127.0.0.1:*", "--curve-secret-key-file", str(secret))
    assert done.returncode == 2 and "--authorized-keys" in done.stderr, done
    create(tmp_path / "clients", "engine")
    os.chmod(secret, 0o644)
    done = _serve(
        "--endpoint",
        "tcp://127.0.0.1:*",
        "--curve-secret-key-file",
        str(secret),
        "--authorized-keys",
        str(tmp_path / "clients"),
    )
    assert done.returncode == 2 and "readable by its owner only" in done.stderr, done


def test_insecure_warns(tmp_path: Path) -> None:
    with DaemonProcess("--endpoint", "tcp://127.0.0.1:*", "--insecure", *POOL) as daemon:
        assert "WARNING: --insecure" in daemon.output


def test_the_ipc_event_socket_is_private_whatever_the_umask(tmp_path: Path) -> None:
    endpoint, events = tmp_path / "d.sock", tmp_path / "ev.sock"
    proc = subprocess.Popen(
        [
            "sh",
            "-c",
            f'umask 000; exec "{sys.executable}" -m kvcore.daemon --endpoint '
            f"ipc://{endpoint} --events ipc://{events} --pool num_pages=4,num_layers=1",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("  events:"):
                break
        assert stat.S_IMODE(events.stat().st_mode) == 0o600
        assert stat.S_IMODE(endpoint.stat().st_mode) == 0o600
    finally:
        proc.terminate()
        proc.wait(30)
