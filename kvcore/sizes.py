"""Byte sizes as configuration writes them: an int, or a string like ``"256MiB"``.

A leaf: it imports nothing of kvcore but its errors, so the configuration of
pools and of their tiers can share it without importing each other.
"""

from __future__ import annotations

import re

from kvcore.errors import BadRequest

# unit (lower case) -> bytes; binary and decimal multiples
UNITS = {
    "": 1,
    "b": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string like "256MiB", "1.5GiB", "4096" (BadRequest otherwise)."""
    if isinstance(size, int) and not isinstance(size, bool):
        return size
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(size))
    if match is None or match.group(2).lower() not in UNITS:
        raise BadRequest(f"not a size: {size!r} (try 256MiB, 2GiB or a byte count)")
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])
