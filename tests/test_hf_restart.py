"""The transformers Cache across a daemon restart (issue 40): a KVCoreCache commits a
prompt's pages, the daemon is SIGKILLed and started again with ``--restore``, the
client re-attaches, and the same prompt hits the re-adopted pages, decoding
transformers' own tokens (peaked weights: kvcore.demo_model); the negative control
serves one of those pages with another page's bytes and the check fails."""

from __future__ import annotations

import signal
import time

import pytest
import torch
from hf_helpers import SMALL, reference
from test_hf_cache import NEW, check_batch, check_fails_on_a_wrong_page

from kvcore import Client
from kvcore.daemon_process import DaemonProcess
from kvcore.errors import StaleEpoch


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return SMALL.build()


def released(daemon: DaemonProcess, within_s: float = 10.0) -> bool:
    """Whether the daemon freed its withheld pages within ``within_s`` (every process
    that mapped the old pool fenced its mapping or re-attached)."""
    end = time.monotonic() + within_s
    while "withheld pages released" not in daemon.output:
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_prompt_committed_before_a_restart_hits_after_it(
    tmp_path: object, model: torch.nn.Module, sig: int
) -> None:
    endpoint = f"ipc://{tmp_path}/kv.sock"
    flags = ("--endpoint", endpoint, "--pool", SMALL.pool_flag(num_pages=64))
    prompts = [SMALL.prompt(70, seed=70)]
    want = reference(model, prompts, NEW)
    daemon = DaemonProcess(*flags, "--restore").start()
    client = Client.connect(endpoint)
    try:
        assert check_batch(client, model, prompts, want) == 0  # cold: commits 5 pages
        daemon.stop(sig)
        daemon = DaemonProcess(*flags, "--restore").start()
        assert "re-adopted 5 committed pages" in daemon.output, daemon.output  # 70 + 16 tokens
        with pytest.raises(StaleEpoch):
            client.heartbeat()  # the restart, seen: the old mapping is fenced
        client.reconnect()
        assert released(daemon), daemon.output
        assert check_batch(client, model, prompts, want) == 64  # the re-adopted pages
        check_fails_on_a_wrong_page(client, model, prompts, want)
    finally:
        client.close()
        daemon.stop()
        DaemonProcess(*flags, "--no-restore").start().stop()  # unlinks what was kept
