"""``kvcore bench restart --quick``: a real daemon, SIGKILLed and restarted, re-adopts every
page it committed; the restart pause and the index's cost are measured; nothing of its
pool is left in /dev/shm."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kvcore.daemon.daemon import segment_prefix


def test_quick_run_readopts_every_committed_page() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvcore.cli", "bench", "restart", "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    result = json.loads(out)
    assert result["committed_pages"] == result["readopted_pages"] == 4096
    assert result["readopt_s"] >= 0 and len(result["pause_samples_s"]) == 2
    assert result["mirror_ops_ratio"] > 0
    left = [n for n in os.listdir("/dev/shm") if n.startswith(segment_prefix(result["endpoint"]))]
    assert not left, left  # the bench's own endpoint: other processes' segments may come and go
