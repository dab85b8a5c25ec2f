"""``kvcore top``: a live view of one daemon, refreshed in place (``htop`` for a kvcore daemon).

Every ``--interval`` seconds it asks the daemon for its stats (the ``stats`` request of
``kvcore stats``: no session needed) and shows what changed since the last reply:
kvcore.top_rates turns two replies into rows, this module lays them out with rich.
``--once`` takes two replies ``--interval`` apart, prints one frame and exits (plain
text when stdout is not a terminal). A daemon that stops answering is said so at the
top of the view, which keeps retrying; Ctrl-C exits 0.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Any

from kvcore.top_rates import Frame, frame

if TYPE_CHECKING:
    from kvcore_ipc.messages import StatsOk

PIPE_WIDTH = 160  # columns of a frame printed to a pipe or file (rich's default is 80)


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, not {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint", help="daemon endpoint (default: the default daemon)")
    parser.add_argument(
        "--interval",
        type=_positive,
        default=1.0,
        help="seconds between refreshes; every rate is over this interval",
    )
    parser.add_argument(
        "--once",
        action="store_true",
        help="take two replies --interval apart, print one frame and exit (for scripts)",
    )
    parser.add_argument(
        "--timeout", type=_positive, default=3.0, help="seconds to wait for each reply"
    )


def main(args: argparse.Namespace) -> int:
    from kvcore.paths import default_endpoint
    from kvcore.statsview import StatsUnavailable, fetch_reply

    endpoint = args.endpoint or default_endpoint()
    try:
        first = fetch_reply(endpoint, args.timeout)
        if args.once:
            time.sleep(args.interval)
            print_once(endpoint, first, fetch_reply(endpoint, args.timeout))
            return 0
        watch(endpoint, first, args.interval, args.timeout)
    except StatsUnavailable as exc:
        print(f"kvcore top: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


def print_once(endpoint: str, first: StatsOk, second: StatsOk) -> None:
    """One frame of ``second`` against ``first``, on stdout, wide enough in a pipe."""
    from rich.console import Console

    from kvcore.top_rates import daemon_seconds

    console = Console()
    view = render(frame(endpoint, first, second, daemon_seconds(first, second)))
    if console.is_terminal:
        console.print(view)
        return
    console = Console(width=max(console.width, PIPE_WIDTH))  # no colour: not a terminal
    with console.capture() as captured:
        console.print(view)
    sys.stdout.write("".join(line.rstrip() + "\n" for line in captured.get().splitlines()))


def watch(endpoint: str, first: StatsOk, interval_s: float, timeout_s: float) -> None:
    """Refresh the view in place every ``interval_s`` seconds until interrupted; while
    the daemon does not answer, say so above the last frame and keep asking."""
    from rich.console import Group
    from rich.live import Live
    from rich.text import Text

    from kvcore.statsview import StatsUnavailable, fetch_reply
    from kvcore.top_rates import daemon_seconds

    prev = first
    shown = render(frame(endpoint, None, first, None))
    lost_since: str | None = None
    with Live(shown, auto_refresh=False, vertical_overflow="crop") as live:
        while True:
            time.sleep(interval_s)
            try:
                cur = fetch_reply(endpoint, timeout_s)
            except StatsUnavailable as exc:
                lost_since = lost_since or time.strftime("%H:%M:%S")
                lost = Text(
                    f"{exc}: retrying every {interval_s:g} s (since {lost_since}); "
                    "below, the last figures it sent",
                    style="bold red",
                )
                live.update(Group(lost, shown), refresh=True)
                continue
            lost_since = None
            # a restarted daemon (another epoch): frame() shows its rates as "-" once
            shown = render(frame(endpoint, prev, cur, daemon_seconds(prev, cur)))
            live.update(shown, refresh=True)
            prev = cur


# -- rendering: a Frame to rich renderables (no I/O) -------------------------------------


def render(f: Frame) -> Any:
    """The whole view: the header line, then one table per pane (tiers only if any)."""
    from rich.console import Group
    from rich.text import Text

    h = f.header
    window = f"last {f.seconds:.1f} s" if f.seconds is not None else "since start"
    head = Text(
        f"kvcore top: {h.endpoint}  protocol v{h.version}  epoch {h.epoch:x}  "
        f"up {_duration(h.uptime_s)}\n{_num(h.requests_per_s)} requests/s  {h.errors} errors  "
        f"{h.lease_expiries} lease expiries  (rates: {window})",
        style="bold",
    )
    panes = [head, pool_table(f), hits_table(f)]
    if f.tiers:
        panes.append(tier_table(f))
    panes += [namespace_session_table(f), process_table(f), prefix_table(f)]
    return Group(*(part for pane in panes for part in (pane, Text(""))))


def _table(title: str, columns: list[str], left: int = 1) -> Any:
    """A compact table; its first ``left`` columns are names (left-aligned), the rest
    figures (right-aligned)."""
    from rich import box
    from rich.table import Table

    table = Table(
        title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False
    )
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i < left else "right", no_wrap=True)
    return table


def pool_table(f: Frame) -> Any:
    table = _table(
        "pools (pages; hit rate = hit tokens / prompt tokens asked)",
        [
            "pool",
            "total",
            "free",
            "evictable",
            "held",
            "hit rate",
            "since start",
            "tokens asked/s",
            "evictions/s",
            "sequences",
            "sessions",
        ],
    )
    for p in f.pools:
        table.add_row(
            p.pool,
            str(p.total),
            *(
                f"{n} ({n / p.total:.0%})" if p.total else str(n)
                for n in (p.free, p.evictable, p.held)
            ),
            _pct(p.hit_rate),
            _pct(p.hit_rate_since_start),
            _num(p.query_tokens_per_s),
            _num(p.evictions_per_s),
            str(p.sequences),
            str(p.sessions),
        )
    return table


def hits_table(f: Frame) -> Any:
    """Hit tokens by where their pages were: "pool", then the media any pool has."""
    from kvcore.hits import MEDIA

    seen = {m for row in f.namespaces for m in row.hit_tokens} | {t.medium for t in f.tiers}
    media = [m for m in MEDIA if m == "pool" or m in seen]
    media += sorted(seen.difference(MEDIA))
    window = _window(f, since_start=f.seconds is None)
    table = _table(
        f"hits by source (prompt tokens, {window})",
        ["pool", "namespace", "asked", *(f"in {m}" for m in media), "hit rate"],
        left=2,
    )
    for n in f.namespaces:
        table.add_row(
            n.pool,
            n.namespace,
            str(n.query_tokens),
            *(str(n.hit_tokens.get(m, 0)) for m in media),
            _pct(n.hit_rate),
        )
    return table


def tier_table(f: Frame) -> Any:
    table = _table(
        "tiers (pages are pool pages; corrupt, timeouts: since start)",
        [
            "pool",
            "medium",
            "pages",
            "used",
            "hits/s",
            "spills/s",
            "read/s",
            "write/s",
            "corrupt",
            "timeouts",
            "promote mean",
        ],
        left=2,
    )
    for t in f.tiers:
        table.add_row(
            t.pool,
            t.medium,
            str(t.pages),
            _bytes(t.bytes_used),
            _num(t.hits_per_s),
            _num(t.stored_per_s),
            _bytes_per_s(t.read_bytes_per_s),
            _bytes_per_s(t.write_bytes_per_s),
            str(t.corrupt),
            str(t.timeouts),
            "-" if t.promote_mean_s is None else f"{t.promote_mean_s * 1e3:.3f} ms",
        )
    return table


def namespace_session_table(f: Frame) -> Any:
    table = _table(
        "sessions by namespace", ["pool", "namespace", "sessions", "processes", "sequences"], 2
    )
    for s in f.namespace_sessions:
        table.add_row(s.pool, s.namespace, str(s.sessions), str(s.processes), str(s.sequences))
    return table


def process_table(f: Frame) -> Any:
    table = _table(
        "sessions by process",
        ["pid", "name", "pool/namespace", "sessions", "sequences", "idle"],
        left=3,
    )
    for p in f.processes:
        idle = f"{p.idle_ms / 1e3:.1f} s"
        table.add_row(
            str(p.pid), p.name, ", ".join(p.namespaces), str(p.sessions), str(p.sequences), idle
        )
    return table


def prefix_table(f: Frame) -> Any:
    table = _table(
        "busiest prefixes (by first page key)",
        ["pool", "namespace", "key", "hits", "hit tokens", "over"],
        left=3,
    )
    for p in f.prefixes:
        table.add_row(
            p.pool, p.namespace, p.key, str(p.hits), str(p.hit_tokens), _window(f, p.since_start)
        )
    return table


def _window(f: Frame, since_start: bool) -> str:
    return "since start" if since_start or f.seconds is None else f"last {f.seconds:.1f} s"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"


def _bytes(n: float) -> str:
    """``n`` bytes in B, KiB, MiB or GiB, whichever keeps it under 1024 (GiB past that)."""
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} GiB"


def _bytes_per_s(x: float | None) -> str:
    return "-" if x is None else f"{_bytes(x)}/s"


def _duration(s: float) -> str:
    minutes, secs = divmod(int(s), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"
