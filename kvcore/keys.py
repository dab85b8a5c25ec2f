"""``kvcore keys``: CURVE key pairs for tcp:// daemons and their clients.

``kvcore keys DIR NAME`` writes ``DIR/NAME.key`` (the public key, shareable) and
``DIR/NAME.key_secret`` (the key pair, mode 0600) in ZeroMQ's certificate
format, as ``zmq.auth.create_certificates`` does. A daemon serves with
``--curve-secret-key-file DIR/NAME.key_secret`` and admits the clients whose
``.key`` files are in its ``--authorized-keys`` directory; a client connects
with ``curve_server_key`` (the daemon's public key) and ``curve_keypair``
(:func:`load_keypair` of its own ``.key_secret``). docs/security.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="where to write NAME.key and NAME.key_secret")
    parser.add_argument("name", help="the key pair's name (e.g. the daemon's or a tenant's)")


def create(directory: str | Path, name: str) -> tuple[Path, Path]:
    """Write a new key pair; (public file, secret file). FileExistsError if either exists."""
    import zmq.auth

    directory = Path(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    public, secret = directory / f"{name}.key", directory / f"{name}.key_secret"
    for path in (public, secret):
        if path.exists():
            raise FileExistsError(f"{path} exists: choose another name or remove it")
    old = os.umask(0o077)
    try:
        zmq.auth.create_certificates(str(directory), name)
    finally:
        os.umask(old)
    os.chmod(secret, 0o600)
    os.chmod(public, 0o644)
    return public, secret


def load_keypair(secret_file: str | Path) -> tuple[bytes, bytes]:
    """(public, secret) z85 keys from a ``.key_secret`` file."""
    import zmq.auth

    public, secret = zmq.auth.load_certificate(str(Path(secret_file).expanduser()))
    if secret is None:
        raise ValueError(f"{secret_file} holds no secret key")
    return public, secret


def load_public(key_file: str | Path) -> bytes:
    """The z85 public key of a ``.key`` (or ``.key_secret``) file."""
    import zmq.auth

    public, _secret = zmq.auth.load_certificate(str(Path(key_file).expanduser()))
    return public


def main(args: argparse.Namespace) -> int:
    try:
        public, secret = create(args.directory, args.name)
    except OSError as exc:
        print(f"kvcore keys: {exc}", file=sys.stderr)
        return 1
    print(
        f"public key: {public} (give it out: a daemon's --authorized-keys directory, "
        f"or its clients' curve_server_key)"
    )
    print(
        f"secret key: {secret} (mode 0600; keep it: --curve-secret-key-file, or "
        f"kvcore.keys.load_keypair for a client)"
    )
    print(f"  {load_public(public).decode()}")
    return 0
