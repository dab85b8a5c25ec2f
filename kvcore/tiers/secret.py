"""The secret the daemons of one deployment share, and the keys it derives.

A secret lives in a file (``TierConfig.secret_file``; a second one,
``previous_secret_file``, is also accepted on read during a rotation,
docs/tiers.md). The file must be a regular file (not a symlink) owned by the
daemon's user or root, with no group or other permission bits (like a CURVE
secret key file), holding at least 32 bytes once surrounding whitespace is
stripped (``head -c 32 /dev/urandom | base64 > tier.secret``). Anything else
is :class:`~kvcore.errors.BadRequest` at start.

Everything is HMAC-SHA256 (RFC 2104) under keys derived from the secret, one
per purpose, so that no output of one use is ever valid in another::

    mac key     HMAC(secret, "kvcore/tier/mac/v1")       MACs entries (kvcore.tiers.keyed)
    name key    HMAC(secret, "kvcore/tier/name/v1")      names store objects
    cipher key  HMAC(secret, "kvcore/tier/encrypt/v1")   derives per-entry AES keys

An object name is ``kvcore/s1/`` + hex HMAC(name key, tier key): without the
secret nobody can tell which prefix (which prompt) an object holds, or compute
the name of a guessed prompt.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcore.errors import BadRequest
from kvcore.paths import read_private_file
from kvcore.tiers.base import TierKey

if TYPE_CHECKING:
    from kvcore.config import TierConfig

MIN_SECRET_BYTES = 32
OBJECT_PREFIX = "kvcore/s1/"
_MAX_FILE_BYTES = 4096


def _derive(secret: bytes, label: bytes) -> bytes:
    return hmac.new(secret, label, hashlib.sha256).digest()


@dataclass(frozen=True, slots=True)
class TierSecret:
    """The keys one secret derives (32 bytes each). Immutable; safe across threads."""

    mac_key: bytes
    name_key: bytes
    cipher_key: bytes

    @classmethod
    def of(cls, secret: bytes) -> TierSecret:
        if len(secret) < MIN_SECRET_BYTES:
            raise BadRequest(
                f"a tier secret needs at least {MIN_SECRET_BYTES} bytes, got {len(secret)}"
            )
        return cls(
            _derive(secret, b"kvcore/tier/mac/v1"),
            _derive(secret, b"kvcore/tier/name/v1"),
            _derive(secret, b"kvcore/tier/encrypt/v1"),
        )

    def object_name(self, key: TierKey) -> str:
        """The store's name of ``key`` under this secret (64 hex digits after the prefix)."""
        return OBJECT_PREFIX + hmac.new(self.name_key, key, hashlib.sha256).hexdigest()


@dataclass(frozen=True, slots=True)
class Keyring:
    """The secrets a tier accepts: ``current`` MACs, names and encrypts every write;
    ``previous`` (during a rotation) is accepted on read too, after ``current``.
    ``encrypt``: entries are AES-256-GCM encrypted, not only MAC'd (kvcore.tiers.keyed)."""

    current: TierSecret
    previous: TierSecret | None = None
    encrypt: bool = False

    def accepted(self) -> tuple[TierSecret, ...]:
        """The secrets a read tries, current first (one or two)."""
        return (self.current,) if self.previous is None else (self.current, self.previous)


def read_secret(path: str) -> bytes:
    """The secret in ``path``, whitespace-stripped. BadRequest unless the file is a regular
    file (never through a symlink) of this user or root, readable by its owner only
    (kvcore.paths.read_private_file), with MIN_SECRET_BYTES or more."""
    secret = read_private_file(path, "tier secret file", _MAX_FILE_BYTES).strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise BadRequest(
            f"tier secret file {path!r} holds {len(secret)} bytes, fewer than "
            f"{MIN_SECRET_BYTES} (head -c 32 /dev/urandom | base64 > {path})"
        )
    return secret


def load_keyring(
    secret_file: str, previous_secret_file: str = "", *, encrypt: bool = False
) -> Keyring | None:
    """The keyring of a pool's tiers, or None when no ``secret_file`` is configured
    (entries checksummed, not authenticated). BadRequest for a refused file, a
    previous secret without a current one, or ``encrypt`` without a secret."""
    if not secret_file:
        if previous_secret_file or encrypt:
            raise BadRequest("previous_secret_file and encrypt need a secret_file")
        return None
    previous = TierSecret.of(read_secret(previous_secret_file)) if previous_secret_file else None
    return Keyring(TierSecret.of(read_secret(secret_file)), previous, encrypt)


def keyring_of(config: TierConfig) -> Keyring | None:
    """The keyring a pool's :class:`~kvcore.config.TierConfig` declares (None: no
    ``secret_file``), its files checked now: what ``open_stack`` gives every tier."""
    return load_keyring(config.secret_file, config.previous_secret_file, encrypt=config.encrypt)
