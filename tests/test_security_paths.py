"""Defect 1: a runtime directory or socket someone else made is refused, by daemon and client.

The default directory is $XDG_RUNTIME_DIR/kvcore (here: a temporary directory)
or /tmp/kvcore-$UID; the same check guards both. An attacker's directory is
simulated by its mode, a symlink, or (as root) its owner.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvcore import Client
from kvcore.daemon_process import DaemonProcess
from kvcore.errors import UntrustedEndpoint
from kvcore.paths import check_runtime_dir

POOL = ("--pool", "num_pages=4,num_layers=1")
OTHER_UID = 4242  # a uid no one on this machine uses


def _env(base: Path) -> dict[str, str]:
    env = dict(os.environ, XDG_RUNTIME_DIR=str(base))
    env.pop("KVCORE_ENDPOINT", None)
    return env


def _serve(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvcore.daemon", *POOL, *args],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )


def _hijack(base: Path, how: str) -> Path:
    """Make ``base/kvcore`` the way an attacker would have left it."""
    run = base / "kvcore"
    if how == "mode":
        run.mkdir()
        run.chmod(0o777)
    elif how == "symlink":
        (base / "elsewhere").mkdir(mode=0o700)
        run.symlink_to(base / "elsewhere")
    else:
        if os.getuid() != 0:
            pytest.skip("needs root to chown a directory to another uid")
        run.mkdir(mode=0o700)
        os.chown(run, OTHER_UID, OTHER_UID)
    return run


@pytest.mark.parametrize("how", ["mode", "symlink", "owner"])
def test_daemon_and_client_refuse_a_runtime_dir_they_do_not_own(
    tmp_path: Path, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _hijack(tmp_path, how)
    done = _serve(_env(tmp_path))
    assert done.returncode == 2, done
    assert f"runtime directory {run}" in done.stderr and "Remove it" in done.stderr
    assert (
        not (run / "kvcore.sock").exists() and not (tmp_path / "elsewhere" / "kvcore.sock").exists()
    )
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("KVCORE_ENDPOINT", raising=False)
    with pytest.raises(UntrustedEndpoint, match="another user may have made it"):
        Client.connect(map_memory=False, timeout_s=0.5)
    with pytest.raises(UntrustedEndpoint):
        check_runtime_dir(run)


def test_an_explicit_endpoint_in_a_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # not sticky: anyone could replace the socket
    endpoint = f"ipc://{shared / 'd.sock'}"
    done = _serve(_env(tmp_path), "--endpoint", endpoint)
    assert done.returncode == 2 and "writable by others" in done.stderr, done
    with pytest.raises(UntrustedEndpoint, match="writable by others"):
        Client.connect(endpoint, map_memory=False, timeout_s=0.5)


def test_a_lock_file_that_is_a_symlink_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.write_text("keep me")
    (tmp_path / "d.sock.lock").symlink_to(target)
    done = _serve(_env(tmp_path), "--endpoint", f"ipc://{tmp_path / 'd.sock'}")
    assert done.returncode == 2, done
    assert target.read_text() == "keep me"


def test_client_refuses_a_socket_of_another_user(tmp_path: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to chown a socket to another uid")
    path = tmp_path / "fake.sock"
    fake = socket.socket(socket.AF_UNIX)
    fake.bind(str(path))
    os.chown(path, OTHER_UID, OTHER_UID)  # a daemon run by someone else, bound first
    try:
        with pytest.raises(UntrustedEndpoint, match=f"owned by uid {OTHER_UID}"):
            Client.connect(f"ipc://{path}", map_memory=False, timeout_s=0.5)
        # Trusting that uid explicitly lets it through to the (silent) fake: a timeout.
        from kvcore.errors import Timeout

        with pytest.raises(Timeout):
            Client.connect(
                f"ipc://{path}", map_memory=False, timeout_s=0.3, trusted_uids=(OTHER_UID,)
            )
    finally:
        fake.close()


def test_a_good_runtime_dir_still_works(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with DaemonProcess(*POOL, env=_env(tmp_path)):
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
        monkeypatch.delenv("KVCORE_ENDPOINT", raising=False)
        with Client.connect(map_memory=False) as client:
            assert client.stats().total_pages == 4
