"""The model identity rule (kvcore/integrations/identity.py): every part of a model's
identity changes its key-space string, ``model_id`` replaces only the source, equal
inputs give equal strings in every process. Engines end to end: tests/test_hf_models.py,
tests/test_vllm_models.py; SGLang's ranks: tests/test_sglang_pages.py."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch
from hf_helpers import SMALL
from transformers import AutoConfig, AutoModelForCausalLM

from kvcore.integrations.identity import (
    CHECKPOINT_SCALES,
    ModelIdentity,
    Source,
    config_digest,
    hub_weights,
    kv_dtype_of,
    kv_scales_of,
    path_weights,
    process_nonce,
    source_of,
    space_model,
    tensor_weights,
    transformers_identity,
    transformers_model,
)

BASE = ModelIdentity(
    source=Source(model="/m", revision="r", config="c", weights="files:w"),
    dtype="bfloat16",
    kv_dtype="bfloat16",
    tp_size=2,
    pp_size=1,
)
CHANGES = [
    {"source": Source(model="/m2", revision="r", config="c", weights="files:w")},
    {"source": Source(model="/m", revision="r2", config="c", weights="files:w")},
    {"source": Source(model="/m", revision="r", config="c2", weights="files:w")},
    {"source": Source(model="/m", revision="r", config="c", weights="files:w2")},
    {"source": Source(model="/m", revision="r", config="c", weights="files:w", code_revision="x")},
    {"source": Source(model_id="m")},
    {"dtype": "float16"},
    {"kv_dtype": "fp8_e4m3"},
    {"kv_scales": "s"},
    {"quantization": "fp8"},
    {"tp_size": 4},
    {"pp_size": 2},
    {"tp_rank": 0},
    {"pp_rank": 0},
]


def test_every_field_changes_the_string_and_the_string_is_64_hex_digits() -> None:
    strings = {space_model(BASE)} | {
        space_model(msgspec.structs.replace(BASE, **change)) for change in CHANGES
    }
    assert len(strings) == len(CHANGES) + 1
    for s in strings:
        assert len(s) == 64 and all(c in "0123456789abcdef" for c in s)
    assert space_model(msgspec.structs.replace(BASE)) == space_model(BASE)


def test_model_id_replaces_the_source_and_nothing_else() -> None:
    a, b = SMALL.build(), dataclasses.replace(SMALL, seed=1).build()
    assert transformers_model(a) != transformers_model(b)  # other weights
    assert transformers_model(a, "tiny") == transformers_model(b, "tiny")  # declared the same
    assert transformers_identity(a, "tiny").source == Source(model_id="tiny")
    assert transformers_model(a, "tiny") != transformers_model(a, "other")
    assert transformers_model(a, "tiny") != transformers_model(a)
    half = SMALL.build("bfloat16")
    assert transformers_model(half, "tiny") != transformers_model(a, "tiny")  # dtype enters
    for derived in ({"model": "/m"}, {"code_revision": "x"}):
        with pytest.raises(ValueError, match="one or the other"):
            Source(model_id="tiny", **derived)
    declared = msgspec.structs.replace(BASE, source=Source(model_id="tiny"))
    for change in CHANGES[6:]:  # dtypes, scales, quantization and shard still enter
        assert space_model(msgspec.structs.replace(declared, **change)) != space_model(declared)


def test_an_in_memory_model_is_its_tensors_and_a_change_in_place_is_a_miss() -> None:
    a, again = SMALL.build(), SMALL.build()
    assert transformers_identity(a).source.weights.startswith("tensors:")
    assert transformers_model(a) == transformers_model(again)  # same seed, same bytes
    before = transformers_model(a)
    with torch.no_grad():
        a.model.layers[0].self_attn.k_proj.weight[0, 0] += 1.0
    assert transformers_model(a) != before
    assert tensor_weights(a) != tensor_weights(again)
    # through .data: no version counter moves, the digest is taken afresh all the same
    changed = transformers_model(a)
    a.model.layers[1].mlp.up_proj.weight.data[0, 0] += 1.0
    assert transformers_model(a) != changed
    changed = transformers_model(a)
    a.lm_head.weight.data.copy_(torch.zeros_like(a.lm_head.weight))
    assert transformers_model(a) != changed


def test_a_transformers_model_is_its_tensors_whatever_its_config_names(
    checkpoint: Path,
) -> None:
    """The config's name and commit do not say what the module holds: a random init
    from the checkpoint's config, or the checkpoint's model trained a step, is another
    model; the name still enters (a copy elsewhere is another model)."""
    loaded = AutoModelForCausalLM.from_pretrained(checkpoint)
    config = AutoConfig.from_pretrained(checkpoint)
    torch.manual_seed(100)  # SMALL.build seeds 0 (the checkpoint's), and 1
    first = AutoModelForCausalLM.from_config(config)
    torch.manual_seed(101)
    second = AutoModelForCausalLM.from_config(config)
    strings = {transformers_model(m) for m in (loaded, first, second)}
    assert len(strings) == 3
    for model in (loaded, first):
        ident = transformers_identity(model)
        assert ident.source.model == os.path.realpath(checkpoint)
        assert ident.source.weights == tensor_weights(model)
    before = transformers_model(loaded)
    ids = torch.tensor([SMALL.prompt(8, seed=1)])
    loss = loaded(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.optim.SGD(loaded.parameters(), lr=0.1).step()  # fine-tuned in this process
    assert transformers_model(loaded) != before
    assert transformers_model(loaded, "tiny") == transformers_model(first, "tiny")  # declared


def test_peft_adapters_enter_with_their_state() -> None:
    """A LoRA adapter loaded into the model changes its tensors; disabling it changes
    what applies; merge_and_unload leaves other weights again."""
    peft = pytest.importorskip("peft")
    plain = transformers_model(SMALL.build())
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    wrapped = peft.get_peft_model(SMALL.build(), config)
    adapted = transformers_model(wrapped)
    with wrapped.disable_adapter():
        disabled = transformers_model(wrapped)
    assert transformers_model(wrapped) == adapted
    merged = transformers_model(wrapped.merge_and_unload())
    assert len({plain, adapted, disabled, merged}) == 4


def test_runtime_switches_are_not_the_config_but_overrides_are() -> None:
    model = SMALL.build()
    digest = config_digest(model.config)
    model.set_attn_implementation("eager")
    model.config.use_cache = False
    assert config_digest(model.config) == digest
    model.config.rope_parameters = {**model.config.rope_parameters, "rope_theta": 1234.0}
    assert config_digest(model.config) != digest


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("ckpt") / "tiny"
    SMALL.build().save_pretrained(directory)
    return directory


def test_a_directory_is_its_files_a_copy_is_another_model(checkpoint: Path, tmp_path: Path) -> None:
    loaded = AutoModelForCausalLM.from_pretrained(checkpoint)
    ident = transformers_identity(loaded)
    assert ident.source.model == os.path.realpath(checkpoint)
    assert source_of(str(checkpoint)).weights == path_weights(checkpoint)  # vLLM, SGLang
    copy = Path(shutil.copytree(checkpoint, tmp_path / "copy"))  # copy2: mtimes kept
    assert path_weights(copy) == path_weights(checkpoint)
    from_copy = AutoModelForCausalLM.from_pretrained(copy)
    assert transformers_model(from_copy) != transformers_model(loaded)  # another path
    assert transformers_model(from_copy, "tiny") == transformers_model(loaded, "tiny")
    by_relative_path = AutoModelForCausalLM.from_pretrained(os.path.relpath(copy))
    assert transformers_model(by_relative_path) == transformers_model(from_copy)


def test_a_rewritten_weights_file_changes_the_directory_a_hidden_file_does_not(
    checkpoint: Path, tmp_path: Path
) -> None:
    directory = Path(shutil.copytree(checkpoint, tmp_path / "m"))
    before = path_weights(directory)
    (directory / ".cache").mkdir()
    (directory / ".cache" / "lock").write_text("x")
    (directory / ".DS_Store").write_text("x")
    assert path_weights(directory) == before
    weights = directory / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # same bytes, retrained
    assert path_weights(directory) != before
    assert path_weights(weights).startswith("files:")  # one file (a GGUF) is its own entry


def test_a_hub_name_is_its_cached_snapshot_commit(tmp_path: Path) -> None:
    repo = tmp_path / "models--org--tiny"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    assert hub_weights("org/tiny", cache_dir=str(tmp_path)) == f"hub:{commit}"
    assert hub_weights("org/tiny", commit, cache_dir=str(tmp_path)) == f"hub:{commit}"
    assert hub_weights("org/other", cache_dir=str(tmp_path)) == ""  # not cached: unknown
    assert hub_weights("not a repo id!", cache_dir=str(tmp_path)) == ""
    assert source_of("org/tiny", cache_dir=str(tmp_path)).weights == f"hub:{commit}"
    assert source_of("org/other", cache_dir=str(tmp_path)).weights == ""


def test_one_derivation_of_the_source(checkpoint: Path) -> None:
    config = AutoConfig.from_pretrained(checkpoint)
    source = source_of(str(checkpoint), revision="r", config=config, code_revision="c")
    assert source == Source(
        model=os.path.realpath(checkpoint),
        revision="r",
        config=config_digest(config),
        weights=path_weights(checkpoint),
        code_revision="c",
    )
    assert source_of(str(checkpoint), weights="tensors:x").weights == "tensors:x"
    config._commit_hash = "c0ffee"  # a hub config names the snapshot it came from
    assert source_of("org/tiny", config=config).weights == "hub:c0ffee"
    assert source_of("").weights == ""
    assert (kv_dtype_of("auto", "bfloat16"), kv_dtype_of("fp8_e4m3", "bfloat16")) == (
        "bfloat16",
        "fp8_e4m3",
    )
    assert process_nonce().startswith("nonce:") and process_nonce() == process_nonce()


def test_equal_inputs_give_equal_strings_in_another_process(checkpoint: Path) -> None:
    script = (
        "import sys\n"
        "from hf_helpers import SMALL\n"
        "from transformers import AutoModelForCausalLM\n"
        "from kvcore.integrations.identity import transformers_model\n"
        "print(transformers_model(SMALL.build()))\n"
        "print(transformers_model(AutoModelForCausalLM.from_pretrained(sys.argv[1])))\n"
        "print(transformers_model(SMALL.build('bfloat16'), 'tiny'))\n"
        "from kvcore.integrations.identity import process_nonce\n"
        "print(process_nonce())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(checkpoint)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parent,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
        check=True,
    ).stdout.split()
    assert out[:3] == [
        transformers_model(SMALL.build()),
        transformers_model(AutoModelForCausalLM.from_pretrained(checkpoint)),
        transformers_model(SMALL.build("bfloat16"), "tiny"),
    ]
    assert out[3] != process_nonce()  # a nonce is one process's alone


def test_quantized_kv_scales_are_the_checkpoints_unless_computed_per_instance(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A float cache has no scales (its identity is unchanged); an fp8 one's scales
    are the checkpoint's (covered by the source); scales an engine computes itself
    make its key space this process's alone, with one warning naming the setting."""
    for float_cache in ("auto", "bfloat16", "float32", ""):
        assert kv_scales_of(float_cache) == ""
    for fp8 in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        assert kv_scales_of(fp8) == CHECKPOINT_SCALES == "checkpoint"
    with caplog.at_level(logging.WARNING, logger="kvcore"):
        assert kv_scales_of("fp8", computed=True, setting="calc_scales") == process_nonce()
    assert len(caplog.records) == 1 and "calc_scales" in caplog.text
    fp8 = msgspec.structs.replace(BASE, kv_dtype="fp8_e4m3", kv_scales=CHECKPOINT_SCALES)
    nonce = msgspec.structs.replace(fp8, kv_scales=process_nonce())
    assert len({space_model(BASE), space_model(fp8), space_model(nonce)}) == 3


def test_vllm_fp8_caches_key_their_scales(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """vLLM 0.32 scales fp8 K/V by the checkpoint's k_scale/v_scale (1.0 if none):
    "checkpoint". A vLLM that computes them at start-up (``calculate_kv_scales``,
    absent from 0.32's CacheConfig) shares with no other process."""
    pytest.importorskip("vllm")
    from vllm_helpers import engine_config, write_model

    from kvcore.integrations.identity import vllm_identity, vllm_model

    model = write_model(tmp_path / "llama")
    plain = engine_config(model)
    assert vllm_identity(plain).kv_scales == ""
    assert not hasattr(plain.cache_config, "calculate_kv_scales")
    fp8 = engine_config(model, kv_cache_dtype="fp8")
    ident = vllm_identity(fp8)
    assert (ident.kv_dtype, ident.kv_scales) == ("fp8_e4m3", CHECKPOINT_SCALES)  # one spelling
    assert vllm_model(engine_config(model, kv_cache_dtype="fp8")) == vllm_model(fp8)
    assert vllm_model(fp8) != vllm_model(plain)
    object.__setattr__(fp8.cache_config, "calculate_kv_scales", True)  # an older vLLM's
    with caplog.at_level(logging.WARNING, logger="kvcore"):
        assert vllm_identity(fp8).kv_scales == process_nonce()
    assert "calculate_kv_scales" in caplog.text
