"""Keyed: the framing of an entry when the deployment shares a secret (kvcore.tiers.secret).

The same 80-byte header size as the checksummed framing (kvcore.tiers.codec),
so an entry takes the same bytes either way::

    offset  size  field
    0       8     magic b"KVCMAC01" (MAC'd) or b"KVCENC01" (encrypted)
    8       8     payload length in bytes, u64 LE (= the layout's page_bytes)
    16      16    salt: random per entry (encrypted), zeros (MAC'd)
    32      16    AES-GCM tag (encrypted), zeros (MAC'd)
    48      32    HMAC-SHA256(mac key, DOMAIN || tier key || bytes [0, 48) || body)
    80      n     body: the page, or its AES-256-GCM ciphertext (same length)

The MAC covers the tier key (layout fingerprint || prefix key) without storing
it: an entry verifies only under the key it was written for, so a valid entry
copied to another name or file is a miss, and the header tells a reader of the
store nothing about which prefix it holds. Reads try the keyring's secrets in
order (current, then previous): at most two MACs per entry.

Encrypted entries (``Keyring.encrypt``): the AES key of one entry is
HMAC(cipher key, salt), used once (the salt is 16 random bytes, so no key and
nonce pair repeats), with a zero nonce and the header's first 16 bytes and the
tier key as associated data. The body is verified by the MAC before it is
decrypted. The AES-GCM is the ``cryptography`` package's (OpenSSL); without
that package, ``encrypt`` is refused at start.
"""

from __future__ import annotations

import hashlib
import hmac
import importlib
import secrets
import struct
from typing import Any

from kvcore.errors import BadRequest
from kvcore.tiers.base import TierKey
from kvcore.tiers.codec import HEADER_BYTES, Bytes
from kvcore.tiers.secret import Keyring, TierSecret

MAGIC_MAC = b"KVCMAC01"
MAGIC_ENCRYPTED = b"KVCENC01"
DOMAIN = b"kvcore/tier/entry/v1"
_FIELDS = struct.Struct("<8sQ16s16s")  # magic, length, salt, tag: the MAC'd prefix
MAC_BYTES = 32
_ZERO_NONCE = bytes(12)
assert _FIELDS.size + MAC_BYTES == HEADER_BYTES, "keyed and checksummed headers differ in size"


def _aead(key: bytes) -> Any:
    """An AESGCM of ``cryptography`` (imported on first use; BadRequest without it)."""
    try:
        aead = importlib.import_module("cryptography.hazmat.primitives.ciphers.aead")
    except ImportError:
        raise BadRequest("encrypt = true needs the cryptography package") from None
    return aead.AESGCM(key)


class Keyed:
    """The framing of a tier whose deployment shares ``keyring``'s secrets."""

    keyed = True

    def __init__(self, keyring: Keyring) -> None:
        self.keyring = keyring
        self.magic = MAGIC_ENCRYPTED if keyring.encrypt else MAGIC_MAC
        if keyring.encrypt:
            _aead(bytes(32))  # refuse at start, not at the first write

    def seal(self, key: TierKey, payload: Bytes) -> tuple[bytes, Bytes]:
        secret = self.keyring.current
        body: Bytes = payload
        salt = tag = bytes(16)
        if self.keyring.encrypt:
            salt = secrets.token_bytes(16)
            sealed = self._cipher(secret, salt).encrypt(
                _ZERO_NONCE, payload, self._aad(key, salt, len(payload))
            )
            body, tag = memoryview(sealed)[:-16], sealed[-16:]
        fields = _FIELDS.pack(self.magic, len(payload), salt, tag)
        return fields + _mac(secret, key, fields, body), body

    def unseal(self, key: TierKey, header: Bytes, body: memoryview, page_bytes: int) -> bool:
        if len(header) != HEADER_BYTES or len(body) != page_bytes:
            return False
        fields = bytes(header[: _FIELDS.size])
        magic, length, salt, tag = _FIELDS.unpack(fields)
        if magic != self.magic or length != page_bytes:
            return False
        stored = bytes(header[_FIELDS.size :])
        for secret in self.keyring.accepted():
            if hmac.compare_digest(stored, _mac(secret, key, fields, body)):
                break
        else:
            return False
        if self.keyring.encrypt:
            aad = self._aad(key, salt, length)
            try:
                body[:] = self._cipher(secret, salt).decrypt(_ZERO_NONCE, bytes(body) + tag, aad)
            except Exception:  # InvalidTag: cannot follow a MAC that verified, but a miss
                return False
        return True

    def header_fits(self, key: TierKey, header: Bytes, page_bytes: int) -> bool:
        if len(header) != HEADER_BYTES:
            return False
        magic, length, _salt, _tag = _FIELDS.unpack(header[: _FIELDS.size])
        return bool(magic == self.magic and length == page_bytes)

    def _aad(self, key: TierKey, salt: bytes, length: int) -> bytes:
        return DOMAIN + key + self.magic + struct.pack("<Q", length) + salt

    @staticmethod
    def _cipher(secret: TierSecret, salt: bytes) -> Any:
        return _aead(hmac.new(secret.cipher_key, salt, hashlib.sha256).digest())


def _mac(secret: TierSecret, key: TierKey, fields: bytes, body: Bytes) -> bytes:
    digest = hmac.new(secret.mac_key, DOMAIN, hashlib.sha256)
    digest.update(key)
    digest.update(fields)
    digest.update(body)
    return digest.digest()
