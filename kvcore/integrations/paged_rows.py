"""Engine-side bookkeeping of one generate call on a kvcore pool: rows, pages, step plans.

This module knows the Client and the backend's table formats, not transformers.
:class:`PagedRows` turns the token ids of each forward pass into the daemon
operations of that step (at most one ``Client.batch()`` round trip) and a
:class:`StepPlan`: the int tensors of that step, which the backend's
``plan_decode``/``plan_prefill`` validate once for every layer.

Coordinates. A batch is ``B`` rows, left-padded to ``L`` columns: row ``b``
holds ``pad[b]`` padding columns, then its ``n[b]`` real tokens. Only real
tokens reach the pool: token ``r`` of a row sits in slot
``pages[r // page_size] * page_size + r % page_size``. The first forward may
skip the leading ``skip`` columns, when every row's skipped tokens lie in its
prefix hit::

    columns      0 .. pad[b]-1 | pad[b] ..                      L-1
    row b        padding       | real tokens 0 .. n[b]-1
    hit          (pages committed earlier)   [0, hit[b])         never written
    skip         columns [0, skip) not fed:  skip <= pad[b] + hit[b] for every b
    queries      real tokens [max(0, skip - pad[b]), n[b]) attend; the rest of
                 the fed columns (padding) get a zero output

Rows with the same real tokens (``num_return_sequences`` copies, or repeated
prompts) form a group: the first row's sequence is allocated, the others are
forks of it (pages shared; copy-on-write of the last page at their first
extend). In the first forward only the group's first row writes K/V; every row
of the group reads the same pages.

Invariants between steps: ``row.pages`` mirrors the daemon's block table of
``row.seq``; ``row.num_written <= len(row.tokens)`` tokens hold K/V in every
layer; pages ``[0, row.num_committed)`` are published. Any failed operation
leaves the object *broken*: :meth:`close` then frees what is live, and
nothing else may be called.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvcore.errors import BadRequest, BatchFailed, KVCoreError
from kvcore.layout import cdiv
from kvcore.prefix import KeySpace
from kvcore.results import Allocation, Extension

if TYPE_CHECKING:
    import torch

    from kvcore.client import Client


@dataclass(slots=True)
class Row:
    """One batch row: one daemon sequence. Changed only by :class:`PagedRows`."""

    seq: int  # sequence id in the pool (random 63-bit: ids are pool-wide)
    pad: int  # padding columns of the first forward
    tokens: list[int]  # real tokens fed so far (prompt, then one per decode step)
    parent: int  # row index of its group's first row (itself for a first row)
    pages: list[int] = field(default_factory=list)  # mirror of the daemon's block table
    hit: int = 0  # prompt tokens served from the prefix cache (a multiple of page_size)
    sources: list[tuple[str, int]] = field(default_factory=list)  # where the hit was when
    # asked (Allocation.sources: runs of (medium, tokens); []: all in the pool)
    num_written: int = 0  # tokens whose K/V are in the pages, in every layer
    num_committed: int = 0  # leading pages published to the prefix index
    reserved: int = 0  # the daemon's num_tokens for seq: >= len(tokens), pages reserved ahead


@dataclass(slots=True)
class StepPlan:
    """What every layer of one forward needs. Tensors live on the pool's device.

    ``slots`` [B * q] int64: where the K/V of each fed column go (-1: not written).
    ``block_table`` [B, max_pages] int32, ``seq_lens`` [B] int32 (tokens after this
    step). Decode steps (q == 1) use ``decode``; others use ``prefill`` with
    ``cu_seqlens_q`` [B + 1] int32 and ``q_index`` [total_q] int64, the rows of the
    flattened [B * q] query grid that are real queries (``None``: all of them).
    ``copies`` (src, dst) int64 page pairs run before the writes of each layer.
    """

    batch: int
    q: int
    slots: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor | None = None
    q_index: torch.Tensor | None = None
    copies: tuple[torch.Tensor, torch.Tensor] | None = None
    layers_written: int = 0  # counted by the cache's update (every layer must write)

    @property
    def decode(self) -> bool:
        return self.cu_seqlens_q is None


class PagedRows:
    """The rows of one generate call, bound to one Client session; every row is
    allocated in key space ``space`` (a None namespace: the session's). The space has
    no default: its ``model`` is what keeps another model's pages out of the rows."""

    def __init__(self, client: Client, device: torch.device, space: KeySpace) -> None:
        self.client = client
        self.space = space
        self.page_size = client.layout.page_size
        self.device = device
        self.rows: list[Row] = []
        self.live: set[int] = set()  # sequence ids the daemon holds for us
        self.broken = False
        self.closed = False
        self._last_table: torch.Tensor | None = None

    # -- the first forward ----------------------------------------------------------

    def start(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> tuple[int, StepPlan]:
        """Allocate (with prefix hits) and fork the rows of the first forward.

        ``input_ids`` [B, L] int, ``attention_mask`` [B, L] of 0/1 (left padding only)
        or None. Returns ``skip``, the leading columns the forward need not feed, and
        the plan for the columns ``[skip, L)``.
        """
        assert not self.rows, "start() runs once"
        batch, length = input_ids.shape
        pads = _left_pads(attention_mask, batch, length)
        ids = input_ids.tolist()
        group_of: dict[tuple[int, ...], int] = {}
        for b in range(batch):
            tokens = ids[b][pads[b] :]
            parent = group_of.setdefault(tuple(tokens), b)
            self.rows.append(Row(secrets.randbits(63), pads[b], tokens, parent))
        ops = self.client.batch()
        for b, row in enumerate(self.rows):
            if row.parent == b:
                ops.allocate(row.seq, row.tokens, self.space)
            else:
                ops.fork(self.rows[row.parent].seq, row.seq)
        results = self._run(ops, [row.seq for row in self.rows])
        for row, result in zip(self.rows, results, strict=True):
            if isinstance(result, Allocation):
                row.pages, row.hit = list(result.pages), result.num_cached_tokens
                row.num_committed = result.num_cached_tokens // self.page_size
                row.sources = list(result.sources)
            else:
                first = self.rows[row.parent]
                row.pages, row.hit, row.num_committed = list(result), first.hit, first.num_committed
                row.sources = first.sources
            row.reserved = len(row.tokens)
        skip = min(row.pad + row.hit for row in self.rows)
        return skip, self._prefill_plan(skip, length)

    def _prefill_plan(self, skip: int, length: int) -> StepPlan:
        import torch

        q = length - skip
        slots: list[int] = []
        q_index: list[int] = []
        q_lens: list[int] = []
        for b, row in enumerate(self.rows):
            writes = row.parent == b
            for col in range(skip, length):
                r = col - row.pad  # real token index; < 0 is padding
                writes_here = writes and r >= row.hit
                slots.append(self._slot(row, r) if r >= 0 and writes_here else -1)
            start = max(skip, row.pad)
            q_index.extend(range(b * q + start - skip, (b + 1) * q))
            q_lens.append(length - start)
        cu = [0]
        for n in q_lens:
            cu.append(cu[-1] + n)
        dev = self.device
        everything = len(q_index) == len(self.rows) * q
        return StepPlan(
            batch=len(self.rows),
            q=q,
            slots=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_table=self._table(),
            seq_lens=torch.tensor(
                [len(r.tokens) for r in self.rows], dtype=torch.int32, device=dev
            ),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            q_index=None if everything else torch.tensor(q_index, dtype=torch.int64, device=dev),
        )

    # -- later forwards ---------------------------------------------------------------

    def step(self, new_tokens: Sequence[Sequence[int]]) -> StepPlan:
        """Plan a forward that feeds ``q`` new real tokens per row.

        A round trip happens only when some row needs room. It then reserves ahead for
        the whole batch: every row that would need room within the next
        ``page_size - 1`` steps of ``q`` tokens is extended to the end of the page
        holding its token ``len(tokens) + q + page_size - 2`` (at most one page past
        the one its last new token needs), so decoding a batch of any shape costs at
        most one round trip every ``page_size`` steps, not one per page crossing of
        any row. In the same batch every row's full written pages not yet published
        are committed. Reserved pages past ``len(tokens)`` hold no K/V: they are
        never committed (commits stop at ``num_written``) nor read (``seq_lens``
        stops there), and :meth:`close` frees them with their sequence. The first
        extend after a fork returns the copy-on-write of the shared last page."""
        import torch

        if len(new_tokens) != len(self.rows):
            raise BadRequest(
                f"the kvcore cache holds {len(self.rows)} rows; this forward feeds "
                f"{len(new_tokens)} (beam search and batch reshaping are not supported)"
            )
        q = len(new_tokens[0])
        src: list[int] = []
        dst: list[int] = []
        growing = any(len(row.tokens) + q > row.reserved for row in self.rows)
        if growing:  # the round trip also serves every row due within page_size steps
            horizon = q + self.page_size - 1
            due = [row for row in self.rows if len(row.tokens) + horizon > row.reserved]
            self._grow(due, horizon, src, dst)
        slots: list[int] = []
        for row, tokens in zip(self.rows, new_tokens, strict=True):
            start = len(row.tokens)
            row.tokens.extend(tokens)
            assert len(row.tokens) <= len(row.pages) * self.page_size, "a token without a page"
            slots.extend(self._slot(row, r) for r in range(start, start + q))
        dev = self.device
        plan = StepPlan(
            batch=len(self.rows),
            q=q,
            slots=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_table=self._table() if growing or self._last_table is None else self._last_table,
            seq_lens=torch.tensor(
                [len(r.tokens) for r in self.rows], dtype=torch.int32, device=dev
            ),
        )
        self._last_table = plan.block_table
        if src:
            plan.copies = (
                torch.tensor(src, dtype=torch.int64, device=dev),
                torch.tensor(dst, dtype=torch.int64, device=dev),
            )
        if q > 1:  # several new tokens per row (a continuation): the prefill kernel
            plan.cu_seqlens_q = torch.arange(
                0, q * len(self.rows) + 1, q, dtype=torch.int32, device=dev
            )
        return plan

    def _grow(self, growing: list[Row], ahead: int, src: list[int], dst: list[int]) -> None:
        """One round trip: commits due on any row, then extends each of ``growing`` to
        the end of the page holding its token ``len(tokens) + ahead - 1``."""
        ops = self.client.batch()
        committing = [
            row for row in self.rows if row.num_written // self.page_size > row.num_committed
        ]
        for row in committing:
            _commit_new(ops, row, self.page_size)
        for row in growing:
            ops.extend(row.seq, _round_up(len(row.tokens) + ahead, self.page_size) - row.reserved)
        if committing:
            self._sync()  # the committed pages' writes must have landed before others read them
        results = self._run(ops)
        for row, published in zip(committing, results, strict=False):
            row.num_committed = published
        for row, ext in zip(growing, results[len(committing) :], strict=True):
            assert isinstance(ext, Extension), f"extend answered {ext!r}"
            for s, d in ext.copies:
                assert row.pages[-1] == s, f"copy-on-write of page {s}, last page {row.pages[-1]}"
                row.pages[-1] = d
                src.append(s)
                dst.append(d)
            row.pages.extend(ext.new_pages)
            row.reserved = _round_up(len(row.tokens) + ahead, self.page_size)

    def finish_step(self) -> None:
        """The forward completed: every fed token's K/V is in the pages of every layer."""
        for row in self.rows:
            row.num_written = len(row.tokens)

    # -- the end ----------------------------------------------------------------------

    def close(self) -> None:
        """Publish the full written pages (unless broken), then free every live sequence.
        Idempotent; never raises for a daemon that is gone."""
        if self.closed:
            return
        self.closed = True
        if not self.broken and self.rows:
            with contextlib.suppress(KVCoreError):
                ops = self.client.batch()
                for row in self.rows:
                    if row.num_written // self.page_size > row.num_committed:
                        _commit_new(ops, row, self.page_size)
                if len(ops):
                    self._sync()
                    ops.run()
        pending = sorted(self.live)
        while pending:
            ops = self.client.batch()
            for seq in pending:
                ops.free(seq)
            try:
                ops.run()
                pending = []
            except BatchFailed as exc:  # the failing free changed nothing; go on after it
                pending = pending[exc.batch_index + 1 :]
            except KVCoreError:  # refused as a whole, or the daemon is gone: give up
                pending = []
        self.live.clear()

    # -- helpers ----------------------------------------------------------------------

    def _run(self, ops: Any, creates: list[int] | None = None) -> list[Any]:
        """Run a batch; on error mark the rows broken, remember what was created, re-raise."""
        try:
            results: list[Any] = ops.run()
        except BaseException as exc:
            self.broken = True
            if creates is not None:
                # A failed op of the batch says how many ran before it; anything else
                # (a timeout, an interrupt) leaves it unknown, so every sequence may
                # exist, and close() frees them all (skipping unknown ones).
                ran = exc.batch_index if isinstance(exc, BatchFailed) else len(creates)
                self.live.update(creates[:ran])
            raise
        if creates is not None:
            self.live.update(creates)
        return results

    def _slot(self, row: Row, r: int) -> int:
        return row.pages[r // self.page_size] * self.page_size + r % self.page_size

    def _table(self) -> torch.Tensor:
        import torch

        width = max(len(row.pages) for row in self.rows)
        table = [row.pages + [0] * (width - len(row.pages)) for row in self.rows]
        return torch.tensor(table, dtype=torch.int32, device=self.device)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)


def _round_up(n: int, multiple: int) -> int:
    return cdiv(n, multiple) * multiple


def _left_pads(attention_mask: torch.Tensor | None, batch: int, length: int) -> list[int]:
    """Padding columns per row; BadRequest unless every row is [0]*pad + [1]*n with n >= 1."""
    if attention_mask is None:
        return [0] * batch
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (batch, length):
        raise BadRequest(
            f"attention_mask must be 2D [{batch}, {length}] for the kvcore cache, "
            f"got {list(attention_mask.shape)}"
        )
    mask = attention_mask.ne(0).long()
    counts = mask.sum(dim=1)
    pads = (length - counts).tolist()
    # a left-padded row is non-decreasing 0 ... 0 1 ... 1
    ordered = bool((mask[:, 1:] >= mask[:, :-1]).all()) if length > 1 else True
    if not ordered or min(counts.tolist()) < 1:
        raise BadRequest(
            "the kvcore cache needs left padding (each attention_mask row 0...0 1...1 with "
            "at least one 1); pass tokenizer(padding_side='left') or unpadded rows"
        )
    return [int(p) for p in pads]


def _commit_new(ops: Any, row: Row, page_size: int) -> None:
    """Queue the commit of ``row``'s written full pages, sending only the tokens after
    its committed pages (the protocol's ``start``: the wire carries only what is new)."""
    start = row.num_committed * page_size
    ops.commit(row.seq, row.tokens[start : row.num_written], start=start)
