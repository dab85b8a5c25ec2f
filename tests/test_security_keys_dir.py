"""The authorized-keys directory is trusted only if no one else could write it
(issue 18, point 3): a key another user plants there would attach, after a restart,
with the grant given to keys. The directory, its ancestors (unless sticky) and every
key file must be the daemon user's or root's, not symlinks, not writable by others.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import zmq

from kvcore.daemon.auth import Authority
from kvcore.errors import UntrustedEndpoint
from kvcore.keys import create, load_public

OTHER_UID = 4242  # a uid no one on this machine uses


def _keys(tmp_path: Path) -> Path:
    clients = tmp_path / "clients"
    create(clients, "engine")
    clients.chmod(0o700)
    return clients


def _group_writable(clients: Path) -> None:
    clients.chmod(0o770)


def _planted_symlink(clients: Path) -> None:
    elsewhere = clients.parent / "elsewhere"
    create(elsewhere, "intruder")
    (clients / "intruder.key").symlink_to(elsewhere / "intruder.key")


def _writable_key(clients: Path) -> None:
    (clients / "engine.key").chmod(0o666)


def _open_parent(clients: Path) -> None:
    clients.parent.chmod(0o777)  # not sticky: anyone could swap the directory


def _foreign_owner(clients: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to give a directory to another uid")
    os.chown(clients, OTHER_UID, OTHER_UID)


@pytest.mark.parametrize(
    "spoil", [_group_writable, _planted_symlink, _writable_key, _open_parent, _foreign_owner]
)
def test_a_keys_directory_others_could_write_is_refused(
    tmp_path: Path, spoil: Callable[[Path], None]
) -> None:
    if not zmq.has("curve"):
        pytest.skip("libzmq without CURVE")
    clients = _keys(tmp_path / "base")
    spoil(clients)
    with pytest.raises(UntrustedEndpoint, match="authorized keys"):
        Authority([], keys_dir=str(clients))


def test_a_private_keys_directory_admits_its_keys(tmp_path: Path) -> None:
    if not zmq.has("curve"):
        pytest.skip("libzmq without CURVE")
    clients = _keys(tmp_path)
    authority = Authority([], keys_dir=str(clients))
    public = load_public(clients / "engine.key").decode()
    assert authority.admits(public, events=False)


def test_the_daemon_refuses_to_start_on_an_open_keys_directory(tmp_path: Path) -> None:
    if not zmq.has("curve"):
        pytest.skip("libzmq without CURVE")
    _, secret = create(tmp_path / "server", "daemon")
    clients = _keys(tmp_path)
    clients.chmod(0o777)
    serve = [sys.executable, "-m", "kvcore.daemon", "--pool", "num_pages=4,num_layers=1"]
    keys = ["--curve-secret-key-file", str(secret), "--authorized-keys", str(clients)]
    done = subprocess.run(
        [*serve, "--endpoint", "tcp://127.0.0.1:0", *keys],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2 and "writable by others" in done.stderr, done


def test_a_keys_directory_reached_through_another_users_directory_is_refused(
    tmp_path: Path,
) -> None:
    """The path is walked as it resolves: a symlinked parent that leads through a
    directory of another user (who can rename what is in it, and so swap the keys
    directory for one of theirs) is refused, not only the link's own target."""
    if not zmq.has("curve"):
        pytest.skip("libzmq without CURVE")
    if os.getuid() != 0:
        pytest.skip("needs root to give a directory to another uid")
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    clients = _keys(home / "sub")  # the daemon's own, inside another user's directory
    (home / "sub").chmod(0o755)
    os.chown(home, OTHER_UID, OTHER_UID)
    link = tmp_path / "link"
    link.symlink_to(home / "sub")
    with pytest.raises(UntrustedEndpoint, match=f"owned by uid {OTHER_UID}"):
        Authority([], keys_dir=str(link / clients.name))
    with pytest.raises(UntrustedEndpoint, match=f"owned by uid {OTHER_UID}"):
        Authority([], keys_dir=str(clients))


def test_a_key_file_is_read_as_it_was_checked(tmp_path: Path) -> None:
    """A key file is a regular file opened without following links, and a FIFO
    among the keys never blocks the start."""
    if not zmq.has("curve"):
        pytest.skip("libzmq without CURVE")
    clients = _keys(tmp_path)
    os.mkfifo(clients / "stuck.key", 0o600)
    with pytest.raises(UntrustedEndpoint, match="not a regular file"):
        Authority([], keys_dir=str(clients))
