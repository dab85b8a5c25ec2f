"""Issue 18 point 1: no local user can crash or stall the daemon through its metrics port.

A real daemon whose descriptors are few (soft = hard = 256, so the raise at start
cannot lift them) is flooded with more idle connections than that, each sending a
partial ``GET /metrics`` line: it stays alive, ``/health`` answers within a bound,
and a client still attaches over ipc:// and allocates. (Before the fix the daemon
took one descriptor and one thread per idle connection until it hit its limit;
libzmq then aborted on the next ipc:// connect.) The soft limit is raised to the
hard one at start (:mod:`kvcore.daemon.fdlimit`), tested in a subprocess.
"""

from __future__ import annotations

import contextlib
import json
import resource
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcore import Client
from kvcore.daemon_process import DaemonProcess

POOL = "name=default,num_layers=1,num_kv_heads=1,head_dim=8,page_size=4,num_pages=64"
NOFILE = 256  # the daemon's soft and hard limit of open files
FLOOD = 2 * NOFILE  # idle connections opened to its metrics port
PARTIAL = b"GET /metrics HTTP/1.1\r\nHost: x\r\n"  # never ends: no blank line

# Runs the daemon's command line with RLIMIT_NOFILE lowered first (soft and hard).
LIMITED = """
import resource, runpy, sys
n = int(sys.argv.pop(1))
resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))
sys.argv[0] = "kvcore serve"
runpy.run_module("kvcore.daemon", run_name="__main__")
"""


class LimitedDaemon(DaemonProcess):
    """A :class:`DaemonProcess` started with ``RLIMIT_NOFILE`` at ``nofile`` (soft and hard)."""

    def __init__(self, nofile: int, *args: str) -> None:
        super().__init__(*args)
        self.nofile = nofile

    def start(self) -> LimitedDaemon:
        import signal
        import threading

        self.proc = subprocess.Popen(
            [sys.executable, "-c", LIMITED, str(self.nofile), *self.args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        ready = threading.Event()
        threading.Thread(target=self._drain, args=(ready,), daemon=True).start()
        if not ready.wait(self.timeout_s) or not self.endpoint:
            self.stop(signal.SIGKILL)
            raise RuntimeError("daemon did not start:\n" + "".join(self.lines))
        return self


def _metrics_port(daemon: DaemonProcess) -> int:
    line = next(ln for ln in daemon.lines if ln.startswith("  metrics: "))
    return int(line.split()[1].removesuffix("/metrics,").rsplit(":", 1)[1])


@contextlib.contextmanager
def flood(port: int, count: int, within_s: float) -> Iterator[int]:
    """Up to ``count`` connections to ``127.0.0.1:port``, one after the other (each given
    0.2 s to connect), each sent ``PARTIAL``; at most ``within_s`` in all. Yields how many
    connected; closes them all on exit."""
    socks: list[socket.socket] = []
    connected = 0
    deadline = time.monotonic() + within_s
    try:
        while len(socks) < count and time.monotonic() < deadline:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.settimeout(0.2)
            with contextlib.suppress(OSError):  # refused, timed out, or closed at once
                s.connect(("127.0.0.1", port))
                connected += 1
                s.send(PARTIAL)
        yield connected
    finally:
        for s in socks:
            s.close()


def _health(port: int, timeout_s: float) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=timeout_s) as reply:
        return int(reply.status)


def test_idle_connections_to_the_metrics_port_do_not_crash_or_stall_the_daemon(
    tmp_path: Path,
) -> None:
    daemon = LimitedDaemon(
        NOFILE,
        "--endpoint",
        f"ipc://{tmp_path / 'd.sock'}",
        "--pool",
        POOL,
        "--metrics-port",
        "0",
    )
    with daemon:
        assert daemon.proc is not None
        port = _metrics_port(daemon)
        with flood(port, FLOOD, within_s=10.0):
            time.sleep(0.5)  # let the daemon accept what it will
            assert daemon.proc.poll() is None, daemon.output
            clients = []
            for seq in range(4):  # each client takes descriptors in the daemon (ipc://, pidfd)
                client = Client.connect(daemon.endpoint, map_memory=False, timeout_s=5)
                client.allocate(seq, list(range(10)))
                clients.append(client)
            assert daemon.proc.poll() is None, daemon.output
            for client in clients:
                client.close()
            # the flood's connections are dropped after the read timeout; health answers
            deadline = time.monotonic() + 15
            status = 0
            while time.monotonic() < deadline and status != 200:
                with contextlib.suppress(OSError):
                    status = _health(port, timeout_s=2)
            assert status == 200
        assert daemon.proc.poll() is None, daemon.output


RAISE = """
import json, logging, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (64, int(sys.argv[1])))
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from kvcore.daemon.fdlimit import raise_soft_limit, spare
before = resource.getrlimit(resource.RLIMIT_NOFILE)
limit = raise_soft_limit()
again = raise_soft_limit()
left = spare(8)
files = [open(sys.executable, "rb") for _ in range(5)]
print(json.dumps([before, resource.getrlimit(resource.RLIMIT_NOFILE), limit.soft, limit.was,
                  again.soft, again.was, left - spare(8)]))
"""


def test_the_soft_descriptor_limit_is_raised_to_the_hard_one_and_kept() -> None:
    hard = min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 4096)
    if hard <= 64:
        pytest.skip(f"the hard limit of open files here is {hard}: nothing to raise to")
    out = subprocess.run(
        [sys.executable, "-c", RAISE, str(hard)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    before, after, soft, was, soft_again, was_again, opened = json.loads(out.stdout)
    assert before == [64, hard]
    assert after == [hard, hard] and soft == hard and was == 64
    assert soft_again == was_again == hard  # a second call changes nothing
    assert opened == 5  # spare() counts what is open
    assert f"raised the soft limit of open files from 64 to {hard}" in out.stderr
