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

import errno
import os
import stat
from dataclasses import dataclass

import zmq
import zmq.auth
from kvcore_ipc.server import Peer
from zmq.auth.thread import ThreadAuthenticator

from kvcore.config import TenantConfig
from kvcore.errors import BadRequest, Forbidden, UntrustedEndpoint
from kvcore.paths import read_private_file
from kvcore.tiers.directory import check_trusted_fd, open_trusted_dir

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
            self._keys |= load_authorized_keys(keys_dir)
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
    (``kvcore keys`` writes them). BadRequest unless the file is this user's (or root's),
    not a symlink, readable by its owner only (kvcore.paths.read_private_file): whoever
    wrote it could pose as the daemon to its clients."""
    raw = read_private_file(path, "CURVE secret key file").strip()
    if len(raw) == 40:
        return raw
    secret = None
    for line in raw.splitlines():  # zmq.auth.load_certificate's format, parsed from the bytes read
        line = line.strip()
        if line.startswith(b"secret-key"):
            secret = line.split(b"=", 1)[1].strip(b" \t'\"")
    if secret is None or len(secret) != 40:
        raise BadRequest(f"CURVE secret key file {path!r} holds no secret key")
    return secret


def load_authorized_keys(directory: str) -> set[str]:
    """The z85 public keys of the ``*.key`` files in ``directory``, which only the daemon's
    user (or root) may have written: a key planted there would attach with the grant
    given to keys. UntrustedEndpoint, naming the path, unless the directory, every
    directory above it as the path resolves (unless sticky, like /tmp: nobody else can
    rename what is below it), and each key file belong to the daemon's uid or root, none
    is a symlink, and none is writable by group or others. The directory is walked and
    opened once by descriptor (kvcore.tiers.directory) and each key is read through it,
    so what was checked is what is read."""
    try:
        fd = open_trusted_dir(directory, "authorized keys directory")
    except BadRequest as exc:
        raise UntrustedEndpoint(f"{exc}: another user could plant a client key") from None
    try:
        names = sorted(name for name in os.listdir(fd) if name.endswith(".key"))
        return {_read_public_key(fd, os.path.join(directory, name), name) for name in names}
    finally:
        os.close(fd)


def _read_public_key(dir_fd: int, shown: str, name: str) -> str:
    """The public key of the key file ``name`` in the open directory ``dir_fd``, opened
    without following a link and checked on its descriptor."""
    try:
        fd = os.open(name, _OPEN_KEY, dir_fd=dir_fd)
    except OSError as exc:
        why = "is a symlink" if exc.errno == errno.ELOOP else exc.strerror
        raise UntrustedEndpoint(f"authorized keys: {shown} {why}") from None
    try:
        try:
            check_trusted_fd(fd, shown, "key file")
        except BadRequest as exc:
            raise UntrustedEndpoint(
                f"authorized keys: {exc}: another user could plant it"
            ) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UntrustedEndpoint(f"authorized keys: {shown} is not a regular file")
        raw = os.read(fd, _MAX_KEY_BYTES)
    finally:
        os.close(fd)
    for line in raw.splitlines():  # zmq.auth.load_certificate's format
        line = line.strip()
        if line.startswith(b"public-key"):
            return line.split(b"=", 1)[1].strip(b" \t'\"").decode()
    raise ValueError(f"No public key found in {shown}")


_OPEN_KEY = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_MAX_KEY_BYTES = 4096
