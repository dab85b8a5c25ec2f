"""A real Mooncake master on loopback for tests (no mock of the store).

``mooncake_master`` (from the mooncake-transfer-engine-non-cuda package; the
store's native library needs Debian's ``libibverbs1`` even for TCP) runs with
its built-in HTTP metadata server, every port on 127.0.0.1::

    mooncake_master -rpc_address=127.0.0.1 -rpc_port=P1 \
        -enable_http_metadata_server=true -http_metadata_server_host=127.0.0.1 \
        -http_metadata_server_port=P2 -metrics_host=127.0.0.1 -metrics_port=P3

Clients then use ``master="127.0.0.1:P1"`` and
``metadata_server="http://127.0.0.1:P2/metadata"``. Fresh ports per master:
a master that is still shutting down holds its ports for a moment.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvcore.tiers.remote import mooncake_available

SKIP_REASON = (
    "needs Mooncake Store: apt-get install -y libibverbs1 && "
    "pip install mooncake-transfer-engine-non-cuda==0.3.13.post1"
)


def master_binary() -> str | None:
    """The ``mooncake_master`` command, or None if the package is not usable here."""
    if not mooncake_available():
        return None
    return shutil.which("mooncake_master")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@dataclass(slots=True)
class Master:
    process: subprocess.Popen[bytes]
    rpc_port: int
    http_port: int
    log: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def kill(self) -> None:
        """SIGKILL, as a crash would: no goodbye to the clients."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def start_master(log_dir: Path, *, ready_s: float = 30.0) -> Master:
    """Start a master on fresh loopback ports and wait until both ports accept."""
    binary = master_binary()
    assert binary is not None, SKIP_REASON
    rpc, http, metrics = _free_port(), _free_port(), _free_port()
    log = log_dir / f"mooncake_master_{rpc}.log"
    command = [
        binary,
        "-rpc_address=127.0.0.1",
        f"-rpc_port={rpc}",
        "-enable_http_metadata_server=true",
        "-http_metadata_server_host=127.0.0.1",
        f"-http_metadata_server_port={http}",
        "-metrics_host=127.0.0.1",
        f"-metrics_port={metrics}",
        "-rpc_thread_num=2",
    ]
    with open(log, "wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ)
        )
    master = Master(process, rpc, http, log)
    deadline = time.monotonic() + ready_s
    while not (_listening(rpc) and _listening(http)):
        if process.poll() is not None or time.monotonic() > deadline:
            master.stop()
            raise RuntimeError(f"mooncake_master did not start; see {log}")
        time.sleep(0.05)
    return master


@contextlib.contextmanager
def running_master(log_dir: Path) -> Iterator[Master]:
    master = start_master(log_dir)
    try:
        yield master
    finally:
        master.stop()
