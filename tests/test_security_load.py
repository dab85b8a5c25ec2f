"""`kvcore bench load` as a check: client processes of random valid operations never see a
page of theirs written by another (clobbered_pages == 0), and leave nothing held.

The CI variant is a few seconds; the soak (``slow``) is the figure docs/benchmarks.md records.
"""

from __future__ import annotations

import argparse

import pytest

from kvcore.bench.load import run


def _load(clients: int, seconds: float) -> dict[str, object]:
    return run(argparse.Namespace(clients=clients, seconds=seconds, pages=512, lease=5.0, seed=0))


def test_a_short_load_clobbers_nothing_and_leaves_nothing() -> None:
    result = _load(2, 3.0)
    assert result["clobbered_pages"] == 0 and result["held_after"] == 0, result
    assert isinstance(result["checked_pages"], int) and result["checked_pages"] > 100, result
    assert isinstance(result["metrics_scrapes"], int) and result["metrics_scrapes"] > 10, result


@pytest.mark.slow
def test_a_soak_clobbers_nothing_and_does_not_grow() -> None:
    result = _load(8, 30.0)
    assert result["clobbered_pages"] == 0 and result["held_after"] == 0, result
    growth = result["rss_growth_mib"]
    assert isinstance(growth, float) and growth < 20, result
