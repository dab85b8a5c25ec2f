"""The framing of one entry on disk and in the remote store: a header, then the page.

::

    offset  size  field
    0       8     magic b"KVCTIER1" (format version inside)
    8       48    tier key (layout fingerprint || prefix key)
    56      8     payload length in bytes, u64 LE (= the layout's page_bytes)
    64      16    blake2b-128 of bytes [0, 64) || payload
    80      n     payload: the page, [num_layers, parts, page_size, kv_heads, head_dim], native order

An entry is valid for a reader iff the magic matches, the key equals the key
the reader asked for (so a renamed or foreign file never answers another key),
the length equals the reader's page_bytes and the checksum matches. Anything
else (torn write, bit rot, another layout, another format) is a miss.

The checksum catches corruption, not a writer who frames a page on purpose:
with a secret configured the tiers frame with :class:`kvcore.tiers.keyed.Keyed`
instead (an 80-byte header too, keyed by HMAC-SHA256). Both are a
:class:`Framing`; :class:`Checksummed` is this module's.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Protocol

from kvcore.tiers.base import TIER_KEY_BYTES, TierKey

MAGIC = b"KVCTIER1"
_FIELDS = struct.Struct(f"<8s{TIER_KEY_BYTES}sQ")
CHECKSUM_BYTES = 16
Bytes = bytes | bytearray | memoryview
HEADER_BYTES = _FIELDS.size + CHECKSUM_BYTES  # 80


def _checksum(fields: Bytes, payload: Bytes) -> bytes:
    digest = hashlib.blake2b(fields, digest_size=CHECKSUM_BYTES)
    digest.update(payload)
    return digest.digest()


def encode_header(key: TierKey, payload: Bytes) -> bytes:
    """The 80-byte header of ``payload`` stored under ``key`` (payload not copied)."""
    fields = _FIELDS.pack(MAGIC, key, len(payload))
    return fields + _checksum(fields, payload)


def check_entry(key: TierKey, header: Bytes, payload: Bytes, page_bytes: int) -> bool:
    """True iff ``header`` + ``payload`` is a valid entry of ``key`` with a page of
    ``page_bytes`` bytes (the module docstring's rule)."""
    if len(header) != HEADER_BYTES or len(payload) != page_bytes:
        return False
    fields = header[: _FIELDS.size]
    magic, stored_key, length = _FIELDS.unpack(fields)
    if magic != MAGIC or stored_key != key or length != page_bytes:
        return False
    return bytes(header[_FIELDS.size :]) == _checksum(fields, payload)


def header_names(header: Bytes, page_bytes: int) -> TierKey | None:
    """The key a header claims, if its magic and length fit ``page_bytes`` (no checksum:
    the cheap check a directory scan makes)."""
    if len(header) != HEADER_BYTES:
        return None
    magic, stored_key, length = _FIELDS.unpack(header[: _FIELDS.size])
    if magic != MAGIC or length != page_bytes:
        return None
    return TierKey(bytes(stored_key))


class Framing(Protocol):
    """How a tier frames an entry: an ``HEADER_BYTES`` header, then a body of exactly
    the page's length (the page itself, or its ciphertext). Thread-safe (no state)."""

    keyed: bool  # True iff entries are authenticated by a secret

    def seal(self, key: TierKey, payload: Bytes) -> tuple[bytes, Bytes]:
        """The header and the body that store ``payload`` under ``key``."""

    def unseal(self, key: TierKey, header: Bytes, body: memoryview, page_bytes: int) -> bool:
        """True iff ``header`` + ``body`` is a valid entry of ``key`` with a page of
        ``page_bytes`` bytes; then ``body`` holds the page (decrypted in place; it must
        be writable for an encrypting framing). A False leaves ``body`` undefined."""

    def header_fits(self, key: TierKey, header: Bytes, page_bytes: int) -> bool:
        """The cheap check of a directory scan: could ``header`` start an entry of ``key``?"""


class Checksummed:
    """The unkeyed framing of this module (blake2b-128): no secret configured."""

    keyed = False

    def seal(self, key: TierKey, payload: Bytes) -> tuple[bytes, Bytes]:
        return encode_header(key, payload), payload

    def unseal(self, key: TierKey, header: Bytes, body: memoryview, page_bytes: int) -> bool:
        return check_entry(key, header, body, page_bytes)

    def header_fits(self, key: TierKey, header: Bytes, page_bytes: int) -> bool:
        return header_names(header, page_bytes) == key
