"""KVCoreStorage under faults, in SGLang's venv with its real host pool and factory
(tests/sglang_faults.py): a full pool makes the pages it cannot take misses; clear()
keeps the shared pages; get_stats() is SGLang's StorageMetrics; a daemon
that stops makes every call a miss without an exception in SGLang's threads; a daemon
started again on the same endpoint is attached again after ``retry_s``."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from sglang_helpers import sglang_venv

from kvcore.daemon_process import DaemonProcess

POOL = (
    "name=default,num_layers=2,num_kv_heads=2,head_dim=16,page_size=16,dtype=bfloat16,num_pages=4,"
    "order=LPKTH"  # layer_first's
)
SCRIPT = Path(__file__).with_name("sglang_faults.py")


@pytest.mark.timeout(180)
def test_misses_not_exceptions_and_attaching_again(tmp_path: Path) -> None:
    venv = sglang_venv()
    endpoint = f"ipc://{tmp_path}/kvcore.sock"
    env = {**os.environ, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    daemon = DaemonProcess("--endpoint", endpoint, "--pool", POOL).start()
    proc = subprocess.Popen(
        [str(venv / "bin" / "python"), str(SCRIPT), endpoint],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdin is not None and proc.stdout is not None

    def next_step(name: str) -> dict:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line, f"the script stopped before {name!r}"
        got: dict = json.loads(line)
        assert got["step"] == name
        return got

    try:
        stored = next_step("stored")
        assert stored["set"] == [True] * 4 + [False] * 4  # 4 pages in the pool
        assert stored["exists"] == 4 and stored["get"] == [True] * 4  # clear() kept them
        assert (stored["backup_pgs"], stored["prefetch_pgs"]) == ([4], [4])  # pages per call
        assert stored["prefetch_by_source"] == {"pool": 4}  # a pool without tiers: all in it
        assert stored["after"] == []  # get_stats hands each count over once
        daemon.stop()
        proc.stdin.write("\n")
        proc.stdin.flush()
        gone = next_step("gone")
        assert gone == {"step": "gone", "exists": 0, "get": [False] * 2, "set": [False] * 2}
        daemon = DaemonProcess("--endpoint", endpoint, "--pool", POOL).start()
        proc.stdin.write("\n")
        proc.stdin.flush()
        back = next_step("back")
        assert back["set"] == [True, True] and back["exists"] == 2
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        daemon.stop()
