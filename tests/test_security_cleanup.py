"""Defect 6: no death leaves state behind.

SIGHUP stops the daemon cleanly. When the daemon's whole process group is
SIGKILLed (an OOM or cgroup kill: its resource tracker dies with it), its
segment leaks; the next daemon on the same endpoint removes it at start-up.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from kvcore.daemon_process import DaemonProcess

POOL = ("--pool", "num_pages=4,num_layers=1")


def _segment(output: str) -> Path:
    return Path("/dev/shm") / output.split("MiB (")[1].split(")")[0]


def test_sighup_stops_cleanly(tmp_path: Path) -> None:
    daemon = DaemonProcess("--endpoint", f"ipc://{tmp_path / 'd.sock'}", *POOL).start()
    segment = _segment(daemon.output)
    assert segment.exists()
    assert daemon.stop(signal.SIGHUP) == 0, daemon.output
    assert not segment.exists() and os.listdir(tmp_path) == []
    assert "pools unlinked, socket removed" in daemon.output


def test_a_killed_process_groups_segment_is_swept_by_the_next_daemon(tmp_path: Path) -> None:
    args = [
        sys.executable,
        "-m",
        "kvcore.daemon",
        "--endpoint",
        f"ipc://{tmp_path / 'd.sock'}",
        *POOL,
    ]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None
    output = ""
    for line in proc.stdout:
        output += line
        if line.startswith("  events:"):
            break
    segment = _segment(output)
    os.killpg(proc.pid, signal.SIGKILL)  # the daemon and its resource tracker
    proc.wait()
    assert segment.exists(), "nothing leaked: the test proves nothing"
    try:
        with DaemonProcess("--endpoint", f"ipc://{tmp_path / 'd.sock'}", *POOL) as again:
            assert not segment.exists()
            assert f"removed {segment.name}" in again.output
    finally:
        if segment.exists():
            segment.unlink()
