"""SGLang ranks' model strings from SGLang's own published arguments, for
tests/test_sglang_identity.py. Run with the SGLang venv's python (tests/sglang_helpers.py
finds it), never imported by pytest in the main environment:

    python tests/sglang_identity.py CASES     # CASES: a JSON list, or "-" (stdin)

Each case is ``{"server_args": {...} | null, "served": str, "model_id": str}``: the
script publishes ``ServerArgs(device="cpu", served_model_name=served, **server_args)``
as SGLang's scheduler process does (``null``: publishes nothing, as a bare cache
controller), builds SGLang's ``HiCacheStorageConfig`` with ``model_name=served`` (what
SGLang 0.5.23 passes) and prints one JSON line: ``{"models": [...], "warnings": [...]}``,
the rank's ``sglang_model`` per case and the warnings kvcore logged, per case.
Every case is computed twice in a row: the two strings must agree (``stable``).
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def model_of(case: dict[str, Any]) -> str:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    from kvcore.integrations.sglang.keys import sglang_model

    if case.get("server_args") is not None:
        args = ServerArgs(device="cpu", served_model_name=case["served"], **case["server_args"])
        publish(args, role="scheduler")
    config = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name=case["served"],
    )
    return sglang_model(config, case.get("model_id", ""))


def main(arg: str) -> None:
    cases = json.loads(sys.stdin.read() if arg == "-" else arg)
    handler = _Warnings()
    logging.getLogger("kvcore").addHandler(handler)
    models, warnings, stable = [], [], True
    for case in cases:
        handler.messages = []
        first = model_of(case)
        stable = stable and model_of(case) == first
        models.append(first)
        warnings.append(handler.messages)
    print(json.dumps({"models": models, "warnings": warnings, "stable": stable}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
