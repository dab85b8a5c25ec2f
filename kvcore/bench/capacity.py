"""``kvcore bench capacity``: how many sequences one memory budget serves.

The trace (kvcore.bench.chat_trace) is replayed by the step simulator
(kvcore.bench.simulate: FCFS admission, preemption of the newest sequence) against
one fixed pool under three policies:

    contiguous    reserves prompt + max_new_tokens (2048) token slots per request
                  on admission, as an engine without paging must (no Manager)
    paged         Manager.allocate for the prompt, Manager.extend one token a step
    paged_prefix  as paged, plus the shared prefix cache: allocation reuses
                  committed pages; full pages are committed as they fill (the
                  prompt's after its prefill step); finished sequences' committed
                  pages stay cached until evicted

Admission is exact (Manager.lookup's PrefixHit counts the hit pages that
allocate would pin out of the LRU): each policy's summary reports
``failed_allocations``, allocations the scheduler made that then failed (0).

Each policy runs on a plain trace and a shared-prefix variant of the same seed,
and the paged policies again on a pool large enough that nothing is evicted.
Units: tokens and pages as named; a "step" is one engine iteration.

``pages_per_gib`` says what the page format buys, by arithmetic (no replay): pages
of the configured geometry per GiB in bfloat16 and in the fp8 dtypes (their
ratio, ``fp8_vs_bf16_pages_ratio``, is 2.0: one byte an element instead of two),
and of a latent (MLA) layout of the same layers and page size, one vector of
``--latent-dim`` elements a token (DeepSeek's 512 + 64 = 576).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from kvcore.bench.chat_trace import Trace, TraceConfig, make_trace, optimal_hit_tokens
from kvcore.bench.report import Figure, Target
from kvcore.bench.simulate import ContiguousPool, PagedPool, Pool, RunStats, simulate
from kvcore.errors import BadRequest
from kvcore.layout import FP8_DTYPES, KVLayout
from kvcore.manager import Manager

POLICIES = ("contiguous", "paged", "paged_prefix")
GIB = 1 << 30

HEADLINE = (  # what `kvcore bench capacity` prints without --json (docs/benchmarks.md)
    Figure("concurrency_ratio", "concurrency, paged / contiguous (plain trace)", Target(">=", 2.5)),
    Figure("utilization_paged", "utilization of the paged pool (plain trace)", Target(">=", 0.96)),
    Figure(
        "pages_saved_fraction",
        "pages saved by the prefix cache (shared prefixes)",
        Target(">=", 0.40),
    ),
    Figure(
        "hit_rate", "prefix-cache hit rate (tokens, no eviction)", Target("==", "hit_rate_optimal")
    ),
    Figure("hit_rate_fixed_budget", "hit rate at the fixed budget"),
    Figure("shared_prefix_concurrency_ratio", "concurrency, paged / contiguous (shared prefixes)"),
    Figure("shared_prefix_prefix_vs_paged_concurrency", "concurrency, prefix cache / paged"),
    Figure(
        "fp8_vs_bf16_pages_ratio",
        "pages per GiB, fp8 / bfloat16 (same geometry)",
        Target("==", 2.0, required=True),
    ),
    Figure("pages_per_gib.latent.bfloat16", "pages per GiB, latent (MLA) layout, bfloat16"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("trace")
    g.add_argument("--seed", type=int, default=0, help="random seed of the trace")
    g.add_argument("--requests", type=int, default=500, help="requests per trace")
    g.add_argument("--arrival-rate", type=float, default=1.0, help="mean arrivals per step")
    g.add_argument(
        "--shared-fraction",
        type=float,
        default=0.6,
        help="share of requests with a shared prefix in the shared-prefix variant",
    )
    g.add_argument("--num-prefixes", type=int, default=4, help="distinct shared prefixes")
    g.add_argument("--max-new-tokens", type=int, default=2048, help="serving limit")
    g = parser.add_argument_group("pool")
    g.add_argument("--budget-gib", type=float, default=4.0, help="KV memory budget, GiB")
    g.add_argument("--num-pages", type=int, default=0, help="pages (overrides --budget-gib)")
    g.add_argument("--page-size", type=int, default=16, help="tokens per page")
    g.add_argument("--layers", type=int, default=32, help="layers of the modelled KV cache")
    g.add_argument("--kv-heads", type=int, default=8, help="KV heads per layer")
    g.add_argument("--head-dim", type=int, default=128, help="elements per head")
    g.add_argument("--dtype", default="bfloat16", help="element type of K and V")
    g.add_argument(
        "--latent-dim",
        type=int,
        default=576,
        help="elements of the latent (MLA) vector a token, for pages_per_gib",
    )
    g.add_argument(
        "--watermark",
        type=float,
        default=0.01,
        help="fraction of pages admission keeps free (vLLM's default 1%%)",
    )


def layout_from_args(args: argparse.Namespace) -> KVLayout:
    dims = {
        "num_layers": args.layers,
        "num_kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "page_size": args.page_size,
        "dtype": args.dtype,
    }
    if args.num_pages:
        return KVLayout(num_pages=args.num_pages, **dims)
    return KVLayout.for_budget(int(args.budget_gib * GIB), **dims)


def traces_from_args(args: argparse.Namespace) -> tuple[Trace, Trace]:
    """(plain trace, shared-prefix variant), same seed."""
    common = {
        "num_requests": args.requests,
        "seed": args.seed,
        "arrival_rate": args.arrival_rate,
        "max_new_tokens": args.max_new_tokens,
        "num_prefixes": args.num_prefixes,
    }
    return (
        make_trace(TraceConfig(**common)),
        make_trace(TraceConfig(shared_fraction=args.shared_fraction, **common)),
    )


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
    return replace(layout, num_pages=pages)


def replay(
    trace: Trace, layout: KVLayout, policy: str, *, max_new_tokens: int, watermark: float
) -> tuple[RunStats, dict[str, Any]]:
    """One policy on one trace: run stats, and the summary object of the report."""
    pool = make_pool(policy, layout, max_new_tokens=max_new_tokens, watermark=watermark)
    stats = simulate(trace, pool)
    summary = stats.summary()
    if isinstance(pool, PagedPool):
        assert isinstance(pool.manager, Manager)
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
    variants, fixed_prefix_stats = _replay_variants(plain, shared, layout, opts)
    big = no_eviction_layout(shared, layout)
    no_evict = {policy: replay(shared, big, policy, **opts)[1] for policy in POLICIES[1:]}
    for summary in no_evict.values():
        assert summary["evictions"] == 0 and summary["preemptions"] == 0, "the big pool evicted"
    return {
        **_capacity_figures(variants["plain"], no_evict),
        **_hit_figures(shared, layout, variants["shared_prefix"], no_evict, fixed_prefix_stats),
        **_shared_prefix_figures(variants["shared_prefix"]),
        **_memory_figures(layout, args.latent_dim),
        "config": _config(args, layout, big, plain, shared),
        "plain": variants["plain"],
        "shared_prefix": variants["shared_prefix"],
        "no_eviction": no_evict,
    }


def _replay_variants(
    plain: Trace, shared: Trace, layout: KVLayout, opts: dict[str, Any]
) -> tuple[dict[str, dict[str, Any]], RunStats]:
    """Every policy's summary on each trace at the fixed budget (the prefix cache has
    nothing to share on "plain"), and the run stats of paged_prefix on the shared one."""
    variants: dict[str, dict[str, Any]] = {}
    fixed_prefix_stats: RunStats | None = None
    runs = (("plain", plain, POLICIES[:2]), ("shared_prefix", shared, POLICIES))
    for name, trace, policies in runs:
        variants[name] = {}
        for policy in policies:
            stats, variants[name][policy] = replay(trace, layout, policy, **opts)
            if name == "shared_prefix" and policy == "paged_prefix":
                fixed_prefix_stats = stats
    assert fixed_prefix_stats is not None
    return variants, fixed_prefix_stats


def _capacity_figures(plain: dict[str, Any], no_evict: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Concurrency and utilization on the plain trace; pages the prefix cache saves."""
    paged, contiguous = plain["paged"], plain["contiguous"]
    held = {policy: no_evict[policy]["mean_pages_held_all_steps"] for policy in no_evict}
    return {
        "concurrency_ratio": _ratio(paged["mean_concurrency"], contiguous["mean_concurrency"]),
        "utilization_paged": paged["utilization"],
        "pages_saved_fraction": 1.0 - held["paged_prefix"] / held["paged"],
    }


def _hit_figures(
    shared: Trace,
    layout: KVLayout,
    fixed: dict[str, Any],
    no_evict: dict[str, dict[str, Any]],
    fixed_prefix_stats: RunStats,
) -> dict[str, Any]:
    """Hit rates (tokens) without eviction and at the fixed budget, each beside the
    optimum on the same schedule of first admissions."""
    prompt_tokens = shared.prompt_tokens
    page_size = layout.page_size
    arrivals = {r.rid: r.arrival_step for r in shared.requests}
    optimal = sum(optimal_hit_tokens(shared.requests, arrivals, page_size).values())
    admitted = fixed_prefix_stats.first_admitted
    optimal_fixed = sum(optimal_hit_tokens(shared.requests, admitted, page_size).values())
    return {
        "hit_rate": no_evict["paged_prefix"]["hit_rate"],
        "hit_rate_optimal": optimal / prompt_tokens,
        "hit_tokens": no_evict["paged_prefix"]["hit_tokens"],
        "hit_tokens_optimal": optimal,
        "prompt_tokens": prompt_tokens,
        "hit_rate_fixed_budget": fixed["paged_prefix"]["hit_rate"],
        "hit_rate_optimal_fixed_schedule": optimal_fixed / prompt_tokens,
    }


def _shared_prefix_figures(shared: dict[str, Any]) -> dict[str, Any]:
    """Concurrency and pages per sequence of the policies on the shared-prefix trace."""
    paged, prefix, contiguous = shared["paged"], shared["paged_prefix"], shared["contiguous"]
    per_seq = _ratio(prefix["pages_per_sequence"], paged["pages_per_sequence"])
    return {
        "shared_prefix_concurrency_ratio": _ratio(
            paged["mean_concurrency"], contiguous["mean_concurrency"]
        ),
        "shared_prefix_prefix_vs_paged_concurrency": _ratio(
            prefix["mean_concurrency"], paged["mean_concurrency"]
        ),
        "pages_saved_per_sequence_fixed_budget": None if per_seq is None else 1.0 - per_seq,
    }


def _memory_figures(layout: KVLayout, latent_dim: int) -> dict[str, Any]:
    """Pages per GiB (a rate: GiB / page_bytes, not rounded) of ``layout``'s geometry
    per dtype, and of a latent layout (one head of ``latent_dim`` elements) of its
    layers and page size; the fp8 / bfloat16 ratio of the first."""
    dtypes = ("bfloat16", *sorted(FP8_DTYPES))
    latent = replace(layout, num_kv_heads=1, head_dim=latent_dim, kind="latent")
    per_gib = {
        name: {dtype: GIB / replace(shape, dtype=dtype).page_bytes for dtype in dtypes}
        for name, shape in (("kv", replace(layout, kind="kv")), ("latent", latent))
    }
    kv = per_gib["kv"]
    return {
        "pages_per_gib": {**per_gib, "latent_dim": latent_dim},
        "fp8_vs_bf16_pages_ratio": kv["float8_e4m3fn"] / kv["bfloat16"],
    }


def _config(
    args: argparse.Namespace, layout: KVLayout, big: KVLayout, plain: Trace, shared: Trace
) -> dict[str, Any]:
    """The report's ``config``: the pool, the trace options and the traces' means."""
    return {
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
        "mean_prompt_tokens": {
            "plain": plain.prompt_tokens / args.requests,
            "shared_prefix": shared.prompt_tokens / args.requests,
        },
        "mean_output_tokens": {
            "plain": plain.output_tokens / args.requests,
            "shared_prefix": shared.output_tokens / args.requests,
        },
        "prefix_lengths": [len(p) for p in shared.prefixes],
    }


def _ratio(num: float | None, den: float | None) -> float | None:
    """num / den; None (JSON null) when a policy never saturated the pool, so the
    figure would measure demand, not capacity."""
    if num is None or den is None or den == 0:
        return None
    return num / den
