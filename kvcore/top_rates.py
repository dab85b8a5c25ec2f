"""What ``kvcore top`` shows, as plain rows: rates between two stats replies.

The daemon's counters count since it started; a rate is their difference between two
replies over the seconds between them (``seconds``, the daemon's own clock: the
difference of the replies' ``uptime_s``)::

    reply: previous ........................ current
    rate  = (current.counter - previous.counter) / seconds

A figure with nothing to compare is None (shown "-"): the first frame (no previous
reply), a pool or tier absent from the previous reply, a daemon that restarted between
the two (another epoch: :func:`comparable` drops the previous reply), a counter that
went back. Units: pages are pool pages (one page across every layer), tokens are prompt
tokens, bytes are bytes, "per s" per second; gauges (pages free, held, ...) are the
current reply's.

Pure: no I/O, no clock, nothing of rich; kvcore.top renders the :class:`Frame`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvcore_ipc.messages import PoolStats, SessionStats, StatsOk, TierStats

KEY_HEX = 12  # hex digits of a prefix key shown


@dataclass(slots=True, frozen=True)
class Header:
    """The daemon: who answers, since when, and its request load."""

    endpoint: str
    version: int  # protocol major
    epoch: int
    uptime_s: float
    requests_per_s: float | None
    errors: int  # error replies since the daemon started
    lease_expiries: int  # sessions whose lease ran out, since the daemon started


@dataclass(slots=True, frozen=True)
class PoolRow:
    """One pool: page gauges (pages), its hit rate (hit tokens / query tokens) over the
    interval and since start, and its load per second."""

    pool: str
    total: int
    free: int
    evictable: int
    held: int
    hit_rate: float | None  # over the interval; None: no tokens asked in it
    hit_rate_since_start: float | None  # None: no tokens asked yet
    query_tokens_per_s: float | None  # prompt tokens of allocations, per s
    evictions_per_s: float | None  # pages evicted from the pool, per s
    sequences: int
    sessions: int


@dataclass(slots=True, frozen=True)
class NamespaceRow:
    """One namespace of a pool: prompt tokens asked and hit in the window, the hit tokens
    by where their pages were ("pool", "host", "disk", "remote"; media with none left out).
    The window is the interval, or since start (``since_start``) on a first frame."""

    pool: str
    namespace: str
    query_tokens: int
    hit_tokens: dict[str, int]
    hit_rate: float | None  # sum(hit_tokens) / query_tokens; None: nothing asked
    since_start: bool


@dataclass(slots=True, frozen=True)
class TierRow:
    """One lower tier of a pool: gauges now, and per second over the interval."""

    pool: str
    medium: str
    pages: int  # entries held (pool pages)
    bytes_used: int
    hits_per_s: float | None  # pages read back into the pool, per s
    stored_per_s: float | None  # pages spilled into the tier, per s
    read_bytes_per_s: float | None  # payload bytes read back out (bytes_out), per s
    write_bytes_per_s: float | None  # payload bytes written in (bytes_in), per s
    corrupt: int  # entries that failed verification, since the daemon started
    timeouts: int  # store calls abandoned, since the daemon started
    promote_mean_s: float | None  # mean seconds of one request's promotion, interval


@dataclass(slots=True, frozen=True)
class NamespaceSessions:
    """The sessions attached to one namespace of a pool."""

    pool: str
    namespace: str
    sessions: int
    sequences: int  # live sequences of those sessions
    processes: int  # distinct pids


@dataclass(slots=True, frozen=True)
class ProcessRow:
    """One client process (pid, name) and its sessions, whatever their pools."""

    pid: int
    name: str
    namespaces: tuple[str, ...]  # "pool/namespace" of its sessions, sorted
    sessions: int
    sequences: int
    idle_ms: int  # since its most recently seen session's last request


@dataclass(slots=True, frozen=True)
class PrefixRow:
    """One of a pool's busiest prefixes, named by its first page key (``KEY_HEX`` hex
    digits): allocations that hit it and their hit tokens, over the interval where the
    key is in both replies, else since start (``since_start``)."""

    pool: str
    namespace: str
    key: str
    hits: int
    hit_tokens: int
    since_start: bool


@dataclass(slots=True, frozen=True)
class Frame:
    """Everything one refresh of ``kvcore top`` shows."""

    header: Header
    seconds: float | None  # the interval; None: a first frame, every rate None
    pools: list[PoolRow]
    namespaces: list[NamespaceRow]
    tiers: list[TierRow]
    namespace_sessions: list[NamespaceSessions]
    processes: list[ProcessRow]
    prefixes: list[PrefixRow]


def comparable(prev: StatsOk | None, cur: StatsOk) -> StatsOk | None:
    """``prev`` if its counters continue into ``cur``'s (the same daemon epoch), else None."""
    if prev is None or prev.counters.epoch != cur.counters.epoch:
        return None
    return prev


def daemon_seconds(prev: StatsOk, cur: StatsOk) -> float:
    """Seconds between two replies by the daemon's clock (its uptime at each)."""
    return cur.counters.uptime_s - prev.counters.uptime_s


def per_s(cur: float, prev: float | None, seconds: float | None) -> float | None:
    """(cur - prev) / seconds; None without a previous value, a positive interval, or
    when the counter went back."""
    if prev is None or seconds is None or seconds <= 0 or cur < prev:
        return None
    return (cur - prev) / seconds


def ratio(part: int, whole: int) -> float | None:
    """part / whole (a hit rate: hit tokens / query tokens); None when nothing was asked."""
    return part / whole if whole > 0 else None


def frame(endpoint: str, prev: StatsOk | None, cur: StatsOk, seconds: float | None) -> Frame:
    """The rows of one refresh: ``cur``'s gauges, rates against ``prev`` over ``seconds``
    (either None: a first frame; a ``prev`` of another epoch counts as none)."""
    prev = comparable(prev, cur)
    if prev is None or seconds is None:
        prev, seconds = None, None
    c, pc = cur.counters, prev.counters if prev is not None else None
    header = Header(
        endpoint,
        c.version,
        c.epoch,
        c.uptime_s,
        per_s(c.requests, pc.requests if pc else None, seconds),
        c.errors,
        c.expired_sessions,
    )
    before = {p.name: p for p in prev.pools} if prev is not None else {}
    pairs = [(before.get(p.name), p) for p in cur.pools]
    return Frame(
        header,
        seconds,
        [pool_row(old, new, seconds) for old, new in pairs],
        [row for old, new in pairs for row in namespace_rows(old, new, prev is None)],
        [row for old, new in pairs for row in tier_rows(old, new, seconds)],
        *session_rows(cur),
        [row for old, new in pairs for row in prefix_rows(old, new)],
    )


def pool_row(prev: PoolStats | None, cur: PoolStats, seconds: float | None) -> PoolRow:
    return PoolRow(
        cur.name,
        cur.total_pages,
        cur.free_pages,
        cur.evictable_pages,
        cur.held_pages,
        ratio(cur.hit_tokens - prev.hit_tokens, cur.query_tokens - prev.query_tokens)
        if prev is not None
        else None,
        ratio(cur.hit_tokens, cur.query_tokens),
        per_s(cur.query_tokens, prev.query_tokens if prev else None, seconds),
        per_s(cur.evictions, prev.evictions if prev else None, seconds),
        cur.num_sequences,
        cur.num_sessions,
    )


def namespace_rows(prev: PoolStats | None, cur: PoolStats, first: bool) -> list[NamespaceRow]:
    """Per namespace, tokens over the interval: a namespace absent from ``prev`` (a pool
    that was there) had counted nothing yet. ``first``: no previous reply, since start."""
    before = {n.namespace: n for n in prev.namespaces} if prev is not None else {}
    rows = []
    for n in cur.namespaces:
        old = before.get(n.namespace)
        asked = n.query_tokens - (old.query_tokens if old else 0)
        hit = {
            medium: tokens - (old.hit_tokens.get(medium, 0) if old else 0)
            for medium, tokens in n.hit_tokens.items()
        }
        hit = {medium: tokens for medium, tokens in hit.items() if tokens}
        rows.append(
            NamespaceRow(cur.name, n.namespace, asked, hit, ratio(sum(hit.values()), asked), first)
        )
    return rows


def tier_rows(prev: PoolStats | None, cur: PoolStats, seconds: float | None) -> list[TierRow]:
    before = {t.medium: t for t in prev.tiers} if prev is not None else {}
    return [tier_row(cur.name, before.get(t.medium), t, seconds) for t in cur.tiers]


def tier_row(pool: str, prev: TierStats | None, cur: TierStats, seconds: float | None) -> TierRow:
    mean = None
    if prev is not None:
        took_s, count = (
            cur.promote_s - prev.promote_s,
            sum(cur.promote_counts) - sum(prev.promote_counts),
        )
        mean = took_s / count if count > 0 else None
    return TierRow(
        pool,
        cur.medium,
        cur.pages,
        cur.bytes_used,
        per_s(cur.hits, prev.hits if prev else None, seconds),
        per_s(cur.stored, prev.stored if prev else None, seconds),
        per_s(cur.bytes_out, prev.bytes_out if prev else None, seconds),
        per_s(cur.bytes_in, prev.bytes_in if prev else None, seconds),
        cur.corrupt,
        cur.timeouts,
        mean,
    )


def session_rows(cur: StatsOk) -> tuple[list[NamespaceSessions], list[ProcessRow]]:
    """The sessions grouped by (pool, namespace), and by process (pid, name)."""
    by_ns: dict[tuple[str, str], list[SessionStats]] = defaultdict(list)
    by_proc: dict[tuple[int, str], list[SessionStats]] = defaultdict(list)
    for s in cur.sessions:
        by_ns[s.pool, s.namespace].append(s)
        by_proc[s.pid, s.name].append(s)
    return (
        [
            NamespaceSessions(
                pool,
                ns,
                len(group),
                sum(s.num_sequences for s in group),
                len({s.pid for s in group}),
            )
            for (pool, ns), group in sorted(by_ns.items())
        ],
        [
            ProcessRow(
                pid,
                name,
                tuple(sorted({f"{s.pool}/{s.namespace}" for s in group})),
                len(group),
                sum(s.num_sequences for s in group),
                min(s.idle_ms for s in group),
            )
            for (pid, name), group in sorted(by_proc.items())
        ],
    )


def prefix_rows(prev: PoolStats | None, cur: PoolStats) -> list[PrefixRow]:
    """The pool's busiest prefixes, most hit tokens first: over the interval where the key
    was in both replies and its counts did not go back (its slot given to another prefix
    meanwhile), else since start (a prefix new to the list: hit in the interval, most
    likely; the daemon's order breaks ties)."""
    before = {(h.namespace, h.key): h for h in prev.busiest} if prev is not None else {}
    rows = []
    for h in cur.busiest:
        key = h.key.hex()[:KEY_HEX]
        old = before.get((h.namespace, h.key))
        if old is not None and h.hits >= old.hits and h.hit_tokens >= old.hit_tokens:
            hits, tokens = h.hits - old.hits, h.hit_tokens - old.hit_tokens
            rows.append(PrefixRow(cur.name, h.namespace, key, hits, tokens, False))
        else:
            rows.append(PrefixRow(cur.name, h.namespace, key, h.hits, h.hit_tokens, True))
    rows.sort(key=lambda row: -row.hit_tokens)  # stable
    return rows
