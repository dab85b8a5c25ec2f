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
source of the model the server loaded (SGLang's ``model_path``, as vLLM's:
:func:`~kvcore.integrations.identity.source_of`), its dtype, KV dtype and
quantization (an fp8 cache's scales: :func:`kv_scales`), and the tensor/pipeline
shard the rank holds, its rank included: each SGLang rank is a client of its own
on an unsharded pool. An MLA model's ranks (SGLang's ``is_mla_model``) are one:
MLA has no KV heads to split, every TP rank holds the same latent cache, and
SGLang stores it from TP rank 0 alone (its ``is_storage_writer``) while every rank
prefetches (the hits are the minimum over ranks), so each reads rank 0's pages
(``tp_rank`` 0; ``tp_size`` still enters). Equal identities
share pages; any difference misses, never collides. A page therefore needs at
least 8 tokens (:data:`MIN_PAGE_SIZE`); smaller pages are refused.

SGLang's storage config carries only the *served* model name (``--served-model-name``,
which two checkpoints may share), so the source comes from the arguments SGLang
publishes in the scheduler process (:func:`server_model`): ``model_path``,
``revision`` and the HF config SGLang built (``--json-model-override-args``
applied). The served name stands in only where nothing is published. Weights
that nothing names (no local path, no cached hub commit) and ``--load-format dummy``
are :func:`~kvcore.integrations.identity.process_nonce`: the process's pages are its
own (every other process misses them), and a warning names ``model_id``.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from kvcore.errors import BadRequest
from kvcore.integrations.identity import (
    DUMMY,
    ModelIdentity,
    declared,
    kv_dtype_of,
    kv_scales_of,
    process_nonce,
    source_of,
    space_model,
)
from kvcore.prefix import PackedTokens

log = logging.getLogger(__name__)

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
    """SGLang's model arguments that its storage config lacks ("" or None where unknown)."""

    model_path: str = ""
    revision: str = ""
    dtype: str = ""  # resolved where SGLang's model config is built ("auto" otherwise)
    kv_cache_dtype: str = ""
    quantization: str = ""
    load_format: str = ""
    hf_config: Any = None  # the HF config SGLang built (override args applied)
    kv_scales_path: str = ""  # --quantization-param-path: an fp8 cache's scales file


def server_model() -> ServerModel:
    """SGLang's model arguments as its runtime context publishes them in the scheduler
    process, where SGLang builds storage backends, with the HF config and dtype of
    its process model config; all "" where nothing is published (a harness that
    builds the cache controller alone)."""
    try:
        from sglang.srt.runtime_context import get_model, process_model_config

        bag = get_model()
    except (ImportError, ValueError):  # ValueError: "... not published"
        return ServerModel()
    built = process_model_config()  # memoized: the one the scheduler runs
    return ServerModel(
        model_path=str(bag.model_path or ""),
        revision=str(bag.revision or ""),
        dtype=str(built.dtype).removeprefix("torch."),
        kv_cache_dtype=str(bag.kv_cache_dtype or ""),
        quantization=str(bag.quantization or ""),
        load_format=str(bag.load_format or ""),
        hf_config=built.hf_config,
        kv_scales_path=str(getattr(bag, "quantization_param_path", None) or ""),
    )


def sglang_model(config: StorageRank, model_id: str = "") -> str:
    """The key space's ``model`` string of an SGLang rank (its storage config and
    SGLang's published model arguments); ``model_id`` is the operator's declaration
    (kvcore.integrations.identity). ValueError as :func:`rank_identity`."""
    return space_model(rank_identity(config, server_model(), model_id))


def rank_identity(config: StorageRank, server: ServerModel, model_id: str = "") -> ModelIdentity:
    """The model identity of an SGLang rank (module docstring). ValueError for what
    kvcore does not store yet (split heads, context parallelism), or no model."""
    if config.should_split_heads or getattr(config, "dcp_size", 1) > 1 or config.attn_cp_size > 1:
        raise ValueError(
            "kvcore's SGLang storage does not split heads or contexts across ranks yet"
        )
    name = server.model_path or config.model_name or ""
    dummy = server.load_format == DUMMY
    if model_id and not dummy:
        source = declared(model_id)
    elif not name:
        raise ValueError("kvcore's SGLang storage needs the model (SGLang's model_path)")
    else:
        if dummy and model_id:
            log.warning("kvcore: %s: random weights (load format dummy); model_id ignored", name)
        source = source_of(
            name,
            revision=server.revision,
            config=server.hf_config,
            weights=process_nonce() if dummy else None,
        )
        if not source.weights:
            log.warning(
                "kvcore: cannot identify the weights of SGLang's model %r (no local path, no "
                "hub commit in the local cache): its pages are this process's alone. Set "
                "model_id in --hicache-storage-backend-extra-config to share them",
                name,
            )
            source = msgspec.structs.replace(source, weights=process_nonce())
    return ModelIdentity(
        source=source,
        dtype=server.dtype,
        kv_dtype=kv_dtype_of(_cache_dtype(server), server.dtype),
        kv_scales=kv_scales(server),
        quantization=server.quantization,
        tp_size=config.tp_size,
        pp_size=config.pp_size,
        tp_rank=0 if config.is_mla_model else config.tp_rank,  # MLA: rank 0's pages
        pp_rank=config.pp_rank,
    )


def kv_scales(server: ServerModel) -> str:
    """The identity's ``kv_scales`` of the server's cache: "" for a float cache; an fp8
    cache's come from the checkpoint (or SGLang's default 1.0) unless
    ``--quantization-param-path`` names a file of them: then that file's SHA-256
    (a process nonce if it cannot be read: SGLang fails to load it then)."""
    scales = kv_scales_of(_cache_dtype(server))
    if not scales or not server.kv_scales_path:
        return scales
    try:
        with open(server.kv_scales_path, "rb") as f:
            return "file:" + hashlib.file_digest(f, "sha256").hexdigest()
    except OSError:
        return process_nonce()


def _cache_dtype(server: ServerModel) -> str:
    """The server's ``--kv-cache-dtype``, its two spellings of bfloat16 as one."""
    return "bfloat16" if server.kv_cache_dtype == "bf16" else server.kv_cache_dtype


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


def pages_tokens(keys: Sequence[str], page_size: int) -> PackedTokens:
    """:func:`page_tokens` of each of ``keys``, page after page, packed (what
    ``allocate_pages`` carries as bytes): a key's page is its digest, which is its 8
    words little-endian already, then the zeros; no work per token on either side.
    BadRequest as :func:`page_tokens`."""
    page_tokens("", page_size)  # BadRequest for pages too small to key
    pad = bytes(4 * (page_size - DIGEST_WORDS))
    sha256 = hashlib.sha256
    return PackedTokens(b"".join([sha256(key.encode()).digest() + pad for key in keys]))
