"""``kvcore stats``: a running daemon's pools, sessions and cache figures.

Sends one ``stats`` request (no session needed) and prints tables, or the
reply as JSON with ``--json``. Page counts are in pages; hit rate is hit
tokens / query tokens of successful allocations since the daemon started.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from kvcore.layout import AXES

if TYPE_CHECKING:
    from kvcore_ipc.messages import StatsOk


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint", help="daemon endpoint (default: the default daemon)")
    parser.add_argument("--json", action="store_true", help="print the stats reply as JSON")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the daemon")


class StatsUnavailable(Exception):
    """No stats reply came, for a reason the message gives in one line for a user: no
    daemon answers, the endpoint is not a ZeroMQ address, or the daemon refused (its
    error code first, e.g. ``forbidden: ...``)."""


def fetch_reply(endpoint: str, timeout_s: float) -> StatsOk:
    """The daemon's StatsOk, over a channel of its own (one request, no session);
    StatsUnavailable if none comes within ``timeout_s`` seconds."""
    import zmq
    from kvcore_ipc import messages as msg
    from kvcore_ipc.channel import ChannelTimeout, DealerChannel
    from kvcore_ipc.codec import ClientCodec

    from kvcore.client import no_daemon
    from kvcore.errors import error_from_code

    codec = ClientCodec()
    try:
        channel = DealerChannel(endpoint, timeout_s=timeout_s)
        try:
            channel.send(codec.encode(msg.Request(id=1, body=msg.GetStats())))
            reply = codec.decode_reply(channel.recv(), msg.StatsOk)
        finally:
            channel.close()
    except ChannelTimeout:
        raise StatsUnavailable(no_daemon(endpoint)) from None
    except zmq.ZMQError as exc:  # e.g. an endpoint that is not a ZeroMQ address
        raise StatsUnavailable(f"cannot reach {endpoint!r}: {exc}") from None
    if reply.error is not None:
        error = error_from_code(reply.error.code, reply.error.message)
        raise StatsUnavailable(f"{error.code}: {error}")
    assert reply.result is not None, "stats reply without a result"
    return reply.result


def fetch(endpoint: str, timeout_s: float) -> Any:
    """:func:`fetch_reply`'s StatsOk as plain data (dicts and lists, as ``--json`` prints)."""
    import msgspec

    return msgspec.to_builtins(fetch_reply(endpoint, timeout_s))


def main(args: argparse.Namespace) -> int:
    from kvcore.paths import default_endpoint

    endpoint = args.endpoint or default_endpoint()
    try:
        stats = fetch(endpoint, args.timeout)
    except StatsUnavailable as exc:
        print(f"kvcore stats: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(stats, indent=2))
    else:
        render(endpoint, stats)
    return 0


def render(endpoint: str, stats: dict[str, Any]) -> None:
    """Print the daemon's counters, then its pools, tiers (if any) and sessions."""
    from rich.console import Console

    c = stats["counters"]
    console = Console(width=max(Console().width, 120))
    console.print(
        f"kvcore daemon on {endpoint}: protocol v{c['version']}, epoch {c['epoch']:x}, "
        f"up {c['uptime_s']:.0f} s, {c['requests']} requests, {c['errors']} errors, "
        f"{c['dropped_frames']} dropped frames, {c['expired_sessions']} expired sessions"
    )
    console.print(pool_table(stats["pools"]))
    tiers = tier_table(stats["pools"])
    if tiers is not None:
        console.print(tiers)
    console.print(session_table(stats["sessions"]))


def pool_table(pools: list[dict[str, Any]]) -> Any:
    """One row per pool: its layout, page counts (pages), sequences, sessions and hit rate."""
    from rich.table import Table

    table = Table(title="pools (pages; layout = layers x kv heads x head dim, page size in tokens)")
    for column in (
        "pool",
        "device",
        "layout",
        "total",
        "free",
        "evictable",
        "held",
        "withheld",
        "cached",
        "seqs",
        "sessions",
        "hit rate",
        "evictions",
    ):
        table.add_column(
            column, justify="left" if column in ("pool", "device", "layout") else "right"
        )
    for p in pools:
        lay = p["layout"]
        shape = (
            f"{lay['num_layers']}x{lay['num_kv_heads']}x{lay['head_dim']} "
            f"p{lay['page_size']} {lay['dtype']} {lay.get('order', AXES)}"
        ) + (f" x{p['shards']} shards" if p.get("shards", 1) > 1 else "")
        hit_rate = p["hit_tokens"] / p["query_tokens"] if p["query_tokens"] else 0.0
        table.add_row(
            p["name"],
            p["device"],
            shape,
            str(p["total_pages"]),
            str(p["free_pages"]),
            str(p["evictable_pages"]),
            str(p["held_pages"]),
            str(p.get("withheld_pages", 0)),
            str(p["cached_pages"]),
            str(p["num_sequences"]),
            str(p["num_sessions"]),
            f"{hit_rate:.1%}",
            str(p["evictions"]),
        )
    return table


def session_table(sessions: list[dict[str, Any]]) -> Any:
    """One row per attached session: its pool, namespace, process and idle time (ms)."""
    from rich.table import Table

    table = Table(title="sessions")
    for column in ("pool", "namespace", "pid", "name", "sequences", "idle ms"):
        table.add_column(column)
    for s in sessions:
        table.add_row(
            s["pool"],
            s["namespace"],
            str(s["pid"]),
            s["name"],
            str(s["num_sequences"]),
            str(s["idle_ms"]),
        )
    return table


def tier_table(pools: list[dict[str, Any]]) -> Any:
    """The pools' lower tiers (pages, hits, bytes moved), or None if no pool has any."""
    from rich.table import Table

    rows = [(p["name"], t) for p in pools for t in p.get("tiers", [])]
    if not rows:
        return None
    table = Table(title="tiers (pages are pool pages; MiB moved since the daemon started)")
    for column in (
        "pool",
        "medium",
        "pages",
        "MiB used",
        "hits",
        "misses",
        "corrupt",
        "stored",
        "evicted",
        "MiB in",
        "MiB out",
        "dropped",
        "timeouts",
    ):
        table.add_column(column, justify="left" if column in ("pool", "medium") else "right")
    mib = 1 << 20
    for name, t in rows:
        table.add_row(
            name,
            t["medium"],
            str(t.get("pages", 0)),
            f"{t.get('bytes_used', 0) / mib:.1f}",
            *(str(t.get(k, 0)) for k in ("hits", "misses", "corrupt", "stored", "evicted")),
            f"{t.get('bytes_in', 0) / mib:.1f}",
            f"{t.get('bytes_out', 0) / mib:.1f}",
            str(t.get("dropped", 0)),
            str(t.get("timeouts", 0)),
        )
    return table
