"""Time to first token of the requests kvcore allocated, with and without a kvcore hit.

vLLM's ``vllm:time_to_first_token_seconds`` is not split by where the prompt came
from; the connector's ``vllm:kvcore_time_to_first_token_seconds`` is, by its
``kvcore_hit`` label ("true": kvcore supplied some of the request's prompt tokens,
vLLM's external hit; "false": none). Only requests that went through kvcore's
allocation (answered, then scheduled: a record HELD or RUNNING at
``update_state_after_alloc``) are timed: not those vLLM's own prefix cache covered
whole (never sent), nor those kvcore cannot key (multimodal, prompt embeddings), nor
those refused or missed (out of pages, the daemon gone).

The scheduler side sees neither the sampled token nor the front end, only steps. It
times a request from its ``arrival_time`` (vLLM's wall clock, ``time.time()``) to the
scheduler step after the one that scheduled its last prompt token::

    step k      build_connector_meta: num_computed + scheduled >= prompt -> done
    (forward k samples the first token; vLLM's front end reads it: vLLM's own TTFT)
    step k+1    build_connector_meta: observed, now - arrival_time
    or          request_finished before step k+1 (max_tokens 1; nothing else to run,
                so no step k+1 may ever come): observed there

That is within one scheduler step of vLLM's own figure: with synchronous scheduling,
step k+1 is planned right after step k's output was processed, so it is late by the
time between that output and the next ``schedule()``; with asynchronous scheduling,
step k+1 is planned while forward k still runs, so it may be early by up to that
forward. A request preempted before its first token is timed once, as it first
completes its prompt. O(1) per request per step; bounded by the requests between
their allocation and their first token.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.request import Request


@dataclass(slots=True)
class Waiting:
    """One timed request: vLLM's live object, whether kvcore supplied any of its prompt."""

    request: Request
    hit: bool


@dataclass(slots=True)
class FirstTokens:
    """The timed requests (vLLM request id -> :class:`Waiting`). Changed only by the
    scheduler side's thread."""

    waiting: dict[str, Waiting] = field(default_factory=dict)  # last prompt token to come
    done: dict[str, Waiting] = field(default_factory=dict)  # scheduled in the last step

    def start(self, request: Request, hit: bool) -> None:
        """Time ``request`` (vLLM scheduled it with its kvcore allocation): once, and only
        before its first output token (a preempted request scheduled again is not)."""
        req_id = request.request_id
        if len(request.output_token_ids) or req_id in self.waiting or req_id in self.done:
            return
        self.waiting[req_id] = Waiting(request, hit)

    def step(self, scheduled: Mapping[str, int], now: float) -> list[tuple[bool, float]]:
        """A scheduler step planned at ``now`` with ``scheduled`` (request id -> tokens
        this step, before vLLM counts them computed): (hit, seconds) of each request whose
        last prompt token the step before scheduled; those of this step are next."""
        observed = [(w.hit, now - w.request.arrival_time) for w in self.done.values()]
        self.done.clear()
        for req_id, n in scheduled.items():
            timed = self.waiting.get(req_id)
            if timed is None:
                continue
            request = timed.request
            if request.num_computed_tokens + n >= len(request.prompt_token_ids or ()):
                self.done[req_id] = self.waiting.pop(req_id)
        return observed

    def finished(self, req_id: str, now: float) -> tuple[bool, float] | None:
        """The request finished or was aborted: (hit, seconds) if its last prompt token
        was scheduled (its first token came with that step), else None; forgotten."""
        self.waiting.pop(req_id, None)
        timed = self.done.pop(req_id, None)
        return None if timed is None else (timed.hit, now - timed.request.arrival_time)
