"""A daemon on tcp:// with CURVE whose ``[[tenants]]`` are named by fresh key pairs:
the set-up of the trust tests that need tenants told apart by their keys."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from kvcore.daemon_process import DaemonProcess
from kvcore.keys import create, load_keypair, load_public


@contextlib.contextmanager
def curve_tenants(
    tmp: Path, head: str, tenants: dict[str, str], *args: str
) -> Iterator[tuple[DaemonProcess, bytes, dict[str, tuple[bytes, bytes]]]]:
    """A daemon whose config is ``head`` (TOML) then one ``[[tenants]]`` entry per name
    of ``tenants`` (its key, then the entry's other TOML lines), started with ``args``;
    yields (daemon, the server's public key, each tenant's key pair)."""
    _, server = create(tmp, "daemon")
    keypairs: dict[str, tuple[bytes, bytes]] = {}
    entries = []
    for name, lines in tenants.items():
        _, secret = create(tmp, name)
        keypairs[name] = load_keypair(secret)
        entry = f'[[tenants]]\nname = "{name}"\nkeys = ["{keypairs[name][0].decode()}"]\n'
        entries.append(entry + (f"{lines}\n" if lines else ""))
    config = tmp / "kvcore.toml"
    config.write_text(head + "".join(entries))
    endpoint = ("--endpoint", "tcp://127.0.0.1:*", "--curve-secret-key-file", str(server))
    with DaemonProcess("--config", str(config), *endpoint, *args) as daemon:
        yield daemon, load_public(server), keypairs
