"""``kvcore demo``, the README's main job: runs end to end, checks pass, exit status 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_kvcore_demo_runs_and_every_check_passes() -> None:
    proc = subprocess.run([sys.executable, "-m", "kvcore.cli", "demo", "--new-tokens", "12"],
                          capture_output=True, text=True, timeout=180)  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "FAIL" not in out
    for check in ("engine A's tokens equal DynamicCache's", "engine B's tokens equal DynamicCache's",
                  "engine B reused the system prompt's 3 full pages",
                  "no sequence held after the engines finished"):  # fmt: skip
        assert f"ok   {check}" in out
    assert "daemon stats:" in out and "daemon stopped" in out


def test_kvcore_demo_fails_cleanly_without_a_daemon(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "kvcore.cli", "demo", "--endpoint",
                           f"ipc://{tmp_path}/nobody.sock"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 1
    assert "cannot attach" in proc.stdout
