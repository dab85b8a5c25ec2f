"""``kvcore bench sglang --quick`` in SGLang's venv: SGLang's real host pool, factory and
page hashes, a real daemon. Asserted: every headline key, figures positive, and the pages
fetched back equal the pages stored. No timing is asserted: the figures live in the bench
(docs/benchmarks.md). Skips without the SGLang venv (tests/install.sh builds it)."""

from __future__ import annotations

import json
import math
import os
import subprocess

import pytest
from sglang_helpers import sglang_venv

from kvcore.bench.sglang import HEADLINE


@pytest.mark.timeout(300)
def test_the_bench_reports_every_figure_and_equal_bytes() -> None:
    venv = sglang_venv()
    env = {**os.environ, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "kvcore.cli", "bench", "sglang", "--quick", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=280,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    record = json.loads(done.stdout)
    for figure in HEADLINE:
        assert figure.key in record, figure.key
    assert record["bytes_match"] is True
    for key in ("set_pages_per_s", "get_pages_per_s", "set_ratio", "get_ratio"):
        assert math.isfinite(record[key]) and record[key] > 0, key
    assert record["config"]["batch_pages"] == 128
