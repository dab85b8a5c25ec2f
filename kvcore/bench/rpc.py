"""``kvcore bench rpc``: daemon round trips against a raw ZeroMQ echo, same run, same size.

Three figures, all over ``ipc://`` between two processes on this machine:

* echo: a raw pyzmq DEALER -> ROUTER -> DEALER echo of a frame as large as the
  encoded single-op request (the floor any RPC over ZeroMQ pays);
* single: ``client.extend(seq, 1)`` through a real ``kvcore serve`` (decode,
  session and ownership checks, Manager.extend, encode);
* batched: one batch of ``--batch`` extends (one per sequence, as in one
  scheduler step), divided by the batch size.

Echo, single-op and batch samples are taken in alternating rounds so that
machine noise hits all three alike. Targets: ``single_p50_ratio <= 1.15`` (the
daemon's work, ~10 µs, within 15% of the round trip any ZeroMQ RPC pays; it was 1.5 until
issue 31) and ``batched_per_op_ratio <= 0.1``.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcore.bench.report import Figure, Target
from kvcore.layout import cdiv

if TYPE_CHECKING:
    from kvcore.client import Client

SINGLE_TARGET = 1.15
BATCHED_TARGET = 0.1
HEADLINE = (  # what `kvcore bench rpc` prints without --json (docs/benchmarks.md)
    Figure("echo_p50_us", "raw ZeroMQ echo, p50 µs"),
    Figure("single_p50_us", "one extend through the daemon, p50 µs"),
    Figure("single_p99_us", "one extend through the daemon, p99 µs"),
    Figure("single_p50_ratio", "single p50 / echo p50", Target("<=", SINGLE_TARGET)),
    Figure("batched_per_op_us", "per op in a batch of 256, µs"),
    Figure("batched_per_op_ratio", "batched per op / single p50", Target("<=", BATCHED_TARGET)),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--iterations", type=int, default=10000, help="single-op (and echo) samples"
    )
    parser.add_argument("--batch", type=int, default=256, help="extends per batch")
    parser.add_argument("--batches", type=int, default=400, help="batch samples")
    parser.add_argument("--block", type=int, default=100, help="samples per alternating block")


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _timed(call: Callable[[], object], n: int, out: list[float]) -> None:
    clock = time.perf_counter
    for _ in range(n):
        start = clock()
        call()
        out.append(clock() - start)


@contextlib.contextmanager
def _process(*argv: str, ready: str) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if ready in line:
                break
        else:
            raise RuntimeError(f"{argv} exited before it was ready")
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _echo_server(endpoint: str) -> None:
    """A raw ROUTER echo: the baseline any ZeroMQ RPC pays."""
    import zmq

    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(endpoint)
    print("echo ready", flush=True)
    while True:
        sock.send_multipart(sock.recv_multipart())


@dataclass(slots=True)
class _Samples:
    """What one run measured: the single-op request's size (bytes) and the round
    trips of each kind (seconds each; a batch sample is the whole batch)."""

    message_bytes: int
    echo_s: list[float] = field(default_factory=list)
    single_s: list[float] = field(default_factory=list)
    batch_s: list[float] = field(default_factory=list)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvcore.client import Client
    from kvcore.daemon_process import DaemonProcess

    with tempfile.TemporaryDirectory(prefix="kvcore-bench-") as tmp:
        daemon_ep, echo_ep = f"ipc://{Path(tmp) / 'd.sock'}", f"ipc://{Path(tmp) / 'e.sock'}"
        pool = "name=bench,num_layers=1,num_kv_heads=1,head_dim=8,page_size=16,dtype=float16,num_pages=200000"
        with (
            DaemonProcess("--endpoint", daemon_ep, "--pool", pool, "--lease-timeout", "600"),
            _process("-m", "kvcore.bench.rpc", "--echo-server", echo_ep, ready="echo ready"),
            Client.connect(daemon_ep, pool="bench", map_memory=False, heartbeat=False) as client,
        ):
            samples = _measure(client, echo_ep, args)
    return _report(samples, args.batch)


def _measure(client: Client, echo_ep: str, args: argparse.Namespace) -> _Samples:
    """Sample echo, single-op and batch round trips through ``client`` and the echo
    server at ``echo_ep``, in alternating rounds (after a warm-up of each)."""
    import msgspec
    import zmq
    from kvcore_ipc import messages as msg

    client.allocate(0, [1])
    request = msgspec.msgpack.encode(
        msg.Request(1 << 20, msg.Extend(0, 1), client.session, client.epoch)
    )
    echo: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    echo.setsockopt(zmq.LINGER, 0)
    echo.connect(echo_ep)

    def echo_once() -> None:
        echo.send(request)
        echo.recv()

    def op_once() -> None:
        client.extend(0, 1)

    seqs = range(1, args.batch + 1)
    setup = client.batch()
    for seq in seqs:
        setup.allocate(seq, [1])
    setup.run()

    def batch_once() -> None:
        batch = client.batch()
        for seq in seqs:
            batch.extend(seq, 1)
        batch.run()

    for call in (echo_once, op_once, batch_once):
        _timed(call, 20, [])  # warm-up
    # Rounds of (echo block, single-op block, a few batches): load changes on the
    # machine hit all three alike instead of skewing one of them.
    samples = _Samples(len(request))
    rounds = max(1, args.iterations // args.block)
    per_round = cdiv(args.batches, rounds)
    for _ in range(rounds):
        _timed(echo_once, args.block, samples.echo_s)
        _timed(op_once, args.block, samples.single_s)
        _timed(batch_once, per_round, samples.batch_s)
    echo.close()
    return samples


def _report(samples: _Samples, batch_size: int) -> dict[str, Any]:
    """The bench's JSON object: percentiles in µs, the ratios and their targets."""
    us = 1e6
    echo_s, single_s, batch_s = samples.echo_s, samples.single_s, samples.batch_s
    echo_p50, single_p50 = _percentile(echo_s, 0.5), _percentile(single_s, 0.5)
    batch_p50 = _percentile(batch_s, 0.5)
    per_op = batch_p50 / batch_size
    return {
        "transport": "ipc",
        "message_bytes": samples.message_bytes,
        "echo_p50_us": echo_p50 * us,
        "echo_p99_us": _percentile(echo_s, 0.99) * us,
        "single_op": "extend(seq, 1)",
        "single_p50_us": single_p50 * us,
        "single_p99_us": _percentile(single_s, 0.99) * us,
        "single_p50_ratio": single_p50 / echo_p50,
        "batch_size": batch_size,
        "batch_p50_us": batch_p50 * us,
        "batch_p99_us": _percentile(batch_s, 0.99) * us,
        "batched_per_op_us": per_op * us,
        "batched_per_op_ratio": per_op / single_p50,
        "targets": {"single_p50_ratio": SINGLE_TARGET, "batched_per_op_ratio": BATCHED_TARGET},
        "meets_targets": single_p50 / echo_p50 <= SINGLE_TARGET
        and per_op / single_p50 <= BATCHED_TARGET,
    }


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--echo-server":
        _echo_server(sys.argv[2])
