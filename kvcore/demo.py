"""``kvcore demo``: two engine processes share one prefix cache through the daemon.

The demo starts ``kvcore serve`` with a host pool that fits the demo model
(kvcore.demo_model: Llama architecture, random weights from a
fixed seed, nothing downloaded), or attaches to ``--endpoint``. It then runs two
engine processes. Each builds the same model, asks its own question after the
same system prompt with transformers' ``generate()`` on a KVCoreCache, and
runs the same prompt with transformers' own DynamicCache for comparison.
Engine A goes first and commits the system prompt's pages; engine B, a
separate process, then gets them as a prefix hit and computes only the rest.

Checks (exit status 1 if any fails): each engine's tokens equal its
DynamicCache run; B is served at least the system prompt's full pages from
the cache; and, for a daemon the demo started, no sequence is held at the end.

``python -m kvcore.demo ENDPOINT POOL ROLE`` is the engine process itself (it
prints one JSON report line; role B waits for a line on stdin first).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

ROLES = {"A": "engine A", "B": "engine B"}
SYSTEM_PROMPT_TOKENS = 56  # 3 full pages of 16 tokens + 8
QUESTION_TOKENS = 12
NEW_TOKENS = 24
PAGE_SIZE = 16
NAMESPACE = "kvcore-demo"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint", help="attach to this daemon instead of starting one")
    parser.add_argument("--pool", default="default", help="pool name (default: default)")
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help="tokens per engine")


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kvcore.daemon_process import DaemonProcess
    from kvcore.demo_model import TinyLlama

    console = Console()
    spec = TinyLlama()
    console.print(
        f"[bold]kvcore demo[/]: a {spec.num_layers}-layer Llama ({spec.num_heads} query / "
        f"{spec.num_kv_heads} KV heads, random weights, seed {spec.seed}); a system prompt of "
        f"{SYSTEM_PROMPT_TOKENS} tokens shared by two engine processes"
    )
    flag = spec.pool_flag(page_size=PAGE_SIZE, num_pages=512, name=args.pool)
    try:
        if args.endpoint:
            return _run(console, args.endpoint, args.pool, args.new_tokens, flag, owned=False)
        with console.status("starting kvcore serve ..."):
            daemon = DaemonProcess.private("--pool", flag).start()
        try:
            console.print(f"daemon: {daemon.lines[0].strip()}")
            console.print(f"        {daemon.lines[1].strip()}")
            return _run(console, daemon.endpoint, args.pool, args.new_tokens, flag, owned=True)
        finally:
            daemon.stop()
            console.print("daemon stopped (pool unlinked, socket removed)")
    except KeyboardInterrupt:  # the engines and the daemon were stopped on the way out
        console.print("[yellow]interrupted[/]")
        return 130


def _run(console: Any, endpoint: str, pool: str, new_tokens: int, flag: str, *, owned: bool) -> int:
    """Run both engines on ``pool`` of the daemon at ``endpoint``; ``flag`` is the
    ``--pool`` value of a pool that fits the demo model (printed if this one does not)."""
    from kvcore.client import Client
    from kvcore.errors import KVCoreError

    try:
        probe = Client.connect(
            endpoint,
            pool=pool,
            namespace=NAMESPACE,
            map_memory=False,
            heartbeat=False,
            timeout_s=5.0,
        )
    except KVCoreError as exc:
        console.print(f"[red]cannot attach to {endpoint} pool {pool!r}: {exc}[/]")
        return 1
    misfit = _misfit(probe.layout, flag)
    if misfit:
        probe.close()
        console.print(
            f"[red]pool {pool!r} at {endpoint} does not fit the demo model ({misfit}).[/]\n"
            f"Start a daemon with a pool that does:\n  kvcore serve --pool {flag}",
            soft_wrap=True,  # a command to paste: never wrapped
        )
        return 1
    procs: dict[str, subprocess.Popen[str]] = {}
    reports: dict[str, dict[str, Any]] = {}
    try:
        # both engines start at once (imports and model build overlap); B waits for A
        procs = {role: start_engine(endpoint, pool, role, new_tokens) for role in ROLES}
        with console.status("engine A: loading, then generating on a cold cache ..."):
            reports["A"] = finish_engine(procs["A"])
        console.print(f"engine A done: {len(reports['A']['tokens'])} tokens")
        with console.status("engine B: generating; the system prompt is cached by A ..."):
            reports["B"] = finish_engine(procs["B"], go=True)
        console.print(f"engine B done: {len(reports['B']['tokens'])} tokens")
        stats = probe.stats()
    except (RuntimeError, subprocess.TimeoutExpired, KVCoreError) as exc:
        console.print(f"[red]{exc}[/]")
        return 1
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        probe.close()
    return _report(console, reports, stats, owned)


def _misfit(layout: Any, flag: str) -> str:
    """What of ``layout`` differs from the ``--pool`` flag the demo needs ("" if it fits;
    the page count and name may differ)."""
    want = dict(item.split("=", 1) for item in flag.split(","))
    have = layout.to_dict()
    return ", ".join(
        f"{key} {have[key]} (needs {want[key]})"
        for key in ("num_layers", "num_kv_heads", "head_dim", "page_size", "dtype")
        if str(have[key]) != want[key]
    )


def start_engine(
    endpoint: str, pool: str, role: str, new_tokens: int = NEW_TOKENS
) -> subprocess.Popen[str]:
    """An engine process (``python -m kvcore.demo``); role "B" waits for a stdin line."""
    return subprocess.Popen(
        [sys.executable, "-m", "kvcore.demo", endpoint, pool, role, str(new_tokens)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish_engine(
    proc: subprocess.Popen[str], *, go: bool = False, timeout_s: float = 120
) -> dict[str, Any]:
    """The engine's JSON report; ``go`` releases a waiting engine. RuntimeError if it failed."""
    out, err = proc.communicate("go\n" if go else "", timeout=timeout_s)
    if proc.returncode != 0 or not out.strip():
        raise RuntimeError(f"engine exited with {proc.returncode}:\n{err}")
    report: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return report


def _report(console: Any, reports: dict[str, dict[str, Any]], stats: Any, owned: bool) -> int:
    from rich.table import Table

    table = Table(title="two engine processes, one prefix cache", show_header=True)
    headers = (
        "engine",
        "prompt tokens",
        "from cache",
        "pages shared",
        "TTFT",
        "HF TTFT",
        "same tokens",
    )
    for column in headers:
        table.add_column(column, justify="right")
    for role, r in reports.items():
        table.add_row(
            role,
            str(r["prompt_tokens"]),
            str(r["cached_tokens"]),
            str(r["pages_shared"]),
            f"{r['ttft_ms']:.1f} ms",
            f"{r['dynamic_ttft_ms']:.1f} ms",
            "[green]yes[/]" if r["equal"] else "[red]NO[/]",
        )
    console.print(table)
    console.print(
        f"daemon stats: {stats.total_pages} pages, {stats.held_pages} held, {stats.cached_pages} "
        f"cached ({stats.evictable_pages} evictable), {stats.num_sequences} sequences; "
        f"{stats.hit_tokens} of {stats.query_tokens} prompt tokens served from the cache "
        f"(hit rate {stats.hit_rate:.0%})"
    )
    shared_pages = SYSTEM_PROMPT_TOKENS // PAGE_SIZE
    checks = {
        "engine A's tokens equal DynamicCache's": reports["A"]["equal"],
        "engine B's tokens equal DynamicCache's": reports["B"]["equal"],
        f"engine B reused the system prompt's {shared_pages} full pages": (
            reports["B"]["pages_shared"] >= shared_pages
        ),
    }
    if owned:
        checks["no sequence held after the engines finished"] = stats.num_sequences == 0
    for name, ok in checks.items():
        console.print(f"  {'[green]ok[/]  ' if ok else '[red]FAIL[/]'} {name}")
    return 0 if all(checks.values()) else 1


def _engine(endpoint: str, pool: str, role: str, new_tokens: int) -> dict[str, Any]:
    """One engine: the same model and system prompt in every process, its own question."""
    import torch
    from transformers import DynamicCache

    from kvcore.backend import get as get_backend
    from kvcore.client import Client
    from kvcore.demo_model import TinyLlama, timed_greedy
    from kvcore.integrations.transformers import KVCoreCache

    torch.set_num_threads(1)  # two engines on a small machine: no thread oversubscription
    spec = TinyLlama()
    model = spec.build()
    prompt = spec.prompt(SYSTEM_PROMPT_TOKENS, seed=7) + spec.prompt(
        QUESTION_TOKENS, seed=100 + ord(role)
    )
    backend = get_backend("torch")
    with Client.connect(endpoint, pool=pool, namespace=NAMESPACE, name=f"demo-{role}") as client:
        # warm up both paths on 8 tokens (less than a page: nothing is committed)
        timed_greedy(model, [prompt[:8]], 2, DynamicCache())
        with KVCoreCache(client, model, backend=backend) as cache:
            timed_greedy(model, [prompt[:8]], 2, cache)
        if role == "B":
            sys.stdin.readline()  # until engine A has committed the system prompt
        dynamic, dyn_stamps = timed_greedy(model, [prompt], new_tokens, DynamicCache())
        with KVCoreCache(client, model, backend=backend) as cache:
            tokens, stamps = timed_greedy(model, [prompt], new_tokens, cache)
            cached = cache.num_cached_tokens
        page_size = client.layout.page_size
    return {
        "role": role,
        "prompt_tokens": len(prompt),
        "cached_tokens": cached,
        "pages_shared": cached // page_size,
        "ttft_ms": (stamps[1] - stamps[0]) * 1e3,
        "dynamic_ttft_ms": (dyn_stamps[1] - dyn_stamps[0]) * 1e3,
        "equal": bool(torch.equal(tokens, dynamic)),
        "tokens": tokens[0].tolist(),
    }


if __name__ == "__main__":  # an engine process: ENDPOINT POOL ROLE [NEW_TOKENS]
    _argv = sys.argv[1:]
    _started = time.perf_counter()
    _result = _engine(_argv[0], _argv[1], _argv[2], int(_argv[3]) if len(_argv) > 3 else NEW_TOKENS)
    _result["wall_s"] = time.perf_counter() - _started
    print(json.dumps(_result), flush=True)
