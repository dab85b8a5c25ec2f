"""``kvcore bench tiers``: hit rates with lower tiers, and the cost of bringing pages back.

* hit rates: the shared-prefix trace (kvcore.bench.chat_trace) replayed one request
  at a time (allocate, commit its full pages, free) against the daemon's own
  code: a :class:`~kvcore.Manager` alone (``hit_rate_pool_only``), then a
  :class:`~kvcore.daemon.tiering.TieredManager` over a real pool tensor with a
  host tier (``hit_rate_pool_host``) and with host + disk tiers
  (``hit_rate_tiered``): evictions spill their bytes, hits below the pool are
  promoted into adopted pages inside allocate. The pool holds about
  1 / ``--working-set`` of the trace's distinct prompt pages; the host tier
  ``--host-factor`` x the pool; the disk tier the whole working set.
  ``hit_rate_optimal`` is :func:`~kvcore.bench.chat_trace.optimal_hit_tokens` for the
  same order (an unbounded cache). Rates are hit tokens / prompt tokens.
* bandwidth of the movers, each as a ratio of bytes/s over one plain copy of the
  same bytes (``copy_gib_s``), on a layout of realistic page size (1 MiB pages, 16
  layers, CPU pool, ``--promote-pages`` pages scattered over a pool of twice as many),
  for a layer-major pool (``LPKTH``: one run per page and layer) and a page-major
  one (``PLKTH``, figures ``*_page_major``: one run per page):
  ``promote_bandwidth_ratio``: host tier -> pool pages (``HostTier.promote``, what
  the TieredManager calls: each byte copied once); ``spill_bandwidth_ratio``: pool
  pages -> host tier (``HostTier.spill_from``, what a reply's evictions take: each
  byte copied once); ``staged_promote_bandwidth_ratio``: host tier -> staging batch
  -> pool (``get_many(out=)`` + ``scatter_pages``: what the disk and remote tiers pay
  after their read; it moves every byte twice, so its limit is about 0.5). All of
  them and the plain copy are timed in turns, best of ``--rounds`` rounds
  (:func:`_best_interleaved`): on a shared machine a burst of load then slows all of
  them instead of only one.
* remote (``--remote-master``/``--remote-metadata`` naming a running master):
  fetch time per page from the store vs the host tier; null without them.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvcore.bench.chat_trace import TraceConfig, make_trace, optimal_hit_tokens
from kvcore.bench.report import Figure, Target
from kvcore.daemon.tiering import TieredManager
from kvcore.layout import KVLayout, cdiv
from kvcore.manager import Manager, PageManager
from kvcore.prefix import KeySpace, PrefixKey, chain_keys, encode_tokens, root_key
from kvcore.tiers import (
    DiskTier,
    HostTier,
    TierKey,
    TierStack,
    gather_pages,
    layout_fingerprint,
    scatter_pages,
    tier_keys,
)
from kvcore.tiers.codec import HEADER_BYTES
from kvcore.tiers.transfer import plan_rows

if TYPE_CHECKING:
    import torch

HEADLINE = (  # what `kvcore bench tiers` prints without --json (docs/benchmarks.md)
    Figure("hit_rate_pool_only", "hit rate, pool alone"),
    Figure("hit_rate_pool_host", "hit rate, pool + host tier"),
    Figure(
        "hit_rate_tiered",
        "hit rate, pool + host + disk",
        Target(">=", "hit_rate_optimal", factor=0.95),
    ),
    Figure(
        "promote_bandwidth_ratio", "host -> pool promotion / plain copy, bytes/s", Target(">=", 0.8)
    ),
    Figure(
        "promote_bandwidth_ratio_page_major",
        "the same, page-major pool",
        Target(">=", 0.9),
    ),
    Figure("spill_bandwidth_ratio", "pool -> host spill / plain copy, bytes/s"),
    Figure("spill_bandwidth_ratio_page_major", "the same, page-major pool", Target(">=", 0.9)),
    Figure(
        "staged_promote_bandwidth_ratio",
        "host -> staging batch -> pool (disk, remote) / plain copy",
        Target(">=", 0.45),
    ),
    Figure(
        "staged_promote_bandwidth_ratio_page_major",
        "the same, page-major pool",
        Target(">=", 0.45),
    ),
    Figure("host_fetch_us_per_page", "host tier fetch, µs per page"),
    Figure("remote_fetch_us_per_page", "remote tier fetch, µs per page"),
)
SIM_LAYOUT = dict(num_layers=1, num_kv_heads=1, head_dim=4, dtype="float16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=300, help="requests in the trace")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the trace")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page")
    parser.add_argument(
        "--working-set", type=float, default=4.0, help="distinct pages / pool pages"
    )
    parser.add_argument(
        "--host-factor", type=float, default=1.0, help="host tier pages / pool pages"
    )
    parser.add_argument("--promote-pages", type=int, default=64, help="pages per promotion timed")
    parser.add_argument(
        "--rounds", type=int, default=5, help="rounds of the timed copies (best of, in turns)"
    )
    parser.add_argument(
        "--remote-master", default=None, help="host:port of a running mooncake_master"
    )
    parser.add_argument("--remote-metadata", default=None, help="http://host:port/metadata")


def _replay(manager: PageManager, requests: list[list[int]]) -> int:
    """Serve each prompt as an engine does (allocate, commit its full pages, free);
    returns the prompt tokens served from the cache."""
    hit = 0
    for seq, prompt in enumerate(requests):
        hit += manager.allocate(seq, prompt).num_cached_tokens
        manager.commit(seq, prompt)
        manager.free(seq)
    return hit


def _hit_rates(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    trace = make_trace(
        TraceConfig(
            num_requests=args.requests,
            seed=args.seed,
            shared_fraction=0.9,
            num_prefixes=12,
            output_median=1,
        )
    )
    page_size = args.page_size
    prompts = [list(request.prompt) for request in trace.requests]
    distinct: set[PrefixKey] = set()
    for prompt in prompts:
        distinct.update(chain_keys(root_key(KeySpace("default")), encode_tokens(prompt), page_size))
    longest = max(cdiv(len(p), page_size) for p in prompts)
    pool_pages = max(int(len(distinct) / args.working_set), longest + 1)
    layout = KVLayout(page_size=page_size, num_pages=pool_pages, **SIM_LAYOUT)  # type: ignore[arg-type]
    host_pages = max(int(pool_pages * args.host_factor), 1)
    prompt_tokens = trace.prompt_tokens
    optimal = optimal_hit_tokens(trace.requests, {r.rid: r.rid for r in trace.requests}, page_size)
    result: dict[str, Any] = {
        "requests": args.requests,
        "distinct_pages": len(distinct),
        "pool_pages": pool_pages,
        "host_pages": host_pages,
        "working_set": len(distinct) / pool_pages,
        "hit_rate_optimal": sum(optimal.values()) / prompt_tokens,
    }
    result["hit_rate_pool_only"] = _replay(Manager(layout), prompts) / prompt_tokens
    with tempfile.TemporaryDirectory() as scratch:
        disk_bytes = 4 * len(distinct) * (HEADER_BYTES + layout.page_bytes)
        for name, host, disk in (
            ("pool_host", HostTier(layout, host_pages), None),
            (
                "tiered",
                HostTier(layout, host_pages),
                DiskTier(layout, f"{scratch}/disk", disk_bytes),
            ),
        ):
            memory = torch.zeros(layout.total_bytes, dtype=torch.uint8)
            manager = TieredManager(layout, memory, TierStack(host, disk))
            result[f"hit_rate_{name}"] = _replay(manager, prompts) / prompt_tokens
            result[f"hits_by_tier_{name}"] = {m: t.hits for m, t in manager.tier_stats().items()}
            manager.check_integrity()
            manager.close()
    return result


MOVER_ORDERS = {"": "LPKTH", "_page_major": "PLKTH"}
"""The pool orders the movers are timed on, by the suffix of their figures."""


@dataclass(slots=True)
class _Movers:
    """One pool of ``order`` with a host tier holding ``n`` pages, and the three timed
    moves between them (host -> pool, pool -> host, host -> batch -> pool)."""

    layout: KVLayout
    pool: torch.Tensor  # the pool's rows, [2n, *stored_page_shape]
    host: HostTier
    keys: list[TierKey]
    page_ids: list[int]  # n pool pages, scattered
    staging: torch.Tensor  # [n, *stored_page_shape]
    spill_host: HostTier  # the spill's target, emptied before each spill

    @classmethod
    def build(cls, order: str, n: int, seed: int) -> _Movers:
        import torch

        layout = KVLayout(16, 8, 128, 16, "float16", 2 * n, order=order)
        pool = layout.pages_view(torch.zeros(layout.total_bytes, dtype=torch.uint8))
        keys = tier_keys(
            layout_fingerprint(layout), [PrefixKey(i.to_bytes(32, "little")) for i in range(n)]
        )
        host = HostTier(layout, n)
        host.put_many(keys, torch.randn(n, *layout.stored_page_shape).to(torch.float16))
        generator = torch.Generator().manual_seed(seed)
        page_ids = torch.randperm(2 * n, generator=generator)[:n].tolist()
        staging = torch.empty((n, *layout.stored_page_shape), dtype=torch.float16)
        return cls(layout, pool, host, keys, page_ids, staging, HostTier(layout, n))

    def promote(self) -> None:
        self.host.promote(self.keys, self.pool, self.page_ids)

    def spill(self) -> None:
        self.spill_host.discard(self.keys)  # O(n) dict work: the put then copies every page
        self.spill_host.spill_from(self.keys, self.pool, self.page_ids)

    def staged(self) -> None:
        scatter_pages(self.pool, self.page_ids, self.host.get_many(self.keys, out=self.staging))

    def check(self) -> None:
        """The pool pages and both host tiers hold the same bytes (no move changed one)."""
        import torch

        held = self.host.get_many(self.keys)
        assert torch.equal(gather_pages(self.pool, self.page_ids), held), "a move changed bytes"
        assert torch.equal(self.spill_host.get_many(self.keys), held), "a spill changed bytes"


def _promote(args: argparse.Namespace) -> dict[str, Any]:
    """Bytes/s of the movers between a host tier and scattered pool pages, for a
    layer-major and a page-major pool, against a plain copy (module docstring)."""
    import torch

    n = args.promote_pages
    movers = {suffix: _Movers.build(order, n, args.seed) for suffix, order in MOVER_ORDERS.items()}
    page_bytes = next(iter(movers.values())).layout.page_bytes
    source = torch.randn(n * page_bytes // 2).to(torch.float16)
    plain = torch.empty_like(source)
    works: dict[str, Callable[[], object]] = {"copy": lambda: plain.copy_(source)}
    for suffix, mover in movers.items():
        works[f"promote{suffix}"] = mover.promote
        works[f"spill{suffix}"] = mover.spill
        works[f"staged{suffix}"] = mover.staged
    took = dict(zip(works, _best_interleaved(*works.values(), rounds=args.rounds), strict=True))
    for mover in movers.values():
        mover.check()
    moved = n * page_bytes
    t_copy = took["copy"]
    result: dict[str, Any] = {
        "promote_pages": n,
        "promote_bytes": moved,
        "copy_gib_s": moved / t_copy / 2**30,
        "host_fetch_us_per_page": took["promote"] / n * 1e6,
        "remote_fetch_us_per_page": None,
    }
    for suffix, mover in movers.items():
        result[f"promote_gib_s{suffix}"] = moved / took[f"promote{suffix}"] / 2**30
        result[f"promote_bandwidth_ratio{suffix}"] = t_copy / took[f"promote{suffix}"]
        result[f"spill_bandwidth_ratio{suffix}"] = t_copy / took[f"spill{suffix}"]
        result[f"staged_promote_bandwidth_ratio{suffix}"] = t_copy / took[f"staged{suffix}"]
        plan = plan_rows(mover.pool, mover.staging)  # a slot is a batch row
        result[f"copies_per_page{suffix}"] = plan.runs  # memmoves per page, either way
    if args.remote_master and args.remote_metadata:
        main = movers[""]
        result.update(_remote_fetch(args, main.layout, main.host, main.keys))
    return result


def _remote_fetch(
    args: argparse.Namespace, layout: KVLayout, host: HostTier, keys: list[TierKey]
) -> dict[str, Any]:
    """Time fetching ``keys``' pages (put there from ``host``) from the remote store
    named by ``--remote-master``/``--remote-metadata``: µs per page, and the pages
    fetched per timed run; {} if the store is not ready within 30 s."""
    from kvcore.tiers import RemoteConfig, RemoteTier

    remote = RemoteTier(
        layout,
        RemoteConfig(
            args.remote_master,
            args.remote_metadata,
            buffer_bytes=64 << 20,
            segment_bytes=256 << 20,
            timeout_s=10.0,
        ),
    )
    try:
        if not remote.wait_ready(30):
            return {}
        remote.put_many(keys, host.get_many(keys))
        remote.flush(60)
        t_remote = _best(lambda: remote.get_many(keys))
        return {
            "remote_fetch_us_per_page": t_remote / len(keys) * 1e6,
            "remote_pages_fetched": remote.stats().hits // 5,
        }
    finally:
        remote.close()


def _best(work: Callable[[], object]) -> float:
    """The fastest of five runs of ``work``, in seconds."""
    times = []
    for _ in range(5):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


def _best_interleaved(*works: Callable[[], object], rounds: int = 5) -> list[float]:
    """The fastest of ``rounds`` runs of each of ``works``, in seconds; the runs take
    turns (one of each, then the next round), so a burst of load from other processes
    slows them all rather than one."""
    times: list[list[float]] = [[] for _ in works]
    for _ in range(rounds):
        for work, spent in zip(works, times, strict=True):
            start = time.perf_counter()
            work()
            spent.append(time.perf_counter() - start)
    return [min(spent) for spent in times]


def run(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {"phase": "2: the daemon's TieredManager, in-process"}
    result.update(_hit_rates(args))
    result.update(_promote(args))
    return result
