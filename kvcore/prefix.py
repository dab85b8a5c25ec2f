"""Prefix keys and the prefix index.

A prefix key names the content of one full page *and everything before it* in
one key space (spec/hashing.md fixes the bytes)::

    root(space)   = SHA-256( b"kvcore/prefix/v1" || TLV(0x01, utf8(namespace))
                             [|| TLV(0x06, utf8(model)) if model]
                             [|| TLV(0x04, utf8(lora)) if lora]
                             [|| TLV(0x05, utf8(salt)) if salt] )
    key(page i)   = SHA-256( key(page i-1) || TLV(0x02, tokens of page i as u32 LE)
                             [|| TLV(0x03, extra)] )
    TLV(tag, v)   = u8(tag) || u32 LE(len(v) in bytes) || v
    key(page -1)  = root(space)

So equal keys mean equal key space (:class:`KeySpace`: namespace, model, LoRA
adapter, cache salt), equal extra inputs and equal tokens from the first token
on, in every process, language and run; a cryptographic hash means nobody can
force a collision into another tenant's cache. A part left empty adds nothing to
the root, so a key space without a model, an adapter or a salt has the root its
namespace had before any of them existed.

The index maps key <-> page for committed pages, and remembers each key's
parent key (for :meth:`PrefixIndex.snapshot`). A key is indexed at most once:
if two sequences compute the same page independently, the first commit wins and
the second page stays a private, unindexed page.

The index does no I/O: every change queues a :class:`PageStored` or
:class:`PageRemoved` event, in the order of the changes, until
:meth:`PrefixIndex.take_events` hands the queue over (the daemon publishes it).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Mapping, Sequence
from typing import NamedTuple, NewType

import msgspec

from kvcore.allocator import PageId
from kvcore.errors import BadRequest

PrefixKey = NewType("PrefixKey", bytes)

DOMAIN = b"kvcore/prefix/v1"
TAG_NAMESPACE = 0x01
TAG_TOKENS = 0x02
TAG_EXTRA = 0x03
TAG_LORA = 0x04
TAG_SALT = 0x05
TAG_MODEL = 0x06
KEY_BYTES = 32
MAX_KEY_PART_BYTES = 256  # each part of a key space, as UTF-8
DEFAULT_NAMESPACE = "default"


_TLV_HEAD = struct.Struct("<BI")
_sha256 = hashlib.sha256


def _tlv(tag: int, value: bytes) -> bytes:
    return _TLV_HEAD.pack(tag, len(value)) + value


_U32_PACKERS: dict[int, struct.Struct] = {}  # token count -> its "<nI" packer
_MAX_PACKERS = 4096  # distinct counts kept (a packer is ~150 bytes whatever its count)


class PackedTokens(bytes):
    """Tokens as their little-endian u32 bytes, 4 a token (what :func:`encode_tokens`
    returns): the one-page chain operations (``allocate_pages``, ``lookup_pages``,
    ``commit_pages``) take them so, on the wire too (spec/protocol.md), with no work
    per token on either side. ``len`` is in bytes: :func:`count_tokens` counts tokens.
    Only those operations read the type; everything else takes a sequence of ints."""


def count_tokens(tokens: Sequence[int]) -> int:
    """How many tokens ``tokens`` holds, packed (:class:`PackedTokens`) or not."""
    return len(tokens) // 4 if isinstance(tokens, PackedTokens) else len(tokens)


def encode_tokens(tokens: Sequence[int]) -> bytes:
    """Tokens as little-endian u32 bytes; BadRequest if any is not an int in [0, 2**32)
    (anything with ``__index__`` counts as an int, as for a list index), or if packed
    tokens (:class:`PackedTokens`, returned as they are) are not 4 bytes each.

    One ``struct`` packer per token count, cached: a quarter fewer instructions per
    token than ``array("I", tokens)``, and this runs on every token a lookup or an
    allocate receives (their validation)."""
    if isinstance(tokens, PackedTokens):
        if len(tokens) % 4:
            raise BadRequest(f"packed tokens are 4 bytes each, got {len(tokens)} bytes")
        return tokens
    try:
        count = len(tokens)
        packer = _U32_PACKERS.get(count)
        if packer is None:
            if len(_U32_PACKERS) >= _MAX_PACKERS:
                _U32_PACKERS.clear()
            packer = _U32_PACKERS[count] = struct.Struct(f"<{count}I")
        return packer.pack(*tokens)
    except (struct.error, TypeError) as exc:
        raise BadRequest(f"tokens must be a sequence of ints in [0, 2**32): {exc}") from None


class KeySpace(NamedTuple):
    """Everything besides the tokens that decides the K/V a page holds, in root order
    (spec/hashing.md): the one value the core passes for "whose pages are these".

    ``namespace`` is the tenant (None: the caller's default, ``"default"`` in a
    Manager, the session's namespace over the wire); ``model`` the engine's model
    identity (kvcore.integrations.identity: weights, dtypes, shard); ``lora`` the
    LoRA adapter; ``salt`` the request's cache salt. ``""`` is "none" for the last
    three and hashes nothing. Each part is at most 256 bytes of UTF-8. Adding a part:
    a field here, its tag in :data:`ROOT_TAGS`, and the spec."""

    namespace: str | None = None
    model: str = ""
    lora: str = ""
    salt: str = ""

    def resolved(self, namespace: str = DEFAULT_NAMESPACE) -> KeySpace:
        """This space with ``namespace`` for a None namespace (the caller's default)."""
        return self if self.namespace is not None else self._replace(namespace=namespace)


ROOT_TAGS = (TAG_NAMESPACE, TAG_MODEL, TAG_LORA, TAG_SALT)
"""The tag of each :class:`KeySpace` field, in field order (the order they are hashed)."""
assert len(ROOT_TAGS) == len(KeySpace._fields)


def root_key(space: KeySpace) -> PrefixKey:
    """The parent key of the first page of ``space`` (a None namespace is
    ``"default"``). The namespace is always hashed, every other part only when not
    ""; BadRequest unless each is a str of at most 256 bytes of UTF-8."""
    namespace, *rest = space
    message = DOMAIN + _tlv(
        TAG_NAMESPACE, _utf8("namespace", DEFAULT_NAMESPACE if namespace is None else namespace)
    )
    for name, tag, value in zip(KeySpace._fields[1:], ROOT_TAGS[1:], rest, strict=True):
        if value != "" or value.__class__ is not str:
            message += _tlv(tag, _utf8(name, value))
    return PrefixKey(hashlib.sha256(message).digest())


def _utf8(name: str, value: str, limit: int = MAX_KEY_PART_BYTES) -> bytes:
    """``value`` as UTF-8; BadRequest unless it is a str of at most ``limit`` bytes."""
    if not isinstance(value, str):
        raise BadRequest(f"{name} must be a str, got {value!r}")
    try:
        raw = value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRequest(f"{name} is not encodable as UTF-8: {exc}") from None
    if len(raw) > limit:
        raise BadRequest(f"{name} is {len(raw)} bytes; at most {limit}")
    return raw


def page_key(parent: PrefixKey, page_tokens: bytes, extra: bytes = b"") -> PrefixKey:
    """Key of one full page; ``page_tokens`` as :func:`encode_tokens` returns them.

    One SHA-256 call over the concatenated message (the hot path of lookups and
    commits: a page of 16 tokens is under 100 bytes, cheaper to join than to feed).
    """
    message = parent + _TLV_HEAD.pack(TAG_TOKENS, len(page_tokens)) + page_tokens
    if extra:
        message += _tlv(TAG_EXTRA, extra)
    return _sha256(message).digest()  # type: ignore[return-value]  # PrefixKey(), minus a call


def chain_keys(
    parent: PrefixKey, token_bytes: bytes, page_size: int, first_page: int = 0
) -> Iterator[PrefixKey]:
    """Keys of the full pages from ``first_page`` on, lazily (stop early to hash less).

    ``token_bytes`` holds the sequence's tokens from token 0 (u32 LE); ``parent``
    is the key of page ``first_page - 1`` (the namespace root for page 0).
    """
    stride = 4 * page_size
    for page in range(first_page, len(token_bytes) // stride):
        parent = page_key(parent, token_bytes[page * stride : (page + 1) * stride])
        yield parent


def page_keys(parent: PrefixKey, token_bytes: bytes, page_size: int) -> list[PrefixKey]:
    """Keys of every full page of ``token_bytes``, eagerly: :func:`chain_keys` in
    one call (a commit's new pages). ``parent`` is the key of the page before."""
    stride = 4 * page_size
    head = _TLV_HEAD.pack(TAG_TOKENS, stride)
    if len(token_bytes) == stride:  # one page: the common commit
        return [_sha256(parent + head + token_bytes).digest()]  # type: ignore[list-item]
    keys: list[PrefixKey] = []
    for at in range(0, len(token_bytes) - stride + 1, stride):
        parent = _sha256(parent + head + token_bytes[at : at + stride]).digest()  # type: ignore[assignment]
        keys.append(parent)
    return keys


class PageStored(msgspec.Struct, frozen=True, gc=False):
    """A page became visible to prefix lookups (it was committed). The index keeps
    the same object as the page's entry, so it is immutable (and a frozen Struct is
    built in C: one per committed page). Its fields are bytes, ints, strs and a
    KeySpace of strs, which cannot lead back to it, so it is never tracked by the
    garbage collector (``gc=False``): an index of many pages adds nothing to the
    collector's passes.

    ``tokens`` (the page's page_size tokens, u32 LE bytes) and the key space
    (namespace resolved) are what a consumer that hashes tokens itself needs
    (vLLM-format events) and what keeps models apart for a router. Every entry of
    a :class:`PrefixIndex` has them (the index finds pages by their tokens); an
    event built elsewhere may leave them empty."""

    key: PrefixKey
    parent_key: PrefixKey  # root_key(space) for the first page of a chain
    page: PageId
    tokens: bytes = b""
    space: KeySpace = KeySpace("")
    medium: str = ""  # "": committed by an engine; else the lower tier it was promoted from


class PageRemoved(msgspec.Struct, frozen=True):
    """A page left the index (it was evicted); its key no longer hits in the pool.
    ``medium``: "" if its bytes were dropped, else the lower tier now holding them."""

    key: PrefixKey
    page: PageId
    medium: str = ""


PageEvent = PageStored | PageRemoved


class PrefixIndex:
    """Bijection key <-> page over committed pages, with each key's parent; O(1) per key.

    Invariants: ``_stored`` (key -> its PageStored entry), ``_key_of``
    (page -> key) and ``_by_content`` ((parent key, page tokens) -> entry) are
    maps of equal size over the same entries, the first two inverse of each other;
    every entry's key is ``page_key(parent_key, tokens)``, so finding a page by its
    content finds it by its key without hashing; ``_events`` holds the changes
    not yet taken, oldest first.
    """

    __slots__ = ("_by_content", "_events", "_key_of", "_stored")

    def __init__(self) -> None:
        self._stored: dict[PrefixKey, PageStored] = {}
        self._key_of: dict[PageId, PrefixKey] = {}
        self._by_content: dict[tuple[PrefixKey, bytes], PageStored] = {}
        self._events: list[PageEvent] = []

    def __len__(self) -> int:
        return len(self._stored)

    @property
    def entries(self) -> Mapping[PrefixKey, PageStored]:
        """key -> its entry (page, parent key): read-only, for hot loops."""
        return self._stored

    @property
    def key_by_page(self) -> Mapping[PageId, PrefixKey]:
        """page -> key of every indexed page: read-only, for hot loops."""
        return self._key_of

    @property
    def by_content(self) -> Mapping[tuple[PrefixKey, bytes], PageStored]:
        """(parent key, page tokens as u32 LE bytes) -> entry of every indexed page:
        read-only, for matching a prompt page by page without hashing it (an entry
        found here is the one ``page_key(parent key, tokens)`` names)."""
        return self._by_content

    def insert_chain(
        self,
        parent_key: PrefixKey,
        keys: Sequence[PrefixKey],
        pages: Sequence[PageId],
        token_bytes: bytes,
        space: KeySpace = KeySpace(""),
        medium: str = "",
    ) -> list[PageStored]:
        """Index each ``pages[i]`` under ``keys[i]``, a chain whose first key's parent
        is ``parent_key``, queuing a PageStored each. A key already indexed keeps its
        page (the first commit wins); the page passed for it stays private.
        ``token_bytes`` are the chain's tokens (u32 LE, the same number per page):
        ``keys[i]`` is ``page_key(keys[i - 1], tokens of page i)``, which the caller
        computed. They, the key space and ``medium`` (where the bytes came from: ""
        for a commit) label the entries and their events. Returns the entries this
        call indexed, in chain order (a subclass mirrors them: kvcore.daemon.index_table)."""
        assert len(keys) == len(pages), f"{len(keys)} keys for {len(pages)} pages"
        stored, key_of, by_content = self._stored, self._key_of, self._by_content
        append = self._events.append
        inserted: list[PageStored] = []
        stride = len(token_bytes) // len(keys) if keys else 0
        assert not keys or (stride and stride * len(keys) == len(token_bytes)), "not whole pages"
        at = 0
        for key, page in zip(keys, pages, strict=True):
            if key not in stored:
                assert page not in key_of, f"page {page} is indexed under another key"
                tokens = token_bytes[at : at + stride]
                entry = PageStored(key, parent_key, page, tokens, space, medium)
                stored[key] = entry
                key_of[page] = key
                by_content[parent_key, tokens] = entry
                append(entry)
                inserted.append(entry)
            parent_key = key
            at += stride
        return inserted

    def remove(self, page: PageId) -> None:
        """Drop an indexed page (eviction)."""
        key = self._key_of.pop(page)
        entry = self._stored.pop(key)
        del self._by_content[entry.parent_key, entry.tokens]
        self._events.append(PageRemoved(key, page))

    def take_events(self) -> list[PageEvent]:
        """The queued events, oldest first; the queue is empty afterwards."""
        events, self._events = self._events, []
        return events

    def snapshot(self) -> list[PageStored]:
        """Every indexed page, each parent before its children. O(index).

        A page whose parent key is not indexed (evicted, or indexed by nobody)
        starts a chain of its own; siblings keep their order of insertion.
        """
        heads: list[PageStored] = []
        children: dict[PrefixKey, list[PageStored]] = {}
        for entry in self._stored.values():
            if entry.parent_key in self._stored:
                children.setdefault(entry.parent_key, []).append(entry)
            else:
                heads.append(entry)
        order = heads
        for entry in order:  # breadth first; ``order`` grows while we walk it
            order.extend(children.get(entry.key, ()))
        return order

    def check_integrity(self) -> None:
        """Assert the class invariants. O(index), one SHA-256 per entry: for tests."""
        assert len(self._stored) == len(self._key_of), "index maps differ in size"
        assert len(self._stored) == len(self._by_content), "content map differs in size"
        for key, entry in self._stored.items():
            assert entry.key == key, f"entry of {key.hex()} names {entry.key.hex()}"
            assert self._key_of.get(entry.page) == key, f"index maps disagree on page {entry.page}"
            assert self._by_content.get((entry.parent_key, entry.tokens)) is entry, (
                f"entry of {key.hex()} is not found by its content"
            )
            assert page_key(entry.parent_key, entry.tokens) == key, (
                f"{key.hex()} is not the key of its parent and tokens"
            )
        assert len(self.snapshot()) == len(self._stored), "a cycle of parent keys"
