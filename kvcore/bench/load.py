"""``kvcore bench load``: N client processes doing random valid operations, with markers.

A private daemon serves one float32 host pool. Each of ``--clients`` worker
processes runs for ``--seconds``: random allocate / extend / commit / fork /
free / lookup / batch on its own sequences (per-worker id ranges, shared
prompts so prefix hits happen). Into every page a sequence got for itself
(the fresh pages of allocate and extend, the destination of a copy-on-write)
it writes a marker (worker, counter) in every layer, and before freeing the
sequence it checks those pages still hold it: a page another process wrote
while this one owned it is *clobbered*. Figures:

* ``ops_per_s``: operations per second, all workers together (a batch counts
  its ops); ``p99_ms``: 99th percentile of one call's latency;
* ``clobbered_pages``: must be 0; ``held_after``: pages still held once every
  worker detached (must be 0);
* ``rss_growth_mib``: the daemon's RSS at the end minus after the warm-up
  (the first quarter of the run);
* ``metrics_scrapes``: scrapes of the daemon's metrics port, 10 a second through
  the whole run (Prometheus and a health checker at once: they must cost neither
  clobbered pages nor memory).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvcore.bench.report import Figure, Target

PAGE_SIZE = 16
HEADLINE = (  # what `kvcore bench load` prints without --json (docs/benchmarks.md)
    Figure("ops_per_s", "operations / s, all clients"),
    Figure("p99_ms", "p99 latency, ms"),
    Figure("clobbered_pages", "pages another process wrote", Target("==", 0)),
    Figure("checked_pages", "pages checked"),
    Figure("held_after", "pages held after every client detached", Target("==", 0)),
    Figure("rss_growth_mib", "daemon RSS growth, MiB", Target("<=", 20)),
    Figure("metrics_scrapes", "metrics scrapes during the run"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clients", type=int, default=8, help="worker processes")
    parser.add_argument("--seconds", type=float, default=30.0, help="run time of each worker")
    parser.add_argument("--pages", type=int, default=2048, help="pages of the pool")
    parser.add_argument("--lease", type=float, default=5.0, help="the daemon's lease (seconds)")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the workers")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvcore.client import Client
    from kvcore.daemon_process import DaemonProcess

    pool = (
        f"name=load,num_layers=2,num_kv_heads=1,head_dim=8,page_size={PAGE_SIZE},"
        f"dtype=float32,num_pages={args.pages}"
    )
    flags = ("--pool", pool, "--lease-timeout", str(args.lease), "--metrics-port", "0")
    with DaemonProcess.private(*flags) as daemon, _Scraper(daemon.lines) as scraper:
        assert daemon.proc is not None
        worker = [sys.executable, "-m", "kvcore.bench.load", daemon.endpoint]
        workers = [
            subprocess.Popen(
                [*worker, str(i), str(args.seconds), str(args.seed)],
                stdout=subprocess.PIPE,
                text=True,
            )
            for i in range(args.clients)
        ]
        time.sleep(args.seconds / 4 + 2)  # start-up and warm-up
        rss_start = _rss_mib(daemon.proc.pid)
        reports = [json.loads(w.communicate(timeout=args.seconds * 4 + 120)[0]) for w in workers]
        rss_end = _rss_mib(daemon.proc.pid)
        with Client.connect(daemon.endpoint, pool="load", map_memory=False) as probe:
            deadline = time.monotonic() + 5
            while probe.stats().held_pages and time.monotonic() < deadline:
                time.sleep(0.05)  # ended sessions drain in the daemon's next ticks
            held_after = probe.stats().held_pages
            probe.check_integrity()
    latencies = sorted(x for r in reports for x in r["latencies_ms"])
    ops = sum(r["ops"] for r in reports)
    codes = sorted({code for r in reports for code in r["errors"]})
    return {
        "clients": args.clients,
        "seconds": args.seconds,
        "ops_per_s": round(ops / args.seconds),
        "p99_ms": round(latencies[int(0.99 * (len(latencies) - 1))], 3) if latencies else 0.0,
        "clobbered_pages": sum(r["clobbered"] for r in reports),
        "checked_pages": sum(r["checked"] for r in reports),
        "errors": {k: sum(r["errors"].get(k, 0) for r in reports) for k in codes},
        "held_after": held_after,
        "rss_growth_mib": round(rss_end - rss_start, 1),
        "metrics_scrapes": scraper.scrapes,
    }


class _Scraper:
    """Scrapes the daemon's /metrics every ``interval_s`` in a thread until closed;
    ``scrapes`` counts the answered ones. ``lines``: the daemon's banner lines."""

    def __init__(self, lines: list[str], interval_s: float = 0.1) -> None:
        banner = next(ln for ln in lines if ln.startswith("  metrics: "))
        self.url = banner.split()[1].rstrip(",")
        self.interval_s = interval_s
        self.scrapes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scraper", daemon=True)

    def __enter__(self) -> _Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=15)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            with contextlib.suppress(OSError), urllib.request.urlopen(self.url, timeout=10) as r:
                r.read()
                self.scrapes += 1


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


# -- the worker process -----------------------------------------------------------------


class _Worker:
    """One client's random walk; ``mine[seq]`` maps the pages it wrote to their marker."""

    def __init__(self, endpoint: str, wid: int, seed: int) -> None:
        from kvcore.client import Client

        self.client = Client.connect(endpoint, pool="load", namespace=f"ns{wid % 2}")
        self.rng = random.Random(seed * 1000 + wid)
        self.wid = wid
        self.base = (wid + 1) << 32  # this worker's sequence ids
        self.next = 0
        self.counter = 0
        self.mine: dict[int, dict[int, float]] = {}  # seq -> page -> marker
        self.tokens: dict[int, list[int]] = {}  # seq -> its tokens (what a commit publishes)
        self.ops = self.clobbered = self.checked = 0
        self.errors: dict[str, int] = {}
        self.latencies: list[float] = []
        self.prompts = [[self.rng.randrange(50_000) for _ in range(200)] for _ in range(4)]

    def _mark(self, seq: int, pages: list[int]) -> None:
        for page in pages:
            self.counter += 1
            marker = float(self.wid * 1_000_000 + self.counter % 1_000_000)
            for layer in self.client.kv_caches:
                layer[page].fill_(marker)
            self.mine[seq][page] = marker

    def _check(self, seq: int) -> None:
        for page, marker in self.mine.pop(seq, {}).items():
            self.checked += 1
            if any(bool((layer[page] != marker).any()) for layer in self.client.kv_caches):
                self.clobbered += 1

    def step(self) -> None:
        from kvcore.errors import KVCoreError

        rng, client = self.rng, self.client
        live = list(self.mine)
        choice = rng.random()
        started = time.perf_counter()
        try:
            if not live or choice < 0.25:
                seq = self.base + self.next
                self.next += 1
                prompt = rng.choice(self.prompts)[: rng.randrange(1, 200)]
                got = client.allocate(seq, prompt)
                self.mine[seq], self.tokens[seq] = {}, prompt
                self._mark(seq, got.pages[got.num_cached_tokens // PAGE_SIZE :])
            elif choice < 0.5:
                seq = rng.choice(live)
                more = [rng.randrange(50_000) for _ in range(rng.randrange(1, 40))]
                ext = client.extend(seq, len(more))
                self.tokens[seq] = self.tokens[seq] + more
                for src, _dst in ext.copies:  # the table no longer names src: not ours to check
                    self.mine[seq].pop(src, None)
                self._mark(seq, ext.new_pages + [dst for _, dst in ext.copies])
            elif choice < 0.6:
                seq = rng.choice(live)
                client.commit(seq, self.tokens[seq])
                self.ops += 1
            elif choice < 0.7:
                child = self.base + self.next
                self.next += 1
                parent = rng.choice(live)
                client.fork(parent, child)
                self.mine[child], self.tokens[child] = {}, self.tokens[parent]
            elif choice < 0.9 or len(live) > 32:
                seq = rng.choice(live)
                self._check(seq)
                client.free(seq)
                del self.tokens[seq]
            else:
                with client.batch() as batch:
                    for _ in range(8):
                        batch.lookup(rng.choice(self.prompts))
                self.ops += 7
        except KVCoreError as exc:  # out_of_pages (the pool is full), quota_exceeded
            self.errors[exc.code] = self.errors.get(exc.code, 0) + 1
        self.ops += 1
        self.latencies.append((time.perf_counter() - started) * 1000)

    def finish(self) -> dict[str, Any]:
        for seq in list(self.mine):
            self._check(seq)
        self.client.close()
        return {
            "ops": self.ops,
            "clobbered": self.clobbered,
            "checked": self.checked,
            "errors": self.errors,
            "latencies_ms": self.latencies,
        }


def _worker_main(endpoint: str, wid: int, seconds: float, seed: int) -> None:
    worker = _Worker(endpoint, wid, seed)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        worker.step()
    print(json.dumps(worker.finish()))


if __name__ == "__main__":  # a worker: python -m kvcore.bench.load ENDPOINT ID SECONDS SEED
    _worker_main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))
