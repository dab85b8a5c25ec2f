"""What the connector's scheduler side knows about one vLLM request: one record, one phase.

Every request the scheduler side has asked the daemon about (or decided to run
without kvcore) has exactly one :class:`RequestRecord`, keyed by vLLM's request id;
its :class:`Phase` says which of its fields mean something::

    from           event                                          to
    (none)         vLLM asks; the allocation is sent              ASKED
    ASKED          the answer: a sequence, its hit pinned         HELD
    ASKED          allocation failed (out of pages, daemon gone)  MISSED: 0 once, then (none)
    ASKED          refused (a quota, a namespace, too long)       WITHOUT, until it finishes
    HELD           update_state_after_alloc (vLLM scheduled it)   RUNNING
    HELD           HOLD_PASSES passes unscheduled, no copy out    (none), sequence freed
    RUNNING        preempted, then asked again                    HELD
    RUNNING        finished with a copy in flight                 FINISHED
    FINISHED       its last copy reported                         (none), sequence freed
    HELD, RUNNING  finished, no copy in flight                    (none), sequence freed
    ASKED, MISSED, finished                                       (none); an answer still on
    WITHOUT                                                       its way is freed on arrival
    ASKED, HELD,   an answer that does not fit the record         WITHOUT (logged), FINISHED:
    RUNNING,       (:meth:`RequestRecord.fits`)                   (none); its sequence freed
    FINISHED                                                      once no copy is in flight
    any            the session lost, or attached again            (none): dropped whole

Records of one session only: when the link reports the session lost (its lease, the
daemon alive) or attached again (a new session), every record is dropped at once
(the sequences died with the session); the loads a RUNNING record had queued for
the next plan become load errors (vLLM recomputes those blocks).

Pages and tokens: ``pages``, ``hit``, ``confirmed``, ``scheduled`` count pages of
``page_size`` tokens from the request's first token; ``capacity``, ``limit``,
``local_hit`` and ``asked_tokens`` count tokens, and so do the runs of ``sources``
(where the allocation's hit was when asked: :mod:`.sources` splits vLLM's external
hit by them).

What a request is keyed by on the daemon (its :class:`~kvcore.prefix.KeySpace`: the
engine's model, its LoRA adapter's name and files, its cache salt) is built here too,
once per request (:class:`KeySpaces`), and travels as one value to the allocation.
"""

from __future__ import annotations

import enum
import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcore.integrations.identity import path_weights
from kvcore.prefix import MAX_KEY_PART_BYTES, KeySpace
from kvcore.results import Allocation, Extension

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest
    from vllm.v1.request import Request

log = logging.getLogger("kvcore.vllm")
MAX_ADAPTERS = 1024  # adapters whose key a KeySpaces remembers (then it starts over)


class Phase(enum.Enum):
    """Where a request stands with kvcore (module docstring: the transitions)."""

    ASKED = "asked"  # its allocation is on the way (``seq`` chosen, no answer yet)
    HELD = "held"  # answered: the sequence pins the hit; vLLM has not scheduled it
    RUNNING = "running"  # vLLM scheduled it: loads planned, full pages saved as computed
    FINISHED = "finished"  # vLLM is done with it; a copy is in flight: freed once reported
    MISSED = "missed"  # the allocation failed (out of pages, daemon gone): 0 once
    WITHOUT = "without"  # the daemon refused it (a quota, a namespace, too many tokens)


WITH_SEQUENCE = frozenset({Phase.ASKED, Phase.HELD, Phase.RUNNING, Phase.FINISHED})
"""Phases whose record names a daemon sequence (``seq`` != 0)."""
HOLDING = frozenset({Phase.HELD, Phase.RUNNING, Phase.FINISHED})
"""Phases whose sequence is allocated on the daemon (pages known)."""


@dataclass(slots=True)
class RequestRecord:
    """Everything the scheduler side knows about one request. Changed only by the
    scheduler side (vLLM's scheduler thread), never by the link's thread."""

    request: Request  # vLLM's live object (num_computed_tokens, all_token_ids)
    phase: Phase
    seq: int = 0  # the daemon sequence (0: none; phases WITH_SEQUENCE have one)
    local_hit: int = 0  # tokens: vLLM's own hit when it last asked (whole pages)
    asked_tokens: int = 0  # tokens sent with the allocation (the sequence's first size)
    pages: list[int] = field(default_factory=list)  # the sequence's block table in the pool
    capacity: int = 0  # tokens the sequence holds on the daemon: pages below it may be saved
    limit: int = 0  # tokens: pages below it may be saved (the prompt's, or all)
    hit: int = 0  # pages kvcore held at allocate (pinned by the sequence)
    sources: list[tuple[str, int]] = field(default_factory=list)  # Allocation.sources: where
    # the hit's tokens were when asked, runs (medium, tokens) in chain order ([]: the pool)
    confirmed: int = 0  # leading pages kvcore holds now: hit, then reported saves
    scheduled: int = 0  # leading pages held or with a save in a sent plan
    in_flight: int = 0  # sent plans with a copy of this request, not yet reported
    extending: int = 0  # tokens of the extend on its way (0: none)
    passes: int = 0  # HELD: scheduling passes since it was answered
    loads: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)  # RUNNING: to plan
    # (page, its block in each KV cache group: NO_BLOCK where the group holds none)

    def allocated(self, alloc: Allocation, page_size: int, limit: int) -> None:
        """ASKED -> HELD: the daemon's answer; the sequence pins ``alloc``'s hit (whole
        pages) and may save the pages below ``limit`` (tokens)."""
        assert self.phase is Phase.ASKED, self
        hit = alloc.num_cached_tokens // page_size
        self.phase, self.passes = Phase.HELD, 0
        self.pages = list(alloc.pages)
        self.capacity = self.asked_tokens
        self.limit = limit
        self.hit = self.confirmed = self.scheduled = hit
        self.sources = list(alloc.sources)

    def fits(self, answer: Allocation | Extension, page_size: int) -> bool:
        """Whether the daemon's answer can be this record's: an allocation (the record
        ASKED) with a page for every token asked and a hit within them; an extension (an
        extend on its way) with a page for every token after it, each copy's source in
        the block table and its destination not. Anything else (a daemon that broke its
        contract) must never reach vLLM's hooks as an exception: the caller drops the
        request from kvcore instead."""
        if isinstance(answer, Extension):
            pages = len(self.pages) + len(answer.new_pages)
            table = set(self.pages)
            return (
                self.phase in HOLDING
                and self.extending > 0
                and pages * page_size >= self.capacity + self.extending
                and all(src in table and dst not in table for src, dst in answer.copies)
            )
        return (
            self.phase is Phase.ASKED
            and len(answer.pages) * page_size >= self.asked_tokens
            and 0 <= answer.num_cached_tokens <= self.asked_tokens
        )

    def extended(self, ext: Extension) -> None:
        """The sequence grew by the ``extending`` tokens asked (an answer that
        :meth:`fits`): its new pages, and the copy-on-write of its (partial, unsaved)
        last page if it was shared."""
        where = {page: i for i, page in enumerate(self.pages)}
        for src, dst in ext.copies:
            self.pages[where[src]] = dst
        self.pages += ext.new_pages
        self.capacity += self.extending
        self.extending = 0

    def check(self, page_size: int) -> None:
        """The record's invariants (AssertionError naming the broken one)."""
        assert (self.seq != 0) == (self.phase in WITH_SEQUENCE), self
        assert not self.loads or self.phase is Phase.RUNNING, self
        assert self.phase is not Phase.FINISHED or self.in_flight > 0, self
        assert not self.in_flight or self.phase in HOLDING, self
        if self.phase in HOLDING:
            assert self.hit <= self.confirmed <= self.scheduled <= len(self.pages), self
            assert self.capacity <= len(self.pages) * page_size, self
            assert self.limit % page_size == 0, self


@dataclass(frozen=True, slots=True)
class Reach:
    """How far kvcore may go into a request, in tokens (whole pages): what this engine's
    role lets it load (``loads``: not a ``kv_producer``) and save (``saves``: not a
    ``kv_consumer``; ``save_generated``: past the prompt too)."""

    page_size: int
    loads: bool
    saves: bool
    save_generated: bool

    def limit(self, request: Request) -> int:
        """The pages below it are the most this request may save (its prompt's, or every
        page its ``max_tokens`` can fill)."""
        prompt = len(request.prompt_token_ids or ())
        limit = 0
        if self.saves and self.save_generated:  # the last token sampled has no K/V
            limit = prompt + (getattr(request, "max_tokens", None) or 1 << 40) - 1
        elif self.saves:
            limit = prompt
        return limit // self.page_size * self.page_size

    def loadable(self, request: Request) -> int:
        """The most a hit may cover (never the last token, whose forward produces the
        next one); 0 for an engine that does not load."""
        if not self.loads:
            return 0
        return (len(tokens_of(request)) - 1) // self.page_size * self.page_size

    def covered(self, request: Request, num_computed_tokens: int) -> bool:
        """Whether vLLM's own hit already holds every page kvcore could load into this
        request or save from it: then the daemon is not asked at all."""
        return num_computed_tokens >= max(self.loadable(request), self.limit(request))


@dataclass(slots=True)
class KeySpaces:
    """The key space of each request on the daemon (spec/hashing.md): the session's
    namespace (None), the engine's ``model`` identity (:mod:`kvcore.integrations.identity`),
    the request's LoRA adapter (:func:`adapter_key`) and its ``cache_salt``. Changed only
    by the scheduler side (its adapter keys, remembered per adapter)."""

    model: str
    _adapters: dict[tuple[int, str, str], str] = field(default_factory=dict)

    def of(self, request: Request) -> KeySpace | None:
        """The request's key space; None if its tokens do not determine its K/V
        (multimodal inputs, prompt embeddings)."""
        if getattr(request, "prompt_embeds", None) is not None or getattr(
            request, "mm_features", None
        ):
            return None
        lora: LoRARequest | None = getattr(request, "lora_request", None)
        salt = getattr(request, "cache_salt", None) or ""
        return KeySpace(None, self.model, self._adapter(lora) if lora is not None else "", salt)

    def _adapter(self, lora: LoRARequest) -> str:
        """:func:`adapter_key`, computed once per adapter vLLM registered (its id, name and
        path): vLLM loads an adapter's files once under its id, so a retrain in place
        reaches the engine's K/V only under a new registration, which is keyed afresh."""
        ident = (lora.lora_int_id, lora.lora_name, lora.lora_path)
        key = self._adapters.get(ident)
        if key is None:
            if len(self._adapters) >= MAX_ADAPTERS:
                self._adapters.clear()
            key = self._adapters[ident] = adapter_key(lora.lora_name, lora.lora_path)
        return key


def adapter_key(name: str, path: str) -> str:
    """The ``lora`` part of a key space for vLLM's adapter ``name`` loaded from ``path``:
    ``name@files:<digest>`` of the adapter's files where ``path`` is a readable local file
    or directory (:func:`~kvcore.integrations.identity.path_weights`: relative names,
    sizes, ``mtime_ns``; two engines' adapters of one name but other weights, or one
    retrained in place, never share a page), else ``name@path`` (a hub id: vLLM resolves
    it on its workers). At most :data:`~kvcore.prefix.MAX_KEY_PART_BYTES` bytes: a longer
    one is its name's start and the SHA-256 of the whole. vLLM-format events carry this
    string in ``lora_name`` (``kvcore_ipc.vllm_events.lora_name_of``)."""
    local = Path(path)
    weights = path
    try:
        if path and local.exists():
            weights = path_weights(local)
    except OSError as exc:
        log.info("kvcore: adapter %r at %r: %s; keyed by its path", name, path, exc)
    key = f"{name}@{weights}"
    if len(key.encode()) <= MAX_KEY_PART_BYTES:
        return key
    digest = hashlib.sha256(key.encode()).hexdigest()
    head = name.encode()[: MAX_KEY_PART_BYTES - len(digest) - 8].decode(errors="ignore")
    return f"{head}@sha256:{digest}"


def tokens_of(request: Request) -> list[int]:
    """Every token of the request so far (prompt, then generated)."""
    tokens: Any = getattr(request, "all_token_ids", None)
    return list(tokens if tokens is not None else request.prompt_token_ids or ())
