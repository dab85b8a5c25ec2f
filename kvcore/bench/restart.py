"""``kvcore bench restart``: what keeping a pool across restarts costs, and buys.

A real ``kvcore serve --restore`` on a temporary endpoint, its pool filled with committed
prompts of 64 pages (bytes untouched: a restart reads the index, not the pages):

* ``readopt_s``: the re-adopt time the restarted daemon logs (table opened, every slot
  verified, the Manager rebuilt) after a SIGKILL, with ``readopted_pages`` (it must
  equal ``committed_pages``); ``start_s``: the whole start, as its launcher sees it;
* ``pause_s``: from a SIGTERM to the first hit a new client gets from the next daemon
  (median of ``--restarts``);
* ``takeover_pause_s``: across a ``kvcore serve --takeover``, the longest time a client
  looking a prompt up in a loop goes without a hit (its StaleEpoch, the 50 ms an
  engine's Reconnector then waits, and its re-attach included; median of ``--restarts``);
* ``mirror_ops_ratio``: in process, a Manager's allocate/commit/free cycles per second
  with the durable index (kvcore.daemon.index_table.MirroredIndex) over the same with a
  plain PrefixIndex, interleaved in this run (each cycle evicts: the table's cost is on
  commits and evictions only).

The pool is unlinked at the end (a ``--no-restore`` start sweeps what the runs kept).
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import re
import signal
import statistics
import tempfile
import threading
import time
from typing import Any

from kvcore.bench.report import Figure, Target

HEADLINE = (
    Figure("committed_pages", "pages committed before the restart"),
    Figure(
        "readopted_pages",
        "pages re-adopted after a SIGKILL",
        Target("==", "committed_pages", required=True),
    ),
    Figure("readopt_s", "re-adopt time the daemon logs, s"),
    Figure("start_s", "daemon start after a SIGKILL, s"),
    Figure("pause_s", "SIGTERM to a new client's first hit, median s"),
    Figure("takeover_pause_s", "longest time without a hit across a takeover, median s"),
    Figure("mirror_ops_ratio", "Manager cycles/s, durable index / plain"),
)
FULL_POOL = "num_layers=2,num_kv_heads=2,head_dim=64,page_size=64,dtype=bfloat16,size=16GiB"
QUICK_POOL = "num_layers=2,num_kv_heads=2,head_dim=64,page_size=64,dtype=bfloat16,size=256MiB"
PROMPT_PAGES = 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pool",
        default=FULL_POOL,
        help="the pool's --pool settings (default: 16 GiB of 64 KiB pages, 262,144 pages)",
    )
    parser.add_argument("--restarts", type=int, default=5, help="SIGTERM restarts timed")
    parser.add_argument("--quick", action="store_true", help="a 256 MiB pool, 2 restarts")


def run(args: argparse.Namespace) -> dict[str, Any]:
    pool = QUICK_POOL if args.quick else args.pool
    restarts = 2 if args.quick else args.restarts
    result = _daemon_figures("name=default," + pool, restarts)
    plain, mirrored = _cycles_per_s(rounds=3 if args.quick else 7)
    result.update(
        pool=pool,
        plain_cycles_per_s=plain,
        mirror_cycles_per_s=mirrored,
        mirror_ops_ratio=mirrored / plain,
    )
    return result


def _daemon_figures(pool: str, restarts: int) -> dict[str, Any]:
    from kvcore.client import Client
    from kvcore.daemon_process import DaemonProcess

    endpoint = f"ipc://{tempfile.mkdtemp(prefix='kvcore-bench-')}/kvcore.sock"
    flags = ("--endpoint", endpoint, "--pool", pool, "--restore")
    daemon = DaemonProcess(*flags, timeout_s=600).start()
    try:
        with Client.connect(endpoint, map_memory=False) as client:
            committed, first = _fill(client)
        daemon.stop(signal.SIGKILL)
        began = time.perf_counter()
        daemon = DaemonProcess(*flags, timeout_s=600).start()
        start_s = time.perf_counter() - began
        found = re.search(r"re-adopted (\d+) committed pages of \S+ in ([0-9.]+) s", daemon.output)
        pauses = []
        for _ in range(restarts):
            began = time.perf_counter()
            daemon.stop(signal.SIGTERM)
            daemon = DaemonProcess(*flags, timeout_s=600).start()
            _first_hit(endpoint, first)
            pauses.append(time.perf_counter() - began)
        takeovers = []
        for _ in range(restarts):
            daemon, gap = _takeover(daemon, flags, first)
            takeovers.append(gap)
    finally:
        daemon.stop()
        DaemonProcess(*flags[:4], "--no-restore").start().stop()  # unlinks what was kept
    return {
        "endpoint": endpoint,
        "committed_pages": committed,
        "readopted_pages": int(found.group(1)) if found else 0,
        "readopt_s": float(found.group(2)) if found else float("nan"),
        "start_s": start_s,
        "pause_s": statistics.median(pauses) if pauses else float("nan"),
        "pause_samples_s": pauses,
        "takeover_pause_s": statistics.median(takeovers) if takeovers else float("nan"),
        "takeover_samples_s": takeovers,
    }


def _fill(client: Any) -> tuple[int, list[int]]:
    """Commit prompts of PROMPT_PAGES pages until the pool is full: the pages, and the
    first prompt's tokens."""
    page_size = client.layout.page_size
    prompts = client.layout.num_pages // PROMPT_PAGES
    for n in range(prompts):
        tokens = [n * 1_000_003 + t for t in range(PROMPT_PAGES * page_size)]
        batch = client.batch()
        batch.allocate(n + 1, tokens, compute_last=False)
        batch.commit(n + 1, tokens)
        batch.free(n + 1)
        batch.run()
    return prompts * PROMPT_PAGES, list(range(PROMPT_PAGES * page_size))


def _first_hit(endpoint: str, tokens: list[int], deadline_s: float = 60.0) -> None:
    """Wait until a new client hits ``tokens`` (TimeoutError past ``deadline_s``)."""
    from kvcore.client import Client
    from kvcore.errors import KVCoreError

    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            with Client.connect(endpoint, map_memory=False, timeout_s=1.0) as client:
                if client.lookup(tokens, compute_last=False).num_cached_tokens:
                    return
        except KVCoreError:
            time.sleep(0.01)
    raise TimeoutError(f"no hit on {endpoint} within {deadline_s} s")


def _takeover(old: Any, flags: tuple[str, ...], tokens: list[int]) -> tuple[Any, float]:
    """Start a daemon with ``--takeover`` of ``old`` while a client looks ``tokens`` up in a
    loop (and attaches again when its daemon is gone: StaleEpoch, or Timeout while none
    listens): the new daemon, and the longest time the client went without a hit, seconds.
    The new daemon is stopped if anything fails."""
    from kvcore.client import Client
    from kvcore.daemon_process import DaemonProcess
    from kvcore.errors import KVCoreError
    from kvcore.integrations.reconnect import SOON_S

    endpoint, stop, gaps = flags[1], threading.Event(), []

    def probe(client: Client) -> None:
        last = longest = 0.0
        try:
            while not stop.is_set():
                try:
                    hit = client.lookup(tokens, compute_last=False).num_cached_tokens
                except KVCoreError:
                    time.sleep(SOON_S)  # as an engine's Reconnector waits, then attaches again
                    with contextlib.suppress(KVCoreError):
                        client.reconnect()
                    continue
                now = time.perf_counter()
                if hit:
                    longest, last = max(longest, now - last) if last else longest, now
        except BaseException:
            longest = float("nan")  # the probe failed: no figure
            raise
        finally:
            gaps.append(longest)

    client = Client.connect(endpoint, map_memory=False, heartbeat=False)
    thread = threading.Thread(target=probe, args=(client,))
    thread.start()
    daemon = DaemonProcess(*flags, "--takeover", timeout_s=600)
    try:
        daemon.start()
        old.stop()  # it exits by itself: this reaps it
        _first_hit(endpoint, tokens)
        time.sleep(0.2)  # the probe's own hits resumed
    except BaseException:
        if daemon.proc is not None:
            daemon.stop()
        raise
    finally:
        stop.set()
        thread.join()
        client.close()
    return daemon, gaps[0]


def _cycles_per_s(rounds: int) -> tuple[float, float]:
    """Median allocate/commit/free cycles a second of a Manager that evicts on every cycle,
    with a plain PrefixIndex and with a MirroredIndex, alternating which runs first."""
    plain: list[float] = []
    mirrored: list[float] = []
    for r in range(rounds):
        for mirror in (False, True) if r % 2 == 0 else (True, False):
            (mirrored if mirror else plain).append(_cycles(mirror))
    return statistics.median(plain), statistics.median(mirrored)


def _cycles(mirror: bool, cycles: int = 2000, num_pages: int = 1024, page_size: int = 16) -> float:
    from kvcore.daemon.index_table import IndexTable, MirroredIndex
    from kvcore.layout import KVLayout
    from kvcore.manager import Manager

    layout = KVLayout(1, 1, 1, page_size, "float16", num_pages)
    if mirror:
        buf = mmap.mmap(-1, IndexTable.size_for(num_pages, page_size))
        table = IndexTable.create(
            buf, num_pages=num_pages, page_size=page_size, settings_digest=b""
        )
        manager = Manager(layout, index=MirroredIndex(table))
    else:
        manager = Manager(layout)
    prompts = [  # 256 prompts of 3-12 pages on 8 shared 2-page prefixes: hits and evictions
        [i % 8] * (2 * page_size) + [(i * 7919 + j) % 50000 for j in range((1 + i % 9) * page_size)]
        for i in range(256)
    ]
    began = time.perf_counter()
    for c in range(cycles):
        tokens = prompts[(c * 37) % len(prompts)]
        manager.allocate(1, tokens)
        manager.commit(1, tokens)
        manager.free(1)
        manager.take_events()
    return cycles / (time.perf_counter() - began)
