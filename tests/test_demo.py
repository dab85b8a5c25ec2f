"""``kvcore demo``, the README's main job: runs end to end, checks pass, exit status 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_kvcore_demo_runs_and_every_check_passes() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvcore.cli", "demo", "--new-tokens", "12"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "FAIL" not in out
    for check in (
        "engine A's tokens equal DynamicCache's",
        "engine B's tokens equal DynamicCache's",
        "engine B reused the system prompt's 3 full pages",
        "no sequence held after the engines finished",
    ):
        assert f"ok   {check}" in out
    assert "daemon stats:" in out and "daemon stopped" in out


def test_kvcore_demo_fails_cleanly_without_a_daemon(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvcore.cli", "demo", "--endpoint", f"ipc://{tmp_path}/nobody.sock"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "cannot attach" in proc.stdout


def test_kvcore_demo_on_a_pool_that_does_not_fit_prints_the_flag_that_would(
    tmp_path: Path,
) -> None:
    from kvcore.daemon_process import DaemonProcess

    pool = "num_layers=2,num_kv_heads=2,head_dim=64,page_size=16,dtype=float32,num_pages=64"
    with DaemonProcess("--endpoint", f"ipc://{tmp_path}/d.sock", "--pool", pool) as daemon:
        proc = subprocess.run(
            [sys.executable, "-m", "kvcore.cli", "demo", "--endpoint", daemon.endpoint],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "num_layers 2 (needs 4)" in proc.stdout
    assert "kvcore serve --pool name=default,device=cpu,num_layers=4" in proc.stdout


def test_kvcore_demo_interrupted_exits_cleanly() -> None:
    import signal
    import time

    def interruptible() -> None:
        """SIGINT as a terminal delivers it: a job a non-interactive shell put in the
        background (a CI runner's) starts with SIGINT ignored, and Python then never
        raises KeyboardInterrupt for it."""
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcore.cli", "demo"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=interruptible,
    )
    assert proc.stdout is not None
    head = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # until the daemon is up: the engines load next
        line = proc.stdout.readline()
        head.append(line)
        if not line or "listening on" in line:
            break
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=60)
    out = "".join(head) + rest
    assert proc.returncode == 130, out + err
    assert "Traceback" not in out + err
    assert "interrupted" in out and "daemon stopped" in out
