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
    any            the link attached again (a new session)        (none): dropped whole

Records of one session only: on a re-attach every record is dropped at once (the
sequences died with the old session); the loads a RUNNING record had queued for the
next plan become load errors (vLLM recomputes those blocks).

Pages and tokens: ``pages``, ``hit``, ``confirmed``, ``scheduled`` count pages of
``page_size`` tokens from the request's first token; ``capacity``, ``limit``,
``local_hit`` and ``asked_tokens`` count tokens.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from kvcore.results import Allocation, Extension


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
    confirmed: int = 0  # leading pages kvcore holds now: hit, then reported saves
    scheduled: int = 0  # leading pages held or with a save in a sent plan
    in_flight: int = 0  # sent plans with a copy of this request, not yet reported
    extending: int = 0  # tokens of the extend on its way (0: none)
    passes: int = 0  # HELD: scheduling passes since it was answered
    loads: list[tuple[int, int]] = field(default_factory=list)  # RUNNING: (page, block) to plan

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

    def extended(self, ext: Extension) -> None:
        """The sequence grew by the ``extending`` tokens asked: its new pages, and the
        copy-on-write of its (partial, unsaved) last page if it was shared."""
        for src, dst in ext.copies:
            self.pages[self.pages.index(src)] = dst
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


def identity(request: Request) -> tuple[str, str] | None:
    """The request's key space on the daemon, ``(salt, lora)``; None if its tokens do
    not determine its K/V (multimodal inputs, prompt embeddings)."""
    if getattr(request, "prompt_embeds", None) is not None or getattr(request, "mm_features", None):
        return None
    lora = getattr(request, "lora_request", None)
    return getattr(request, "cache_salt", None) or "", lora.lora_name if lora is not None else ""


def tokens_of(request: Request) -> list[int]:
    """Every token of the request so far (prompt, then generated)."""
    tokens: Any = getattr(request, "all_token_ids", None)
    return list(tokens if tokens is not None else request.prompt_token_ids or ())
