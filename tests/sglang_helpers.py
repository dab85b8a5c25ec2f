"""Run tests/sglang_harness.py in SGLang's own venv, from pytest in the main environment.

SGLang 0.5.23 needs torch 2.14.1 and torchvision, which the main environment (torch
2.13.0, vLLM's CPU build) must not get, so tests/install.sh builds it a venv of its own:
``$KVCORE_SGLANG_VENV``, by default ``~/.cache/kvcore/sglang-0.5.23``. A test that asks
for it skips, saying so, when that venv is missing.

One call of ``run_harness`` is one process (about 10 s, nearly all of it importing
SGLang): a spec in, the harness's JSON result out (its docstring gives both).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

SGLANG_VERSION = "0.5.23"
VENV_ENV = "KVCORE_SGLANG_VENV"
DEFAULT_VENV = Path.home() / ".cache" / "kvcore" / f"sglang-{SGLANG_VERSION}"
HARNESS = Path(__file__).with_name("sglang_harness.py")


class HarnessError(AssertionError):
    """The harness exited non-zero or printed no result; the message ends with its stderr."""


def sglang_venv() -> Path:
    """The venv's root; skips the test when it holds no python with sglang 0.5.23."""
    venv = Path(os.environ.get(VENV_ENV) or DEFAULT_VENV)
    python = venv / "bin" / "python"
    dist = list(venv.glob(f"lib/python3*/site-packages/sglang-{SGLANG_VERSION}.dist-info"))
    if not python.exists() or not dist:
        pytest.skip(
            f"no SGLang {SGLANG_VERSION} venv at {venv} (set {VENV_ENV}, or run tests/install.sh)"
        )
    return venv


def run_harness(
    spec: dict[str, Any], *, env: dict[str, str] | None = None, timeout: float = 120.0
) -> dict[str, Any]:
    """Run the harness once on ``spec`` and return its parsed result line.

    ``env`` is added to this process's environment (e.g. the file backend's
    ``SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR``). The venv's bin comes first on PATH:
    SGLang compiles its page-hash extension with the ninja installed there.
    """
    venv = sglang_venv()
    full_env = {**os.environ, **(env or {})}
    full_env["PATH"] = f"{venv / 'bin'}{os.pathsep}{full_env.get('PATH', '')}"
    proc = subprocess.run(
        [str(venv / "bin" / "python"), str(HARNESS), "-"],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        check=False,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise HarnessError(
            f"sglang_harness exited {proc.returncode} on op {spec.get('op')!r}:\n"
            + proc.stderr[-4000:]
        )
    result: dict[str, Any] = json.loads(lines[-1])
    return result
