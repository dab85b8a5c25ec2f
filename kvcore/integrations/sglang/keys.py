"""How SGLang's storage keys become kvcore prefix keys.

SGLang names each page of its hierarchical cache by a string key that already
identifies the page's whole prefix (a SHA-256 chain over the tokens, seeded with
the request's cache salt). Its storage API hands over keys and host-memory pages,
never tokens, and may start a batch at any page of a sequence. So each SGLang page
is a one-page chain in kvcore, in a key space of its own::

    tokens(key)  = SHA-256(utf8(key)) as 8 u32 LE words, then page_size - 8 zeros
    prefix key   = key(page 0) of spec/hashing.md for tokens(key), rooted at
                   root(namespace, lora="", salt=space_salt(identity))

``space_salt`` hashes what must match for two SGLang ranks' bytes to be
interchangeable (:class:`Identity`): the model, and the tensor/pipeline shard the
rank holds. Equal identities share pages; any difference misses, never collides. A page therefore
needs at least 8 tokens (:data:`MIN_PAGE_SIZE`); smaller pages are refused.
"""

from __future__ import annotations

import hashlib
import struct

import msgspec

from kvcore.errors import BadRequest

DIGEST_WORDS = 8  # a SHA-256 digest as u32 words
MIN_PAGE_SIZE = DIGEST_WORDS  # tokens per page: one page holds one key's digest
SALT_PREFIX = "sglang/v1:"
_WORDS = struct.Struct(f"<{DIGEST_WORDS}I")


class Identity(msgspec.Struct, frozen=True, kw_only=True):
    """What selects an SGLang rank's key space (from SGLang's HiCacheStorageConfig):
    the model, and the shard of its KV heads (``tp_rank`` of ``tp_size``) and layers
    (``pp_rank`` of ``pp_size``) the rank holds. Append fields only at the end: the
    encoding is the key space."""

    model: str
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int


def space_salt(identity: Identity) -> str:
    """The kvcore cache salt of ``identity``'s key space (74 ASCII bytes)."""
    digest = hashlib.sha256(msgspec.msgpack.encode(identity)).hexdigest()
    return SALT_PREFIX + digest


def page_tokens(key: str, page_size: int) -> list[int]:
    """The ``page_size`` tokens that stand for SGLang page ``key`` (module docstring).
    BadRequest if ``page_size`` < :data:`MIN_PAGE_SIZE`."""
    if page_size < MIN_PAGE_SIZE:
        raise BadRequest(
            f"SGLang storage on kvcore needs pages of at least {MIN_PAGE_SIZE} tokens "
            f"(--page-size), got {page_size}"
        )
    words = _WORDS.unpack(hashlib.sha256(key.encode()).digest())
    return [*words, *([0] * (page_size - DIGEST_WORDS))]
