"""spec/hashing.md's vectors, recomputed by kvcore and by an independent implementation."""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kvcore_ipc.vllm_events import root_key as vllm_root_key

from kvcore.errors import BadRequest
from kvcore.prefix import KeySpace, chain_keys, encode_tokens, page_key, page_keys, root_key

SPEC = Path(__file__).resolve().parents[1] / "spec" / "hashing.md"


def vectors() -> dict[str, Any]:
    block = re.search(r"```json\n(.*?)```", SPEC.read_text(), re.S)
    assert block is not None, "spec/hashing.md has no json block"
    data: dict[str, Any] = json.loads(block.group(1))
    return data


def tlv(tag: int, value: bytes) -> bytes:
    return bytes([tag]) + len(value).to_bytes(4, "little") + value


def independent_root(namespace: str, lora: str = "", salt: str = "", model: str = "") -> bytes:
    """root(ns, model, lora, salt) of spec/hashing.md written straight from the text."""
    message = b"kvcore/prefix/v1" + tlv(1, namespace.encode())
    if model:
        message += tlv(6, model.encode())
    if lora:
        message += tlv(4, lora.encode())
    if salt:
        message += tlv(5, salt.encode())
    return hashlib.sha256(message).digest()


def independent_chain(
    namespace: str,
    tokens: list[int],
    page_size: int,
    extra: bytes = b"",
    lora: str = "",
    salt: str = "",
    model: str = "",
) -> list[str]:
    """The rules of spec/hashing.md written straight from the text."""
    parent = independent_root(namespace, lora, salt, model)
    keys = []
    for i in range(len(tokens) // page_size):
        page = tokens[i * page_size : (i + 1) * page_size]
        msg = parent + tlv(2, struct.pack(f"<{len(page)}I", *page))
        if extra:
            msg += tlv(3, extra)
        parent = hashlib.sha256(msg).digest()
        keys.append(parent.hex())
    return keys


def test_roots() -> None:
    for namespace, expected in vectors()["roots"].items():
        assert root_key(KeySpace(namespace)).hex() == expected


def test_roots_of_key_spaces() -> None:
    for space in vectors()["spaces"]:
        ns, lora, salt = space["namespace"], space["lora"], space["salt"]
        model = space.get("model", "")
        expected = space["root"]
        independent = independent_root(ns, lora, salt, model).hex()
        assert root_key(KeySpace(ns, model, lora, salt)).hex() == expected == independent
        # the event publisher's copy
        assert vllm_root_key(ns, model, lora, salt).hex() == expected


def test_empty_parts_keep_the_namespaces_root() -> None:
    for namespace, expected in vectors()["roots"].items():
        root = root_key(KeySpace(namespace, "", "", ""))
        assert root.hex() == expected == independent_root(namespace).hex()
    assert root_key(KeySpace()) == root_key(KeySpace("default"))  # None: the default


def test_key_space_parts_never_pose_as_each_other() -> None:
    spaces = [
        KeySpace("default", lora="x"),
        KeySpace("default", salt="x"),
        KeySpace("default", model="x"),
        KeySpace("default", lora="x", salt="x"),
        KeySpace("default", model="x", lora="x"),
        KeySpace("default", model="x", salt="x"),
        KeySpace("x"),
        KeySpace("default", lora="xy"),
        KeySpace("default", lora="x", salt="y"),
        KeySpace("default", model="x", lora="y"),
        KeySpace("default", model="y", lora="x"),
    ]
    assert len({root_key(space) for space in spaces}) == len(spaces)


@pytest.mark.parametrize("part", KeySpace._fields)
def test_key_space_parts_are_bounded_in_bytes(part: str) -> None:
    space = KeySpace("default")
    root_key(space._replace(**{part: "\u20ac" * 85}))  # 255 bytes
    with pytest.raises(BadRequest):
        root_key(space._replace(**{part: "\u20ac" * 86}))  # 258 bytes, 86 characters
    with pytest.raises(BadRequest):
        root_key(space._replace(**{part: b"bytes"}))


def test_chains() -> None:
    for chain in vectors()["chains"]:
        ns, toks, size = chain["namespace"], chain["tokens"], chain["page_size"]
        lora, salt, model = chain.get("lora", ""), chain.get("salt", ""), chain.get("model", "")
        root = root_key(KeySpace(ns, model, lora, salt))
        got = [k.hex() for k in chain_keys(root, encode_tokens(toks), size)]
        eager = [k.hex() for k in page_keys(root, encode_tokens(toks), size)]
        independent = independent_chain(ns, toks, size, lora=lora, salt=salt, model=model)
        assert got == eager == chain["keys"] == independent


def test_page_keys_of_one_page_and_a_partial_tail() -> None:
    root, toks = root_key(KeySpace("t")), list(range(11))
    one = page_keys(root, encode_tokens(toks[:4]), 4)
    assert [k.hex() for k in one] == independent_chain("t", toks[:4], 4)
    assert page_keys(root, encode_tokens(toks), 4) == list(chain_keys(root, encode_tokens(toks), 4))
    assert len(page_keys(root, encode_tokens(toks), 4)) == 2  # the partial third page has no key


def test_extra() -> None:
    v = vectors()["extra"]
    extra = v["extra_utf8"].encode()
    got = page_key(root_key(KeySpace(v["namespace"])), encode_tokens(v["tokens"]), extra).hex()
    assert got == v["key"] == independent_chain(v["namespace"], v["tokens"], 4, extra)[0]


def test_keys_equal_across_processes() -> None:
    code = (
        "from kvcore.prefix import KeySpace, chain_keys, encode_tokens, root_key;"
        "print([k.hex() for k in chain_keys(root_key(KeySpace('x')), "
        "encode_tokens(list(range(64))), 16)])"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5], ["a"]])
def test_tokens_must_be_u32(bad: list[object]) -> None:
    with pytest.raises(BadRequest):
        encode_tokens(bad)  # type: ignore[arg-type]
