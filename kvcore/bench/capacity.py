"""``kvcore bench capacity``: how many sequences one memory budget serves.

The trace (kvcore.bench.trace) is replayed, step by step, against one fixed
pool under three policies:

    contiguous    reserves prompt + max_new_tokens (2048) token slots per request
                  on admission, as an engine without paging must (no Manager)
    paged         Manager.allocate for the prompt, Manager.extend one token a step
    paged_prefix  as paged, plus the shared prefix cache: allocation reuses
                  committed pages; full pages are committed as they fill (the
                  prompt's after its prefill step); finished sequences' committed
                  pages stay cached until evicted

One step, as a vLLM-style scheduler runs it (docs/benchmarks.md states it too)::

    1 arrivals join the back of the waiting queue
    2 decode: every running sequence (oldest first) grows by one token; when the
      pool has no page, the newest running sequence is preempted (freed, put back
      at the front of the queue, recomputed on readmission) until it fits
    3 admission, FCFS, only in a step without preemption: the queue head is
      prefilled (prompt + tokens generated before a preemption) while it fits
      and the pool keeps ``watermark`` of its pages free; the first that does
      not fit blocks the queue
    4 the batch runs: each scheduled sequence produces one token; commits
      (paged_prefix); finished sequences are freed

Units: tokens and pages as named; a "step" is one engine iteration.
"""

from __future__ import annotations

import argparse
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvcore.bench.trace import Request, Trace, TraceConfig, make_trace, optimal_hit_tokens
from kvcore.errors import BadRequest, OutOfPages
from kvcore.layout import KVLayout
from kvcore.manager import Manager

POLICIES = ("contiguous", "paged", "paged_prefix")
GIB = 1 << 30


class Pool(Protocol):
    """The memory side of one policy. ``rid`` names a live sequence."""

    def admit(self, rid: int, tokens: Sequence[int], num_running: int) -> int | None:
        """Start ``rid`` holding ``tokens``; tokens served from cache, or None if it does not fit."""

    def grow(self, rid: int) -> bool:
        """One more token; False (and no change) if the pool has no room."""

    def release(self, rid: int) -> None: ...

    def publish(self, rid: int, tokens: Sequence[int]) -> None:
        """Commit the full pages of ``tokens`` (the sequence's tokens so far)."""

    def fork(self, parent: int, child: int) -> None: ...

    def held(self) -> tuple[int, int]:
        """(token slots reserved, pages held) by live sequences."""

    @property
    def page_size(self) -> int:
        """Tokens per page (the unit of publishing)."""


@dataclass(slots=True)
class ContiguousPool:
    """Token-slot reservation of prompt + max_new_tokens per sequence, no fragmentation
    counted (which favours this policy)."""

    budget_tokens: int
    max_new_tokens: int
    tokens_per_page: int  # only to express reservations in pages
    reserved: int = 0
    _of: dict[int, int] = field(default_factory=dict)

    def admit(self, rid: int, tokens: Sequence[int], num_running: int) -> int | None:
        need = len(tokens) + self.max_new_tokens
        if self.reserved + need > self.budget_tokens:
            return None
        self._of[rid] = need
        self.reserved += need
        return 0

    def grow(self, rid: int) -> bool:
        return True  # the reservation covers the whole output

    def release(self, rid: int) -> None:
        self.reserved -= self._of.pop(rid)

    def publish(self, rid: int, tokens: Sequence[int]) -> None:
        pass  # no prefix cache

    def fork(self, parent: int, child: int) -> None:
        raise BadRequest("the contiguous policy cannot fork")

    def held(self) -> tuple[int, int]:
        return self.reserved, -(-self.reserved // self.tokens_per_page)

    @property
    def page_size(self) -> int:
        return self.tokens_per_page


@dataclass(slots=True)
class PagedPool:
    """A Manager; with ``prefix`` the admission looks up and publishing commits."""

    manager: Manager
    prefix: bool
    watermark_pages: int

    def admit(self, rid: int, tokens: Sequence[int], num_running: int) -> int | None:
        mgr = self.manager
        cached = mgr.lookup(tokens) if self.prefix else 0
        need = mgr.layout.pages_for(len(tokens)) - cached // mgr.layout.page_size
        stats = mgr.stats()
        spare = stats.free_pages + stats.evictable_pages - need
        if spare < 0 or (num_running > 0 and spare < self.watermark_pages):
            return None
        try:
            return mgr.allocate(rid, tokens).num_cached_tokens
        except OutOfPages:  # a hit page was evictable: pinning it left too few
            return None

    def grow(self, rid: int) -> bool:
        try:
            self.manager.extend(rid, 1)
        except OutOfPages:
            return False
        return True

    def release(self, rid: int) -> None:
        self.manager.free(rid)

    def publish(self, rid: int, tokens: Sequence[int]) -> None:
        if self.prefix:
            self.manager.commit(rid, tokens)

    def fork(self, parent: int, child: int) -> None:
        self.manager.fork(parent, child)

    def held(self) -> tuple[int, int]:
        pages = self.manager.stats().held_pages
        return pages * self.manager.layout.page_size, pages

    @property
    def page_size(self) -> int:
        return self.manager.layout.page_size


@dataclass(slots=True)
class _Live:
    req: Request
    generated: int = 0  # output tokens produced so far; the pool holds prompt + generated - 1


@dataclass(slots=True)
class RunStats:
    """Figures of one replay. Sums over steps; ``sat`` = steps with a request waiting
    after admission (memory, not demand, bounded the batch)."""

    steps: int = 0
    sat_steps: int = 0
    sum_running: int = 0
    sum_running_sat: int = 0
    peak_running: int = 0
    sum_stored: int = 0  # tokens the live sequences hold (logical, per sequence)
    sum_reserved: int = 0  # token slots reserved (contiguous) or in held pages
    sum_pages: int = 0
    sum_pages_sat: int = 0
    preemptions: int = 0
    recompute_tokens: int = 0  # prefill tokens computed again after a preemption
    generated_tokens: int = 0
    finished: int = 0
    first_admitted: dict[int, int] = field(default_factory=dict)  # rid -> step
    first_hit_tokens: dict[int, int] = field(default_factory=dict)  # rid -> cached tokens

    def summary(self) -> dict[str, Any]:
        """Means over saturated steps (None if there were none) and over all steps."""
        sat = self.sat_steps or None
        return {
            "mean_concurrency": self.sum_running_sat / sat if sat else None,
            "mean_concurrency_all_steps": self.sum_running / max(self.steps, 1),
            "peak_concurrency": self.peak_running,
            "utilization": self.sum_stored / self.sum_reserved if self.sum_reserved else 0.0,
            "mean_pages_held": self.sum_pages_sat / sat if sat else None,
            "mean_pages_held_all_steps": self.sum_pages / max(self.steps, 1),
            "pages_per_sequence": self.sum_pages_sat / self.sum_running_sat if sat else None,
            "steps": self.steps,
            "saturated_steps": self.sat_steps,
            "tokens_per_step": self.generated_tokens / max(self.steps, 1),
            "preemptions": self.preemptions,
            "recompute_tokens": self.recompute_tokens,
            "finished": self.finished,
        }


def simulate(
    trace: Trace,
    pool: Pool,
    *,
    fork_every: int = 0,
    on_step: Callable[[int], None] | None = None,
) -> RunStats:
    """Replay ``trace`` on ``pool`` until every request has finished (module docstring).

    ``fork_every`` > 0 forks every such-numbered request right after its first
    prefill into a second sample (ops benchmark only; child id = rid + number of
    requests, output tokens shifted by one). ``on_step(step)`` runs after each step.
    BadRequest if a request does not fit even the empty pool (see :func:`check_fits`).
    """
    n = len(trace.requests)
    vocab = trace.config.vocab_size
    pending = deque(trace.requests)
    waiting: deque[_Live] = deque()
    running: list[_Live] = []
    stats = RunStats()
    page_size = pool.page_size
    step = 0
    while pending or waiting or running:
        while pending and pending[0].arrival_step <= step:
            waiting.append(_Live(pending.popleft()))
        preempted = False
        i = 0
        while i < len(running):  # decode
            live = running[i]
            if pool.grow(live.req.rid):
                i += 1
                continue
            victim = running.pop()
            pool.release(victim.req.rid)
            waiting.appendleft(victim)
            stats.preemptions += 1
            preempted = True
        fresh: set[int] = set()
        while not preempted and waiting:  # admission
            live = waiting[0]
            tokens = live.req.prompt + live.req.output[: live.generated]
            cached = pool.admit(live.req.rid, tokens, len(running))
            if cached is None:
                break
            waiting.popleft()
            running.append(live)
            fresh.add(live.req.rid)
            if live.generated:
                stats.recompute_tokens += len(tokens) - cached
            elif live.req.rid < n:
                stats.first_admitted[live.req.rid] = step
                stats.first_hit_tokens[live.req.rid] = cached
                if fork_every and live.req.rid % fork_every == 0:
                    child = _fork_request(live.req, n, vocab)
                    pool.fork(live.req.rid, child.rid)
                    running.append(_Live(child))
                    fresh.add(child.rid)
        if not running and waiting and not preempted:
            raise BadRequest(
                f"request {waiting[0].req.rid} does not fit the empty pool; it would wait forever"
            )
        _record(stats, pool, running, waiting)
        still: list[_Live] = []
        for live in running:  # the batch runs
            live.generated += 1
            stats.generated_tokens += 1
            held = len(live.req.prompt) + live.generated - 1
            if live.req.rid in fresh or held % page_size == 0:
                pool.publish(live.req.rid, live.req.prompt + live.req.output[: live.generated - 1])
            if live.generated == len(live.req.output):
                pool.release(live.req.rid)
                stats.finished += 1
            else:
                still.append(live)
        running = still
        if on_step is not None:
            on_step(step)
        step += 1
    return stats


def _fork_request(req: Request, offset: int, vocab: int) -> Request:
    output = tuple((t + 1) % vocab for t in req.output)
    return Request(req.rid + offset, req.arrival_step, req.prompt, output, req.prefix_id)


def _record(stats: RunStats, pool: Pool, running: list[_Live], waiting: deque[_Live]) -> None:
    count = len(running)
    reserved, pages = pool.held()
    stats.steps += 1
    stats.sum_running += count
    stats.peak_running = max(stats.peak_running, count)
    stats.sum_stored += sum(len(live.req.prompt) + live.generated for live in running)
    stats.sum_reserved += reserved
    stats.sum_pages += pages
    if waiting:
        stats.sat_steps += 1
        stats.sum_running_sat += count
        stats.sum_pages_sat += pages


# -- the benchmark -------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("trace")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--requests", type=int, default=500, help="requests per trace")
    g.add_argument("--arrival-rate", type=float, default=1.0, help="mean arrivals per step")
    g.add_argument("--shared-fraction", type=float, default=0.6,
                   help="share of requests with a shared prefix in the shared-prefix variant")
    g.add_argument("--num-prefixes", type=int, default=4)
    g.add_argument("--max-new-tokens", type=int, default=2048, help="serving limit")
    g = parser.add_argument_group("pool")
    g.add_argument("--budget-gib", type=float, default=4.0, help="KV memory budget, GiB")
    g.add_argument("--num-pages", type=int, default=0, help="pages (overrides --budget-gib)")
    g.add_argument("--page-size", type=int, default=16, help="tokens per page")
    g.add_argument("--layers", type=int, default=32)
    g.add_argument("--kv-heads", type=int, default=8)
    g.add_argument("--head-dim", type=int, default=128)
    g.add_argument("--dtype", default="bfloat16")
    g.add_argument("--watermark", type=float, default=0.01,
                   help="fraction of pages admission keeps free (vLLM's default 1%%)")


def layout_from_args(args: argparse.Namespace) -> KVLayout:
    dims = {"num_layers": args.layers, "num_kv_heads": args.kv_heads,
            "head_dim": args.head_dim, "page_size": args.page_size, "dtype": args.dtype}
    if args.num_pages:
        return KVLayout(num_pages=args.num_pages, **dims)
    return KVLayout.for_budget(int(args.budget_gib * GIB), **dims)


def traces_from_args(args: argparse.Namespace) -> tuple[Trace, Trace]:
    """(plain trace, shared-prefix variant), same seed."""
    common = {"num_requests": args.requests, "seed": args.seed, "arrival_rate": args.arrival_rate,
              "max_new_tokens": args.max_new_tokens, "num_prefixes": args.num_prefixes}
    return (make_trace(TraceConfig(**common)),
            make_trace(TraceConfig(shared_fraction=args.shared_fraction, **common)))


def make_pool(policy: str, layout: KVLayout, *, max_new_tokens: int, watermark: float) -> Pool:
    if policy == "contiguous":
        return ContiguousPool(layout.token_capacity, max_new_tokens, layout.page_size)
    if policy not in POLICIES:
        raise BadRequest(f"unknown policy {policy!r}; one of {POLICIES}")
    return PagedPool(Manager(layout), policy == "paged_prefix", int(watermark * layout.num_pages))


def check_fits(trace: Trace, layout: KVLayout, max_new_tokens: int) -> None:
    """BadRequest unless every request fits an empty pool under every policy."""
    longest = max(len(r.prompt) + len(r.output) for r in trace.requests)
    contiguous = max(len(r.prompt) for r in trace.requests) + max_new_tokens
    if max(longest, contiguous) > layout.token_capacity:
        raise BadRequest(
            f"a request needs {max(longest, contiguous)} token slots; the pool holds "
            f"{layout.token_capacity}: raise --budget-gib or --num-pages"
        )


def no_eviction_layout(trace: Trace, layout: KVLayout) -> KVLayout:
    """A pool that holds every page the trace ever allocates: nothing is evicted,
    nobody waits or is preempted."""
    pages = sum(layout.pages_for(len(r.prompt) + len(r.output)) for r in trace.requests)
    return KVLayout(layout.num_layers, layout.num_kv_heads, layout.head_dim,
                    layout.page_size, layout.dtype, pages)


def replay(
    trace: Trace, layout: KVLayout, policy: str, *, max_new_tokens: int, watermark: float
) -> tuple[RunStats, dict[str, Any]]:
    """One policy on one trace: run stats, and the summary object of the report."""
    pool = make_pool(policy, layout, max_new_tokens=max_new_tokens, watermark=watermark)
    stats = simulate(trace, pool)
    summary = stats.summary()
    if isinstance(pool, PagedPool):
        pool.manager.check_integrity()
        mstats = pool.manager.stats()
        assert mstats.num_sequences == 0 and mstats.held_pages == 0, "a sequence leaked"
        summary["evictions"] = mstats.evictions
        summary["cached_pages_at_end"] = mstats.cached_pages
        if pool.prefix:
            prompt = sum(len(r.prompt) for r in trace.requests)
            summary["hit_tokens"] = sum(stats.first_hit_tokens.values())
            summary["hit_rate"] = summary["hit_tokens"] / prompt
            summary["hit_rate_all_allocations"] = mstats.hit_rate
    return stats, summary


def run(args: argparse.Namespace) -> dict[str, Any]:
    layout = layout_from_args(args)
    plain, shared = traces_from_args(args)
    for trace in (plain, shared):
        check_fits(trace, layout, args.max_new_tokens)
    opts = {"max_new_tokens": args.max_new_tokens, "watermark": args.watermark}
    report: dict[str, Any] = {}
    variants: dict[str, dict[str, Any]] = {}
    fixed_prefix_stats: RunStats | None = None
    runs = (("plain", plain, POLICIES[:2]), ("shared_prefix", shared, POLICIES))
    for name, trace, policies in runs:  # the prefix cache has nothing to share on "plain"
        variants[name] = {}
        for policy in policies:
            stats, variants[name][policy] = replay(trace, layout, policy, **opts)
            if name == "shared_prefix" and policy == "paged_prefix":
                fixed_prefix_stats = stats
    assert fixed_prefix_stats is not None
    big = no_eviction_layout(shared, layout)
    no_evict = {policy: replay(shared, big, policy, **opts)[1] for policy in POLICIES[1:]}
    for summary in no_evict.values():
        assert summary["evictions"] == 0 and summary["preemptions"] == 0, "the big pool evicted"

    prompt_tokens = shared.prompt_tokens
    arrivals = {r.rid: r.arrival_step for r in shared.requests}
    optimal = sum(optimal_hit_tokens(shared.requests, arrivals, layout.page_size).values())
    optimal_fixed = sum(optimal_hit_tokens(
        shared.requests, fixed_prefix_stats.first_admitted, layout.page_size).values())
    p_plain, c_plain = variants["plain"]["paged"], variants["plain"]["contiguous"]
    report["concurrency_ratio"] = _ratio(p_plain["mean_concurrency"], c_plain["mean_concurrency"])
    report["utilization_paged"] = p_plain["utilization"]
    report["pages_saved_fraction"] = 1.0 - (
        no_evict["paged_prefix"]["mean_pages_held_all_steps"]
        / no_evict["paged"]["mean_pages_held_all_steps"]
    )
    report["hit_rate"] = no_evict["paged_prefix"]["hit_rate"]
    report["hit_rate_optimal"] = optimal / prompt_tokens
    report["hit_tokens"] = no_evict["paged_prefix"]["hit_tokens"]
    report["hit_tokens_optimal"] = optimal
    report["prompt_tokens"] = prompt_tokens
    report["hit_rate_fixed_budget"] = variants["shared_prefix"]["paged_prefix"]["hit_rate"]
    report["hit_rate_optimal_fixed_schedule"] = optimal_fixed / prompt_tokens
    s_paged, s_prefix = variants["shared_prefix"]["paged"], variants["shared_prefix"]["paged_prefix"]
    s_contig = variants["shared_prefix"]["contiguous"]
    report["shared_prefix_concurrency_ratio"] = _ratio(
        s_paged["mean_concurrency"], s_contig["mean_concurrency"])
    report["shared_prefix_prefix_vs_paged_concurrency"] = _ratio(
        s_prefix["mean_concurrency"], s_paged["mean_concurrency"])
    per_seq = _ratio(s_prefix["pages_per_sequence"], s_paged["pages_per_sequence"])
    report["pages_saved_per_sequence_fixed_budget"] = None if per_seq is None else 1.0 - per_seq
    report["config"] = {
        "layout": layout.to_dict(),
        "budget_bytes": layout.total_bytes,
        "token_capacity": layout.token_capacity,
        "no_eviction_pages": big.num_pages,
        "requests": args.requests,
        "seed": args.seed,
        "arrival_rate": args.arrival_rate,
        "shared_fraction": args.shared_fraction,
        "watermark": args.watermark,
        "max_new_tokens": args.max_new_tokens,
        "mean_prompt_tokens": {"plain": plain.prompt_tokens / args.requests,
                               "shared_prefix": shared.prompt_tokens / args.requests},
        "mean_output_tokens": {"plain": plain.output_tokens / args.requests,
                               "shared_prefix": shared.output_tokens / args.requests},
        "prefix_lengths": [len(p) for p in shared.prefixes],
    }
    report["plain"] = variants["plain"]
    report["shared_prefix"] = variants["shared_prefix"]
    report["no_eviction"] = no_evict
    return report


def _ratio(num: float | None, den: float | None) -> float | None:
    """num / den; None (JSON null) when a policy never saturated the pool, so the
    figure would measure demand, not capacity."""
    if num is None or den is None or den == 0:
        return None
    return num / den
