"""Two engine processes, one daemon: engine B's generate() reuses the system prompt engine A
committed, computes only the rest, and produces the tokens of its own cold run. A third
engine, B's twin, then runs with the first system page holding other tokens' K/V (the
negative control): the same check fails on it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hf_helpers import cache_space, served_pages, wrong_page

from kvcore import Client
from kvcore.daemon_process import DaemonProcess
from kvcore.demo import NAMESPACE, PAGE_SIZE, SYSTEM_PROMPT_TOKENS, finish_engine, start_engine
from kvcore.demo_model import TinyLlama

SHARED_PAGES = SYSTEM_PROMPT_TOKENS // PAGE_SIZE


def check_engine_b(report: dict[str, Any]) -> None:
    """Engine B's report: it skipped the shared pages and its tokens equal its own
    DynamicCache run's (AssertionError saying which fails)."""
    assert report["cached_tokens"] >= SHARED_PAGES * PAGE_SIZE, "B missed the shared pages"
    assert report["pages_shared"] == report["cached_tokens"] // PAGE_SIZE
    assert report["equal"], "engine B's tokens are not its DynamicCache run's"


def test_engine_b_reuses_engine_a_system_prompt(tmp_path: Path) -> None:
    spec = TinyLlama()  # the demo's model: init spread 0.15, peaked logits
    pool = spec.pool_flag(page_size=PAGE_SIZE, num_pages=256)
    with DaemonProcess("--endpoint", f"ipc://{tmp_path}/d.sock", "--pool", pool) as daemon:
        # the control's engine starts with the others (loading torch overlaps), and waits
        engines = {role: start_engine(daemon.endpoint, "default", role, 8) for role in "AB"}
        twin = start_engine(daemon.endpoint, "default", "B", 8)
        try:
            a = finish_engine(engines["A"])
            b = finish_engine(engines["B"], go=True)  # B starts generating after A is done
            with Client.connect(daemon.endpoint, namespace=NAMESPACE) as client:
                stats = client.stats()
                space = cache_space(client, spec.build())
                pages = served_pages(client, space, spec.prompt(SYSTEM_PROMPT_TOKENS, seed=7))
                with wrong_page(client, pages[0], pages[2]):  # the negative control's run
                    corrupted = finish_engine(twin, go=True)
        finally:
            for proc in (*engines.values(), twin):
                if proc.poll() is None:
                    proc.kill()
    assert a["equal"]  # A's tokens equal its DynamicCache run
    assert a["cached_tokens"] == 0
    check_engine_b(b)  # B skipped the shared pages and decodes its own tokens
    assert a["tokens"] != b["tokens"]  # different questions
    assert stats.num_sequences == 0 and stats.held_pages == 0  # both engines freed theirs
    assert stats.hit_tokens >= SHARED_PAGES * PAGE_SIZE
    with pytest.raises(AssertionError, match="not its DynamicCache run's"):
        check_engine_b(corrupted)  # served a wrong page, the same check fails
