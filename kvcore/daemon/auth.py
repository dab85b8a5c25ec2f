"""Who may attach to what: a peer's credentials -> a :class:`Grant` (docs/security.md).

Credentials are what the transport proves, never what a request says: the
uid of an ipc:// peer (the kernel reports it for Unix sockets), the CURVE
public key of a tcp:// peer (checked by the ZAP handler below before the
connection is accepted). Rules, first match wins:

1. the daemon's own uid, or root, on ipc://: the operator; everything;
2. a ``[[tenants]]`` entry that lists the peer's uid or key: its namespaces
   and pools;
3. no tenants configured: an admitted CURVE key, or any peer of a tcp://
   endpoint served ``--insecure``, is the operator (a single-user daemon);
4. anyone else is refused (``forbidden``).

A grant fixes at attach which pools a session may attach to and which
namespaces it may name, and filters what ``stats`` shows. The pool-wide
views (``snapshot``, the event stream) need a grant of every namespace.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from kvcore_ipc.server import Peer
from zmq.auth.thread import ThreadAuthenticator

from kvcore.config import TenantConfig
from kvcore.errors import Forbidden

REQUEST_DOMAIN = "kvcore"
EVENTS_DOMAIN = "kvcore-events"


@dataclass(frozen=True, slots=True)
class Grant:
    """What one credential allows; ``None`` means every namespace / every pool."""

    tenant: str  # "" for the operator
    namespaces: frozenset[str] | None
    pools: frozenset[str] | None

    @property
    def everything(self) -> bool:
        """May see every namespace (snapshot, events, every session in stats)."""
        return self.namespaces is None

    def check_pool(self, pool: str) -> None:
        if self.pools is not None and pool not in self.pools:
            raise Forbidden(f"tenant {self.tenant!r} may not attach to pool {pool!r}")

    def check_namespace(self, namespace: str) -> None:
        if self.namespaces is not None and namespace not in self.namespaces:
            raise Forbidden(f"tenant {self.tenant!r} may not use namespace {namespace!r}")

    def sees(self, pool: str, namespace: str | None = None) -> bool:
        ok_pool = self.pools is None or pool in self.pools
        ok_ns = namespace is None or self.namespaces is None or namespace in self.namespaces
        return ok_pool and ok_ns


OPERATOR = Grant("", None, None)


class Authority:
    """The tenant table, and the ZAP handler that admits CURVE keys."""

    __slots__ = ("_by_key", "_by_uid", "_keys", "_open", "_zap", "uid")

    def __init__(self, tenants: list[TenantConfig], *, keys_dir: str = "") -> None:
        self.uid = os.getuid()
        self._by_uid: dict[int, Grant] = {}
        self._by_key: dict[str, Grant] = {}
        for tenant in tenants:
            namespaces = None if "*" in tenant.namespaces else frozenset(tenant.namespaces)
            grant = Grant(
                tenant.name, namespaces, frozenset(tenant.pools) if tenant.pools else None
            )
            self._by_uid.update(dict.fromkeys(tenant.uids, grant))
            self._by_key.update(dict.fromkeys(tenant.keys, grant))
        self._open = not tenants  # rule 3
        self._keys: set[str] = set(self._by_key)  # keys admitted by ZAP
        if keys_dir:
            self._keys |= {k.decode() for k in zmq.auth.load_certificates(keys_dir)}
        self._zap: ThreadAuthenticator | None = None

    def grant(self, peer: Peer) -> Grant:
        """The grant of ``peer``; Forbidden if its credentials allow nothing."""
        if peer.uid is not None:
            if peer.uid in (self.uid, 0):
                return OPERATOR
            grant = self._by_uid.get(peer.uid)
        elif peer.key is not None:
            grant = self._by_key.get(peer.key)
            if grant is None and self._open and peer.key in self._keys:
                return OPERATOR
        else:  # tcp:// without CURVE (--insecure)
            grant = OPERATOR if self._open else None
        if grant is None:
            raise Forbidden("these credentials may not use this daemon (docs/security.md)")
        return grant

    def local(self) -> Grant:
        """The grant of a caller in this process (no frame, no peer): the operator."""
        return OPERATOR

    def start_zap(self, context: zmq.Context[zmq.Socket[bytes]] | None = None) -> None:
        """Serve ZAP for CURVE sockets of this process: the request socket admits every
        known key; the events socket only keys that may see every namespace."""
        zap = ThreadAuthenticator(context or zmq.Context.instance())
        zap.start()
        zap.configure_curve_callback(REQUEST_DOMAIN, _Keys(self, events=False))
        zap.configure_curve_callback(EVENTS_DOMAIN, _Keys(self, events=True))
        self._zap = zap

    def stop_zap(self) -> None:
        if self._zap is not None:
            self._zap.stop()
            self._zap = None

    def admits(self, key: str, *, events: bool) -> bool:
        if key not in self._keys:
            return False
        grant = self._by_key.get(key, OPERATOR if self._open else None)
        return grant is not None and (grant.everything or not events)


@dataclass(frozen=True, slots=True)
class _Keys:
    """A pyzmq credentials provider: ``callback(domain, z85 key) -> allowed``."""

    authority: Authority
    events: bool

    def callback(self, domain: str, key: bytes) -> bool:
        return self.authority.admits(key.decode(), events=self.events)


def read_secret_key(path: str) -> bytes:
    """A z85 CURVE secret key from ``path``: 40 characters, or a ZeroMQ certificate
    (``kvcore keys`` writes them). PermissionError if others may read the file."""
    st = os.stat(path)
    if st.st_mode & 0o077:
        raise PermissionError(
            f"{path}: a secret key must be readable by its owner only (chmod 600 {path})"
        )
    raw = Path(path).read_bytes().strip()
    if len(raw) == 40:
        return raw
    _public, secret = zmq.auth.load_certificate(path)
    if secret is None:
        raise ValueError(f"{path} holds no secret key")
    return secret
