"""The daemon's secret files are its user's alone, as docs/security.md's table says.

The CURVE secret key and the metrics token were checked by mode only, through
``os.stat`` (which follows a symlink) and then read again by path: a file of
another user, mode 0600, was accepted, so that user knew the daemon's CURVE
secret (and could pose as the daemon to its clients) or the bearer token of its
metrics. Each file is now read once, by descriptor (never through a symlink),
and refused unless it is a regular file of the daemon's user or root with no
group or other bits, like the tier secret (kvcore.tiers.secret).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from zmq.auth import create_certificates

from kvcore.daemon.auth import read_secret_key
from kvcore.daemon.metrics_http import read_token
from kvcore.errors import BadRequest

OTHER_UID = 65534  # nobody
POOL = ("--pool", "num_pages=4,num_layers=1")
TOKEN = "t0ken-" + "x" * 26
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")


def _secret_key(tmp_path: Path) -> Path:
    _, secret = create_certificates(str(tmp_path), "daemon")
    os.chmod(secret, 0o600)  # as `kvcore keys` writes it
    return Path(secret)


def _token(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return path


def test_secret_files_are_read_as_before(tmp_path: Path) -> None:
    assert len(read_secret_key(str(_secret_key(tmp_path)))) == 40
    assert read_token(str(_token(tmp_path))) == TOKEN


@pytest.mark.parametrize("make", [_secret_key, _token])
def test_a_secret_file_reached_through_a_symlink_is_refused(tmp_path: Path, make: object) -> None:
    target = make(tmp_path)  # type: ignore[operator]
    link = tmp_path / "link"
    link.symlink_to(target)
    read = read_secret_key if make is _secret_key else read_token
    with pytest.raises(BadRequest, match="symlink"):
        read(str(link))


@needs_root
@pytest.mark.parametrize("make", [_secret_key, _token])
def test_a_secret_file_of_another_user_is_refused(tmp_path: Path, make: object) -> None:
    path = make(tmp_path)  # type: ignore[operator]
    os.chown(path, OTHER_UID, OTHER_UID)  # mode 0600, but that user wrote (and knows) it
    read = read_secret_key if make is _secret_key else read_token
    with pytest.raises(BadRequest, match=f"owned by uid {OTHER_UID}"):
        read(str(path))


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "token"
    os.mkfifo(fifo, 0o600)  # opened plainly, a FIFO blocks the daemon's start for good
    errors: list[BaseException] = []

    def read() -> None:
        try:
            read_token(str(fifo))
        except BaseException as exc:
            errors.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(5)
    blocked = reader.is_alive()
    if blocked:  # let it go: a writer's open unblocks it
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(5)
    assert not blocked, "read_token waited on a FIFO for a writer"
    assert errors and isinstance(errors[0], BadRequest), errors
    assert "not a regular file" in str(errors[0])


@needs_root
def test_the_daemon_refuses_a_metrics_token_another_user_wrote(tmp_path: Path) -> None:
    token = _token(tmp_path)
    os.chown(token, OTHER_UID, OTHER_UID)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvcore.daemon",
            "--endpoint",
            f"ipc://{tmp_path / 'd.sock'}",
            *POOL,
            "--metrics-port",
            "0",
            "--metrics-token-file",
            str(token),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2 and f"owned by uid {OTHER_UID}" in done.stderr, done
