"""Run ``kvcore serve`` as a child process: for the demo, benchmarks and tests.

The parent waits until the daemon prints where it listens, reads the endpoint
from that line, and stops the child with SIGTERM on exit (the daemon then
unlinks its pools and removes its socket).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading


class DaemonProcess:
    """``python -m kvcore.daemon ARGS`` as a child process, for tests, benchmarks and demos.

    ``with DaemonProcess("--endpoint", ep) as daemon:`` returns once the daemon
    prints that it listens; leaving the block stops it with SIGTERM. Its output
    (stdout and stderr) is collected in :attr:`lines`. It starts cold and keeps
    nothing for a next daemon (``KVCORE_RESTORE=false`` unless ``env`` or the
    environment says otherwise, or ``--restore`` is passed): its endpoint is
    usually a temporary one that nobody starts again.
    """

    def __init__(self, *args: str, env: dict[str, str] | None = None, timeout_s: float = 30.0):
        self.args = args
        self.env = env
        self.timeout_s = timeout_s
        self.lines: list[str] = []
        self.endpoint = ""
        self.proc: subprocess.Popen[str] | None = None
        self._tmpdir: str | None = None  # removed once the daemon has stopped

    @classmethod
    def private(
        cls, *args: str, env: dict[str, str] | None = None, timeout_s: float = 30.0
    ) -> DaemonProcess:
        """A daemon on an ipc:// socket in a fresh temporary directory, which is removed
        when the daemon stops (the demo and benchmarks: no clash with a user's daemon).
        It never keeps its pools (``--no-restore``): no daemon can start on that endpoint
        again."""
        tmpdir = tempfile.mkdtemp(prefix="kvcore-")
        daemon = cls(
            "--endpoint",
            f"ipc://{tmpdir}/kvcore.sock",
            *args,
            "--no-restore",
            env=env,
            timeout_s=timeout_s,
        )
        daemon._tmpdir = tmpdir
        return daemon

    def start(self) -> DaemonProcess:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvcore.daemon", *self.args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={"KVCORE_RESTORE": "false", **(os.environ if self.env is None else self.env)},
        )
        ready = threading.Event()
        threading.Thread(target=self._drain, args=(ready,), daemon=True).start()
        if not ready.wait(self.timeout_s) or not self.endpoint:
            self.stop(signal.SIGKILL)
            raise RuntimeError("daemon did not start:\n" + "".join(self.lines))
        return self

    def _drain(self, ready: threading.Event) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("kvcore serve: listening on "):
                self.endpoint = line.split()[4]
            if line.startswith("  events:"):
                ready.set()
        ready.set()  # exited

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Send ``sig`` and wait; the exit status."""
        assert self.proc is not None, "not started"
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        status = self.proc.wait(timeout=self.timeout_s)
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
        return status

    def __enter__(self) -> DaemonProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.stop()
