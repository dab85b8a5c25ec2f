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

from kvcore.errors import BadRequest
from kvcore.prefix import chain_keys, encode_tokens, page_key, page_keys, root_key

SPEC = Path(__file__).resolve().parents[1] / "spec" / "hashing.md"


def vectors() -> dict[str, Any]:
    block = re.search(r"```json\n(.*?)```", SPEC.read_text(), re.S)
    assert block is not None, "spec/hashing.md has no json block"
    data: dict[str, Any] = json.loads(block.group(1))
    return data


def independent_chain(
    namespace: str, tokens: list[int], page_size: int, extra: bytes = b""
) -> list[str]:
    """The rules of spec/hashing.md written straight from the text."""

    def tlv(tag: int, value: bytes) -> bytes:
        return bytes([tag]) + len(value).to_bytes(4, "little") + value

    parent = hashlib.sha256(b"kvcore/prefix/v1" + tlv(1, namespace.encode())).digest()
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
        assert root_key(namespace).hex() == expected


def test_chains() -> None:
    for chain in vectors()["chains"]:
        ns, toks, size = chain["namespace"], chain["tokens"], chain["page_size"]
        got = [k.hex() for k in chain_keys(root_key(ns), encode_tokens(toks), size)]
        eager = [k.hex() for k in page_keys(root_key(ns), encode_tokens(toks), size)]
        assert got == eager == chain["keys"] == independent_chain(ns, toks, size)


def test_page_keys_of_one_page_and_a_partial_tail() -> None:
    root, toks = root_key("t"), list(range(11))
    one = page_keys(root, encode_tokens(toks[:4]), 4)
    assert [k.hex() for k in one] == independent_chain("t", toks[:4], 4)
    assert page_keys(root, encode_tokens(toks), 4) == list(chain_keys(root, encode_tokens(toks), 4))
    assert len(page_keys(root, encode_tokens(toks), 4)) == 2  # the partial third page has no key


def test_extra() -> None:
    v = vectors()["extra"]
    extra = v["extra_utf8"].encode()
    got = page_key(root_key(v["namespace"]), encode_tokens(v["tokens"]), extra).hex()
    assert got == v["key"] == independent_chain(v["namespace"], v["tokens"], 4, extra)[0]


def test_keys_equal_across_processes() -> None:
    code = (
        "from kvcore.prefix import chain_keys, encode_tokens, root_key;"
        "print([k.hex() for k in chain_keys(root_key('x'), encode_tokens(list(range(64))), 16)])"
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
