"""How SGLang's storage keys become kvcore prefix keys.

SGLang names each page of its hierarchical cache by a string key that already
identifies the page's whole prefix (a SHA-256 chain over the tokens, seeded with
the request's cache salt). Its storage API hands over keys and host-memory pages,
never tokens, and may start a batch at any page of a sequence. So each SGLang page
is a one-page chain in kvcore, in a key space of its own::

    tokens(key)  = SHA-256(utf8(key)) as 8 u32 LE words, then page_size - 8 zeros
    prefix key   = key(page 0) of spec/hashing.md for tokens(key), rooted at
                   root(namespace, model=sglang_model(config))

``sglang_model`` is the model string of kvcore.integrations.identity for the rank's
:class:`~kvcore.integrations.identity.ModelIdentity` (:func:`rank_identity`): the
model (SGLang's ``model_name``, its weights, revision, dtype, KV dtype and
quantization) and the tensor/pipeline shard the rank holds, its rank included:
each SGLang rank is a client of its own on an unsharded pool. Equal identities
share pages; any difference misses, never collides. A page therefore needs at
least 8 tokens (:data:`MIN_PAGE_SIZE`); smaller pages are refused.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Protocol

from kvcore.errors import BadRequest
from kvcore.integrations.identity import (
    ModelIdentity,
    Source,
    declared,
    hub_weights,
    local_path,
    path_weights,
    space_model,
)

DIGEST_WORDS = 8  # a SHA-256 digest as u32 words
MIN_PAGE_SIZE = DIGEST_WORDS  # tokens per page: one page holds one key's digest
_WORDS = struct.Struct(f"<{DIGEST_WORDS}I")


class StorageRank(Protocol):
    """What the key space reads of SGLang's ``HiCacheStorageConfig`` (one rank's)."""

    model_name: str | None
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    attn_cp_size: int
    is_mla_model: bool
    should_split_heads: bool


@dataclass(frozen=True, slots=True)
class ServerModel:
    """SGLang's model arguments that its storage config lacks ("" where unknown)."""

    model_path: str = ""
    revision: str = ""
    dtype: str = ""
    kv_cache_dtype: str = ""
    quantization: str = ""


def server_model() -> ServerModel:
    """SGLang's model arguments as its runtime context publishes them in the scheduler
    process, where SGLang builds storage backends; all "" where nothing is published
    (a harness that builds the cache controller alone)."""
    try:
        from sglang.srt.runtime_context import get_model

        bag = get_model()
        return ServerModel(
            model_path=str(bag.model_path or ""),
            revision=str(bag.revision or ""),
            dtype=str(bag.dtype or ""),
            kv_cache_dtype=str(bag.kv_cache_dtype or ""),
            quantization=str(bag.quantization or ""),
        )
    except (ImportError, ValueError, AttributeError):  # ValueError: "... not published"
        return ServerModel()


def sglang_model(config: StorageRank, model_id: str = "") -> str:
    """The key space's ``model`` string of an SGLang rank (its storage config and
    SGLang's published model arguments); ``model_id`` is the operator's declaration
    (kvcore.integrations.identity). ValueError as :func:`rank_identity`."""
    return space_model(rank_identity(config, server_model(), model_id))


def rank_identity(config: StorageRank, server: ServerModel, model_id: str = "") -> ModelIdentity:
    """The model identity of an SGLang rank. ValueError for what kvcore does not store
    yet (MLA, split heads, context parallelism), or no model name."""
    if not config.model_name:
        raise ValueError("kvcore's SGLang storage needs the model name (SGLang's model_name)")
    if config.is_mla_model:
        raise ValueError("kvcore's SGLang storage does not hold MLA caches yet")
    if config.should_split_heads or getattr(config, "dcp_size", 1) > 1 or config.attn_cp_size > 1:
        raise ValueError(
            "kvcore's SGLang storage does not split heads or contexts across ranks yet"
        )
    if model_id:
        source = declared(model_id)
    else:
        name = config.model_name
        local = local_path(name)
        weights = (
            path_weights(local)
            if local
            else hub_weights(server.model_path or name, server.revision)
        )
        source = Source(model=local or name, revision=server.revision, weights=weights)
    kv = server.kv_cache_dtype
    return ModelIdentity(
        source=source,
        dtype=server.dtype,
        kv_dtype=server.dtype if kv == "auto" else kv,
        quantization=server.quantization,
        tp_size=config.tp_size,
        pp_size=config.pp_size,
        tp_rank=config.tp_rank,
        pp_rank=config.pp_rank,
    )


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
