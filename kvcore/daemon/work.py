"""Bounded work: what one request may cost (``max_request_tokens``), priced as it runs.

A request's work is the tokens its ops carry, add or copy (each op's ``work``,
kvcore/ops.py). Two checks hold it to ``limit`` tokens:

* before anything runs, the tokens the request *carries* (its token lists,
  :func:`kvcore.ops.carried`), summed over a batch: a frame that is too heavy by
  itself is ``bad_request`` whole, nothing run;
* just before each op runs, its ``work`` read from the books *as they are then*
  (:meth:`WorkBudget.charge`): an op that would take the request past ``limit``
  is ``bad_request``, the ops before it having run (a batch is not atomic:
  the first failing op stops it).

Pricing as the ops run is what makes the bound hold for ops whose cost depends
on earlier ones: in a batch of chained forks (each child forked from the one
before, all created inside the batch) every fork copies the whole block table,
which a price taken before the batch ran (the children not yet on the books)
counted as nothing. Since an op's work is at least what it carries, the first
check never refuses a request the second would let through.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvcore_ipc import messages as msg

from kvcore.errors import BadRequest
from kvcore.ops import Books, Operation, carried


def check_carried(bodies: Iterable[msg.BatchOp], limit: int) -> None:
    """BadRequest if ``bodies`` (one request's ops) carry more than ``limit`` tokens."""
    tokens = 0
    for body in bodies:  # a loop, not sum(): this runs for every op of every batch
        tokens += carried(body)
    if tokens > limit:
        raise BadRequest(
            f"this request carries {tokens} tokens, more than {limit} "
            f"(max_request_tokens): split it"
        )


@dataclass(slots=True)
class WorkBudget:
    """The work one request has done so far (tokens); :meth:`charge` before each op."""

    limit: int  # max_request_tokens; fixed
    spent: int = 0  # tokens of work of the ops charged so far; only charge() changes it

    def charge(self, op: Operation[Any, Any], body: msg.BatchOp, books: Books) -> None:
        """Count ``body``'s work (``op.work`` against the books now, just before it runs);
        BadRequest, counting nothing, if that takes the request over ``limit``."""
        work = self.spent + op.work(body, books)
        if work > self.limit:
            raise BadRequest(
                f"this request is {work} tokens of work with this op, more than "
                f"{self.limit} (max_request_tokens): split it"
            )
        self.spent = work
