"""``kvcore bench serve``: the tokenizer it trains (fast) and one ``--quick`` run on
four real vLLM OpenAI servers driven by ``vllm bench serve`` (``slow``: the servers
take minutes to start on a loaded CPU)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_helpers import vllm_available

from kvcore.bench.serve_rig import CHAT_TEMPLATE, ROLES, SPECIAL, write_tokenizer


def test_the_tokenizer_has_the_models_vocab_and_round_trips_any_ids(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(write_tokenizer(tmp_path, 512)))
    assert len(tokenizer) == tokenizer.vocab_size == 512
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL)) == [0, 1, 2, 3]
    ids = random.Random(0).choices(range(512), k=400)
    text = tokenizer.decode(ids)
    assert tokenizer.encode(text, add_special_tokens=False) == ids
    chat = [{"role": "user", "content": "ba be"}, {"role": "assistant", "content": "bo"}]
    rendered = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|user|> ba be <|assistant|> bo <|assistant|>"
    assert all(tokenizer.convert_tokens_to_ids(r) >= len(SPECIAL) for r in ROLES)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["chat_template"] == (
        CHAT_TEMPLATE
    )


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")
def test_quick_run_reports_every_key_equal_completions_and_b_loads_from_kvcore() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvcore.cli", "bench", "serve", "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=1700,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(done.stdout)
    for key in (
        "prefix_ttft_ratio",
        "prefix_throughput_ratio",
        "first_server_ttft_ratio",
        "first_server_throughput_ratio",
        "nohit_throughput_ratio",
        "chat_ttft_ratio",
        "prefix_external_hit_fraction",
        "prefix_cache_hit_fraction",
        "chat_external_hit_fraction",
    ):
        assert isinstance(record[key], float) and record[key] > 0, key
    assert record["completions_match"] is True
    assert record["compared_completions"] > 0
    b_hits = record["kvcore"]["prefix_b"]["hits"]
    assert b_hits["external_prefix_cache_hits"] > 0  # B loaded A's pages from kvcore
    assert record["plain"]["prefix_b"]["hits"]["external_prefix_cache_hits"] == 0
    assert record["nohit_external_hit_fraction"] == 0.0
