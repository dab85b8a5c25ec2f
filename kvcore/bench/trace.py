"""``kvcore bench trace``: prefix-cache hit rates on a request trace, per eviction policy,
beside LRU and the offline optimum.

The trace (kvcore/bench/block_trace.py: Mooncake's format, a path or the shared
synthetic trace by default; or ``--workload`` for one of the seeded workloads of
kvcore/bench/block_workloads.py) is replayed one request at a time (allocate its
input, commit every full page, free) through a real :class:`~kvcore.Manager` with
one page per block, at each capacity (a fraction of the trace's distinct blocks,
at least its longest request), once per eviction policy. Beside each capacity,
computed in the same run over the same block sequence:

* ``lru``: the LRU reference (:func:`~kvcore.bench.block_trace.lru_hits`), equal to
  the Manager under ``eviction=lru`` to the token;
* ``belady``: the offline optimum (:func:`~kvcore.bench.block_trace.belady_hits`).

Per policy: ``hit_rate`` (input tokens served from the cache / input tokens),
``gap_closed`` ((policy - lru) / (belady - lru); null where the two references
meet), ``page_ops_per_s`` (pages allocated, committed and freed per second of the
fastest of ``--repeat`` replays, interleaved policy by policy) and ``ops_over_lru``
(that over the Manager's under LRU, same run). ``bytes_per_page`` gives each policy's
memory per cached page (:func:`policy_bytes_per_page`).

``--tiers``: the default policy again through a
:class:`~kvcore.daemon.tiering.TieredManager` with a host tier of ``--host-factor``
x the pool's pages (and a disk tier of ``--disk-factor`` x, if not 0); ``by_tier``
splits its hit rate by where the hit pages were when the request came (pool, or
promoted from host or disk before the answer).

``--plot FILE`` draws hit rate against capacity per policy beside the two references
(matplotlib: ``pip install 'kvcore[plot]'``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvcore.bench import block_trace, block_workloads
from kvcore.bench.block_trace import BlockRequest
from kvcore.bench.report import Figure
from kvcore.bench.tiers import SIM_LAYOUT  # the smallest page: a replay never reads bytes
from kvcore.errors import BadRequest
from kvcore.eviction import DEFAULT, POLICIES, EvictionPolicy, make_policy
from kvcore.layout import KVLayout
from kvcore.manager import Manager
from kvcore.results import PageManager

CAPACITIES = (0.05, 0.10, 0.25, 1.0)


def headline(result: dict[str, Any]) -> tuple[Figure, ...]:
    """Per capacity: the references, and each policy's hit rate, gap closed and cost."""
    figures = []
    for i, row in enumerate(result.get("capacities", ())):
        at = f"capacities.{i}"
        cap = f"{row['fraction']:.0%}"
        figures += [
            Figure(f"{at}.lru", f"{cap}: LRU reference hit rate"),
            Figure(f"{at}.belady", f"{cap}: Belady (offline optimum) hit rate"),
        ]
        for name in row["policies"]:
            figures += [
                Figure(f"{at}.policies.{name}.hit_rate", f"{cap}: {name} hit rate"),
                Figure(
                    f"{at}.policies.{name}.gap_closed", f"{cap}: {name}, LRU->Belady gap closed"
                ),
                Figure(f"{at}.policies.{name}.ops_over_lru", f"{cap}: {name} page ops/s / LRU's"),
            ]
        if "tiered" in row:
            for tier in row["tiered"]["by_tier"]:
                figures.append(
                    Figure(
                        f"{at}.tiered.by_tier.{tier}", f"{cap}: with a host tier, hits from {tier}"
                    )
                )
    return tuple(figures)


HEADLINE = headline  # what `kvcore bench trace` prints without --json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="a trace in Mooncake's format (default: the shared synthetic one)",
    )
    source.add_argument(
        "--workload",
        choices=sorted(block_workloads.WORKLOADS),
        help="a seeded workload instead of a trace file",
    )
    parser.add_argument(
        "--limit", type=_positive, default=None, help="replay only the first N requests"
    )
    parser.add_argument(
        "--repeat",
        type=_positive,
        default=3,
        help="replays per policy, interleaved; the fastest is timed",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of --workload")
    parser.add_argument(
        "--capacities",
        type=_fractions,
        default=CAPACITIES,
        help="pool sizes as fractions of the distinct blocks, comma-separated",
    )
    parser.add_argument(
        "--policies",
        type=_policies,
        default=tuple(POLICIES),
        help=f"eviction policies to replay, comma-separated (of {', '.join(POLICIES)})",
    )
    parser.add_argument(
        "--block-tokens", type=_positive, default=block_trace.BLOCK_TOKENS, help="tokens per block"
    )
    parser.add_argument(
        "--tiers", action="store_true", help="also replay with a host tier below the pool"
    )
    parser.add_argument(
        "--host-factor", type=float, default=1.0, help="host tier pages / pool pages"
    )
    parser.add_argument(
        "--disk-factor",
        type=float,
        default=0.0,
        help="disk tier pages / pool pages (0: no disk tier)",
    )
    parser.add_argument(
        "--plot", type=Path, default=None, help="draw hit rate against capacity into FILE"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> dict[str, Any]:
    requests, source = _requests(args)
    if not requests:
        raise BadRequest(f"{source}: no requests")
    tokens = args.block_tokens
    distinct = block_trace.distinct_blocks(requests)
    total = block_trace.input_tokens(requests)
    longest = max(len(r.hash_ids) for r in requests)
    result: dict[str, Any] = {
        "trace": source,
        "requests": len(requests),
        "distinct_blocks": distinct,
        "input_tokens": total,
        "block_tokens": tokens,
        "default_policy": DEFAULT,
        "bytes_per_page": {name: policy_bytes_per_page(name) for name in args.policies},
        "capacities": [],
    }
    replays = len(args.capacities) * (len(args.policies) * args.repeat + args.tiers)
    with _progress(len(requests) * replays, disabled=args.no_progress) as advance:
        for fraction in args.capacities:
            pages = max(round(fraction * distinct), longest)
            lru = block_trace.lru_hits(requests, pages, tokens) / total
            belady = block_trace.belady_hits(requests, pages, tokens) / total
            row: dict[str, Any] = {
                "fraction": fraction,
                "pages": pages,
                "lru": lru,
                "belady": belady,
                "policies": {},
            }
            layout = KVLayout(page_size=tokens, num_pages=pages, **SIM_LAYOUT)  # type: ignore[arg-type]
            page_ops = sum(2 * len(r.hash_ids) + r.full_blocks(tokens) for r in requests)
            best: dict[str, float] = {}
            hits: dict[str, int] = {}
            for _ in range(args.repeat):  # interleaved: a burst of load slows every policy
                for name in args.policies:
                    hit, seconds = _timed_replay(
                        Manager(layout, eviction=name), requests, tokens, advance
                    )
                    assert hits.setdefault(name, hit) == hit, "a replay is deterministic"
                    best[name] = min(best.get(name, seconds), seconds)
            for name in args.policies:
                row["policies"][name] = {
                    "hit_rate": hits[name] / total,
                    "gap_closed": _gap_closed(hits[name] / total, lru, belady),
                    "page_ops_per_s": page_ops / best[name],
                }
            base = row["policies"].get("lru", {}).get("page_ops_per_s")
            for figures in row["policies"].values():
                figures["ops_over_lru"] = figures["page_ops_per_s"] / base if base else None
            if args.tiers:
                row["tiered"] = _tiered(
                    layout, requests, tokens, args.host_factor, args.disk_factor, advance
                )
            result["capacities"].append(row)
    if args.plot is not None:
        plot(result, args.plot)
        result["plot"] = str(args.plot)
    return result


def _requests(args: argparse.Namespace) -> tuple[list[BlockRequest], str]:
    if args.workload is not None:
        requests = block_workloads.WORKLOADS[args.workload](args.seed)
        return requests[: args.limit], f"workload {args.workload} (seed {args.seed})"
    path = args.trace or block_trace.default_trace()
    if path is None:
        raise BadRequest(
            f"no trace given and the shared one ({block_trace.TRACE_NAME}) is not beside this "
            "checkout: pass --trace PATH or --workload NAME"
        )
    return block_trace.load(path, args.limit, args.block_tokens), str(path)


def _timed_replay(
    manager: PageManager,
    requests: Sequence[BlockRequest],
    tokens: int,
    advance: Callable[[int], None],
) -> tuple[int, float]:
    """(hit tokens, seconds) of one replay."""
    start = time.perf_counter()
    hit = block_trace.replay(manager, requests, tokens, advance)
    return hit, time.perf_counter() - start


def _tiered(
    layout: KVLayout,
    requests: Sequence[BlockRequest],
    tokens: int,
    host_factor: float,
    disk_factor: float,
    advance: Callable[[int], None],
) -> dict[str, Any]:
    """The default policy with a host tier (and a disk tier, if ``disk_factor``) below the
    pool: hit rate, and its split by the tier the hit pages were in when the request came
    (pages promoted for a hit are stored events naming their medium)."""
    import tempfile

    import torch

    from kvcore.daemon.tiering import TieredManager
    from kvcore.prefix import PageStored
    from kvcore.tiers import DiskTier, HostTier, TierStack
    from kvcore.tiers.codec import HEADER_BYTES

    host_pages = max(int(layout.num_pages * host_factor), 1)
    disk_pages = int(layout.num_pages * disk_factor)
    memory = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    total = block_trace.input_tokens(requests)
    by_tier = {"pool": 0, "host": 0, "disk": 0}
    with tempfile.TemporaryDirectory() as scratch:
        disk = None
        if disk_pages:
            entry = HEADER_BYTES + layout.page_bytes
            disk = DiskTier(layout, f"{scratch}/disk", disk_pages * entry)
        stack = TierStack(HostTier(layout, host_pages), disk)
        manager = TieredManager(layout, memory, stack)
        for seq, request in enumerate(requests):
            ids = block_trace.tokens_of(request, tokens)
            hit = manager.allocate(seq, ids).num_cached_tokens
            for event in manager.take_events():
                if isinstance(event, PageStored) and event.medium:  # promoted for this hit
                    by_tier[event.medium] += tokens
                    hit -= tokens
            by_tier["pool"] += hit
            manager.commit(seq, ids)
            manager.free(seq)
            manager.take_events()
            advance(1)
        stack.close()
    return {
        "policy": manager.eviction,
        "host_pages": host_pages,
        "disk_pages": disk_pages,
        "hit_rate": sum(by_tier.values()) / total,
        "by_tier": {tier: hits / total for tier, hits in by_tier.items()},
    }


def policy_bytes_per_page(name: str, capacity: int = 20_000) -> float:
    """Bytes the policy ``name`` holds per page of a full pool of ``capacity`` pages, in
    the steady state of a long replay: every page evictable (its worst case) and its
    ghosts full. Counts what the policy allocates (tracemalloc) plus the prefix keys
    only its ghosts keep alive (an evictable page's key is the index's anyway)."""
    import os
    import sys
    import tracemalloc

    keys = [os.urandom(32) for _ in range(3 * capacity)]  # made before tracing: the index's
    tracemalloc.start()
    try:
        policy: EvictionPolicy[int] = make_policy(name, capacity)
        for page, key in enumerate(keys[:capacity]):
            policy.add(((page, key),))
        for key in keys[capacity:]:  # every page evicted twice over: ghosts fill
            (page,) = policy.evict(1)
            policy.add(((page, key),))
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    ghosts: int = getattr(policy, "num_ghosts", 0)
    return (held + ghosts * sys.getsizeof(keys[0])) / capacity


def _gap_closed(rate: float, lru: float, belady: float) -> float | None:
    return (rate - lru) / (belady - lru) if belady - lru > 1e-12 else None


def plot(result: dict[str, Any], path: Path) -> None:
    """Hit rate against capacity: one line per policy, LRU and Belady dashed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BadRequest("--plot needs matplotlib: pip install 'kvcore[plot]'") from None
    rows = result["capacities"]
    x = [100 * row["fraction"] for row in rows]
    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    axes.plot(x, [row["belady"] for row in rows], "k--", label="Belady (offline optimum)")
    axes.plot(x, [row["lru"] for row in rows], "k:", lw=3, label="LRU reference")
    for name in rows[0]["policies"]:
        rates = [row["policies"][name]["hit_rate"] for row in rows]
        axes.plot(x, rates, "o-", label=f"kvcore, eviction={name}")
    axes.set_xscale("log")
    axes.set_xticks(x, [f"{v:g}%" for v in x])
    axes.minorticks_off()
    axes.set_xlabel("capacity (share of the trace's distinct blocks)")
    axes.set_ylabel("hit rate (cached input tokens / input tokens)")
    axes.set_title(f"{Path(result['trace']).name}: {result['requests']:,} requests")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


@contextmanager
def _progress(total: int, *, disabled: bool) -> Iterator[Callable[[int], None]]:
    """A progress bar on stderr over ``total`` requests; yields its advance(n)."""
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(stderr=True), transient=True, disable=disabled) as bar:
        task = bar.add_task("replaying", total=total)
        yield lambda n: bar.advance(task, n)


def _fractions(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"capacities are fractions, got {text!r}") from None
    if not all(0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"capacities are fractions in (0, 1], got {text!r}")
    return values


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"a count >= 1, got {text!r}")
    return value


def _policies(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(","))
    unknown = [name for name in names if name not in POLICIES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown policies {unknown}; known: {', '.join(POLICIES)}"
        )
    return names
