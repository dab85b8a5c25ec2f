"""SGLang ranks' model identities from SGLang 0.5.23's own published server arguments
(tests/sglang_identity.py, in SGLang's venv): two checkpoints served under one
``--served-model-name`` never share a key space, one checkpoint under two served names
does, ``--json-model-override-args`` enters, and weights nothing names (nothing
published; ``--load-format dummy``) are a per-process nonce with a warning naming
``model_id``. Without SGLang: tests/test_sglang_pages.py. Skips without the venv."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from hf_helpers import SMALL
from sglang_helpers import sglang_venv

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).with_name("sglang_identity.py")


def models_in_a_process(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """The script's result for ``cases``, in one fresh SGLang process (this checkout's
    kvcore first on its path)."""
    venv = sglang_venv()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.run(
        [str(venv / "bin" / "python"), str(SCRIPT), "-"],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["stable"]  # each case computed twice in its process: one string
    return result


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    sglang_venv()  # skip before building anything
    root = tmp_path_factory.mktemp("sglang-ckpt")
    SMALL.build().save_pretrained(root / "base")
    dataclasses.replace(SMALL, seed=1).build().save_pretrained(root / "finetune")
    return {"base": str(root / "base"), "finetune": str(root / "finetune")}


@pytest.mark.timeout(600)
def test_sglang_ranks_are_keyed_by_the_model_path_not_the_served_name(
    checkpoints: dict[str, str],
) -> None:
    base, finetune = checkpoints["base"], checkpoints["finetune"]
    override = json.dumps({"rms_norm_eps": 1e-3})
    cases: list[dict[str, Any]] = [
        {"server_args": None, "served": "llm"},  # nothing published (first: no unpublish)
        {"server_args": {"model_path": base}, "served": "llm"},
        {"server_args": {"model_path": finetune}, "served": "llm"},
        {"server_args": {"model_path": base}, "served": "chat"},
        {
            "server_args": {"model_path": base, "json_model_override_args": override},
            "served": "llm",
        },
        {"server_args": {"model_path": base, "load_format": "dummy"}, "served": "llm"},
        {"server_args": {"model_path": base}, "served": "llm", "model_id": "m"},
        {"server_args": {"model_path": finetune}, "served": "llm", "model_id": "m"},
        {
            "server_args": {"model_path": base, "load_format": "dummy"},
            "served": "llm",
            "model_id": "m",
        },
    ]
    one, two = models_in_a_process(cases), models_in_a_process(cases)
    a, b = one["models"], two["models"]
    _unnamed, base_llm, tuned_llm, base_chat, overridden, dummy, declared, declared2, dummy_id = a
    assert base_llm != tuned_llm  # two checkpoints under one served name: never shared
    assert base_llm == base_chat  # one checkpoint under two served names: shared
    assert overridden != base_llm  # --json-model-override-args is SGLang's config
    assert declared == declared2 != base_llm  # model_id declares them one model
    assert dummy_id == dummy != declared  # random weights: a model_id does not share them
    assert len(set(a)) == 6
    for i in (1, 2, 3, 4, 6, 7):  # derived from the server's arguments: every process
        assert a[i] == b[i], cases[i]
    for i in (0, 5, 8):  # nothing names these weights: this process's alone
        assert a[i] != b[i], cases[i]
    assert one["warnings"][1:5] == [[]] * 4
    assert any("model_id" in w and "'llm'" in w for w in one["warnings"][0])
    assert any("dummy" in w for w in one["warnings"][8])
