"""The model identity rule (kvcore/integrations/identity.py): every part of a model's
identity changes its key-space string, ``model_id`` replaces only the source, equal
inputs give equal strings in every process. Engines end to end: tests/test_hf_models.py,
tests/test_vllm_models.py; SGLang's ranks: tests/test_sglang_pages.py."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch
from hf_helpers import SMALL
from transformers import AutoModelForCausalLM

from kvcore.integrations.identity import (
    ModelIdentity,
    Source,
    config_digest,
    hub_weights,
    path_weights,
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
    with pytest.raises(ValueError, match="one or the other"):
        Source(model="/m", model_id="tiny")
    declared = msgspec.structs.replace(BASE, source=Source(model_id="tiny"))
    for change in CHANGES[5:]:  # dtypes, scales, quantization and shard still enter
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
    assert ident.source.weights == path_weights(checkpoint)
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


def test_equal_inputs_give_equal_strings_in_another_process(checkpoint: Path) -> None:
    script = (
        "import sys\n"
        "from hf_helpers import SMALL\n"
        "from transformers import AutoModelForCausalLM\n"
        "from kvcore.integrations.identity import transformers_model\n"
        "print(transformers_model(SMALL.build()))\n"
        "print(transformers_model(AutoModelForCausalLM.from_pretrained(sys.argv[1])))\n"
        "print(transformers_model(SMALL.build('bfloat16'), 'tiny'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(checkpoint)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parent,
        check=True,
    ).stdout.split()
    assert out == [
        transformers_model(SMALL.build()),
        transformers_model(AutoModelForCausalLM.from_pretrained(checkpoint)),
        transformers_model(SMALL.build("bfloat16"), "tiny"),
    ]
