"""Event sockets keep the request socket's trust model (issue 18, point 2).

Stored events carry token ids and the replay socket returns every buffered batch,
so (a) a plain tcp:// events endpoint, (c) a tcp:// replay endpoint, are refused
unless the operator says ``--insecure``; (b) the vLLM-format PUB and replay sockets
on ipc:// are the daemon user's alone (0600 whatever the umask), their paths are
checked like the request socket's and locked, so no second daemon takes them.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kvcore.config import ServiceConfig
from kvcore.daemon_process import DaemonProcess
from kvcore.errors import BadRequest

POOL = ("--pool", "num_pages=4,num_layers=1")


def _serve(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    endpoint = f"ipc://{tmp_path / 'd.sock'}"
    return subprocess.run(
        [sys.executable, "-m", "kvcore.daemon", "--endpoint", endpoint, *POOL, *args],
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.mark.parametrize(
    "settings",
    [
        {"events": "tcp://127.0.0.1:*"},  # beside tenants or not: token ids for anyone
        {"events": "tcp://127.0.0.1:*", "events_format": "vllm"},
        {  # vLLM's subscribers speak no CURVE: plain even beside a CURVE daemon
            "events": "tcp://127.0.0.1:*",
            "events_format": "vllm",
            "curve_secret_key_file": "k",
        },
        {
            "events": "ipc:///tmp/x.sock",
            "events_format": "vllm",
            "events_replay": "tcp://127.0.0.1:*",
            "curve_secret_key_file": "k",
        },
    ],
)
def test_a_plain_tcp_event_socket_is_refused_without_insecure(settings: dict[str, str]) -> None:
    with pytest.raises(BadRequest, match="plain tcp:// event socket"):
        ServiceConfig(**settings).validate()  # type: ignore[arg-type]
    ServiceConfig(**settings, insecure=True).validate()  # type: ignore[arg-type]


def test_curve_events_on_tcp_need_no_opt_out() -> None:
    ServiceConfig(events="tcp://127.0.0.1:*", curve_secret_key_file="k").validate()


def test_the_daemon_refuses_plain_tcp_events_by_name(tmp_path: Path) -> None:
    done = _serve(tmp_path, "--events", "tcp://127.0.0.1:0")
    assert done.returncode == 2 and "plain tcp:// event socket" in done.stderr, done


def test_vllm_event_and_replay_sockets_are_private_and_locked(tmp_path: Path) -> None:
    events, replay = tmp_path / "ev.sock", tmp_path / "replay.sock"
    args = ("--events", f"ipc://{events}", "--events-format", "vllm")
    args += ("--events-replay", f"ipc://{replay}", *POOL)
    old = os.umask(0)  # the daemon inherits umask 000: its sockets must not
    try:
        daemon = DaemonProcess("--endpoint", f"ipc://{tmp_path / 'a.sock'}", *args)
    finally:
        os.umask(old)
    with daemon:
        for path in (events, replay):
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
        other = ("--events", f"ipc://{tmp_path / 'ev2.sock'}", *args[2:])
        with pytest.raises(RuntimeError, match="already serves"):  # the replay path is locked
            DaemonProcess("--endpoint", f"ipc://{tmp_path / 'b.sock'}", *other).start()
    assert not replay.exists() and not events.exists()


def test_a_replay_path_in_a_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # not sticky: anyone could replace the socket
    done = _serve(
        tmp_path,
        "--events",
        f"ipc://{tmp_path / 'ev.sock'}",
        "--events-format",
        "vllm",
        "--events-replay",
        f"ipc://{shared / 'replay.sock'}",
    )
    assert done.returncode == 2 and "writable by others" in done.stderr, done
