"""Two engine processes, one daemon: engine B's generate() reuses the system prompt engine A
committed, computes only the rest, and produces the tokens of its own cold run."""

from __future__ import annotations

from pathlib import Path

from kvcore import Client
from kvcore.daemon_process import DaemonProcess
from kvcore.demo import NAMESPACE, PAGE_SIZE, SYSTEM_PROMPT_TOKENS, finish_engine, start_engine
from kvcore.demo_model import TinyLlama


def test_engine_b_reuses_engine_a_system_prompt(tmp_path: Path) -> None:
    pool = TinyLlama().pool_flag(page_size=PAGE_SIZE, num_pages=256)
    with DaemonProcess("--endpoint", f"ipc://{tmp_path}/d.sock", "--pool", pool) as daemon:
        engines = {role: start_engine(daemon.endpoint, "default", role, 8) for role in "AB"}
        try:
            a = finish_engine(engines["A"])
            b = finish_engine(engines["B"], go=True)  # B starts generating after A is done
        finally:
            for proc in engines.values():
                if proc.poll() is None:
                    proc.kill()
        with Client.connect(daemon.endpoint, namespace=NAMESPACE) as client:
            stats = client.stats()
    shared_pages = SYSTEM_PROMPT_TOKENS // PAGE_SIZE
    assert a["equal"] and b["equal"]  # each engine's tokens equal its DynamicCache run
    assert a["cached_tokens"] == 0
    assert b["cached_tokens"] >= shared_pages * PAGE_SIZE  # B skipped the shared pages
    assert b["pages_shared"] == b["cached_tokens"] // PAGE_SIZE
    assert a["tokens"] != b["tokens"]  # different questions
    assert stats.num_sequences == 0 and stats.held_pages == 0  # both engines freed theirs
    assert stats.hit_tokens >= shared_pages * PAGE_SIZE
