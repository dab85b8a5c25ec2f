"""``kvcore bench tiers``: hit rates with lower tiers, and the cost of bringing pages back.

PHASE 1 (the tiers alone; the daemon does not drive them yet), so this is a
simulation over the real tier objects, not the daemon:

* hit rates: the shared-prefix trace (kvcore.bench.trace) replayed one request
  at a time against a pool modelled as an LRU of prefix keys, sized so that
  the trace's distinct prompt pages are about ``--working-set`` x the pool.
  A request hits the longest run of its full prompt pages (never the last
  token) found in the pool, then (tiered) in the host tier, then the disk
  tier; it then holds all its full prompt pages in the pool, evicting the
  least recently used, which spill to the host tier (whose own evictions
  spill to the disk tier). ``hit_rate_optimal`` is
  :func:`~kvcore.bench.trace.optimal_hit_tokens` for the same order (an
  unbounded cache). Rates are hit tokens / prompt tokens.
* ``promote_bandwidth_ratio``: bytes/s of bringing ``--promote-pages`` pages
  from the host tier into scattered pool pages (``HostTier.promote``: each
  byte copied once), over bytes/s of one plain copy of the same bytes, in the
  same run, on a layout of realistic page size (1 MiB pages, CPU pool);
  ``staged_promote_bandwidth_ratio`` is the same through a staging batch
  (``get_many(out=)`` + ``scatter_pages``: two copies).
* remote (``--remote-master``/``--remote-metadata`` naming a running master):
  fetch time per page from the store vs the host tier; null without them.

The final figures need the daemon integration (phase 2): real evictions of a
Manager under concurrent sequences, promotion inside allocate.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import OrderedDict
from typing import Any

from kvcore.bench.trace import TraceConfig, make_trace, optimal_hit_tokens
from kvcore.layout import KVLayout
from kvcore.prefix import PrefixKey, chain_keys, encode_tokens, root_key
from kvcore.tiers import DiskTier, HostTier, TierKey, gather_pages, scatter_pages, tier_keys
from kvcore.tiers.codec import HEADER_BYTES

SIM_LAYOUT = dict(num_layers=1, num_kv_heads=1, head_dim=4, dtype="float16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page")
    parser.add_argument("--working-set", type=float, default=4.0, help="distinct pages / pool pages")
    parser.add_argument("--host-factor", type=float, default=2.0, help="host tier pages / pool pages")
    parser.add_argument("--promote-pages", type=int, default=64)
    parser.add_argument("--remote-master", default=None, help="host:port of a running mooncake_master")
    parser.add_argument("--remote-metadata", default=None, help="http://host:port/metadata")


class _Replay:
    """The pool as an LRU of keys, above optional host and disk tiers (pages, not tokens)."""

    def __init__(self, layout: KVLayout, host: HostTier | None, disk: DiskTier | None) -> None:
        import torch

        self.layout = layout
        self.pool: OrderedDict[TierKey, None] = OrderedDict()
        self.host, self.disk = host, disk
        self.zero = torch.zeros((1, layout.num_layers, *layout.page_shape), dtype=layout.torch_dtype())
        self.hits = {"pool": 0, "host": 0, "disk": 0}

    def serve(self, keys: list[TierKey], max_hit: int) -> int:
        """Hit pages of one request whose full prompt pages are ``keys``."""
        hit = 0
        while hit < max_hit and keys[hit] in self.pool:
            hit += 1
        self.hits["pool"] += hit
        for tier in (self.host, self.disk):
            if tier is not None and hit < max_hit:
                got = tier.get_many(keys[hit:max_hit][: tier.match(keys[hit:max_hit])]).shape[0]
                self.hits[tier.medium] += got
                hit += got
        for key in keys:
            if key in self.pool:
                self.pool.move_to_end(key)
            else:
                self.pool[key] = None
        over = len(self.pool) - self.layout.num_pages
        if over > 0:
            evicted = [self.pool.popitem(last=False)[0] for _ in range(over)]
            self._spill(evicted)
        return hit

    def _spill(self, keys: list[TierKey]) -> None:
        if self.host is None:
            return
        spilled = self.host.put_spill(keys, self.zero.expand(len(keys), *self.zero.shape[1:]))
        if self.disk is not None and spilled.keys:
            self.disk.put_many(spilled.keys, spilled.pages)


def _hit_rates(args: argparse.Namespace) -> dict[str, Any]:
    trace = make_trace(TraceConfig(num_requests=args.requests, seed=args.seed, shared_fraction=0.9,
                                   num_prefixes=12, output_median=1))
    page_size = args.page_size
    probe = KVLayout(page_size=page_size, num_pages=1, **SIM_LAYOUT)  # type: ignore[arg-type]
    from kvcore.tiers import layout_fingerprint

    fingerprint = layout_fingerprint(probe)
    chains: list[tuple[list[TierKey], int]] = []
    distinct: set[TierKey] = set()
    for request in trace.requests:
        keys: list[PrefixKey] = list(chain_keys(root_key("default"), encode_tokens(request.prompt), page_size))
        chains.append((tier_keys(fingerprint, keys), (len(request.prompt) - 1) // page_size))
        distinct.update(chains[-1][0])
    pool_pages = max(int(len(distinct) / args.working_set), 1)
    layout = KVLayout(page_size=page_size, num_pages=pool_pages, **SIM_LAYOUT)  # type: ignore[arg-type]
    host_pages = max(int(pool_pages * args.host_factor), 1)
    prompt_tokens = trace.prompt_tokens
    optimal = optimal_hit_tokens(trace.requests, {r.rid: r.rid for r in trace.requests}, page_size)
    result: dict[str, Any] = {
        "requests": args.requests, "distinct_pages": len(distinct), "pool_pages": pool_pages,
        "host_pages": host_pages, "hit_rate_optimal": sum(optimal.values()) / prompt_tokens,
    }
    with tempfile.TemporaryDirectory() as scratch:
        disk_bytes = 4 * len(distinct) * (HEADER_BYTES + layout.page_bytes)
        for name, host, disk in (
            ("pool_only", None, None),
            ("pool_host", HostTier(layout, host_pages), None),
            ("tiered", HostTier(layout, host_pages), DiskTier(layout, f"{scratch}/disk", disk_bytes)),
        ):
            replay = _Replay(layout, host, disk)
            hit_pages = sum(replay.serve(keys, max_hit) for keys, max_hit in chains)
            result[f"hit_rate_{name}"] = hit_pages * page_size / prompt_tokens
            result[f"hits_by_tier_{name}"] = dict(replay.hits)
            if disk is not None:
                disk.close()
    return result


def _promote(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    n = args.promote_pages
    layout = KVLayout(num_layers=16, num_kv_heads=8, head_dim=128, page_size=16, dtype="float16",
                      num_pages=2 * n)
    views = layout.layer_views(torch.zeros(layout.total_bytes, dtype=torch.uint8))
    host = HostTier(layout, n)
    from kvcore.tiers import layout_fingerprint

    keys = tier_keys(layout_fingerprint(layout), [PrefixKey(i.to_bytes(32, "little")) for i in range(n)])
    host.put_many(keys, torch.randn(n, layout.num_layers, *layout.page_shape).to(torch.float16))
    targets = torch.randperm(2 * n)[:n]
    source = torch.randn(n * layout.page_bytes // 2).to(torch.float16)
    plain = torch.empty_like(source)

    def best(work: Any) -> float:
        times = []
        for _ in range(5):
            start = time.perf_counter()
            work()
            times.append(time.perf_counter() - start)
        return min(times)

    staging = torch.empty((n, layout.num_layers, *layout.page_shape), dtype=torch.float16)
    page_ids = targets.tolist()
    t_promote = best(lambda: host.promote(keys, views, page_ids))
    t_staged = best(lambda: scatter_pages(views, targets, host.get_many(keys, out=staging)))
    t_copy = best(lambda: plain.copy_(source))
    assert torch.equal(gather_pages(views, targets), host.get_many(keys)), "promotion changed bytes"
    moved = n * layout.page_bytes
    result: dict[str, Any] = {
        "promote_pages": n, "promote_bytes": moved,
        "promote_gib_s": moved / t_promote / 2**30, "copy_gib_s": moved / t_copy / 2**30,
        "promote_bandwidth_ratio": t_copy / t_promote,
        "staged_promote_bandwidth_ratio": t_copy / t_staged,  # get_many(out=) + scatter_pages
        "host_fetch_us_per_page": t_promote / n * 1e6, "remote_fetch_us_per_page": None,
    }
    if args.remote_master and args.remote_metadata:
        from kvcore.tiers import RemoteConfig, RemoteTier

        remote = RemoteTier(layout, RemoteConfig(args.remote_master, args.remote_metadata,
                                                 buffer_bytes=64 << 20, segment_bytes=256 << 20,
                                                 timeout_s=10.0))
        try:
            if remote.wait_ready(30):
                remote.put_many(keys, host.get_many(keys))
                remote.flush(60)
                t_remote = best(lambda: remote.get_many(keys))
                result["remote_fetch_us_per_page"] = t_remote / n * 1e6
                result["remote_pages_fetched"] = remote.stats().hits // 5
        finally:
            remote.close()
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    result = {"phase": "1: tiers simulated without the daemon"}
    result.update(_hit_rates(args))
    result.update(_promote(args))
    return result
