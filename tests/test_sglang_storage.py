"""kvcore as SGLang's HiCache storage, driven by SGLang 0.5.23's own code: its dynamic
factory loads ``kvcore.integrations.sglang.KVCoreStorage`` by name, its cache
controller's backup and prefetch threads call it (tests/sglang_harness.py, in SGLang's
venv), and separate processes share pages through one real daemon, byte for byte: MHA
models in kv pools, MLA models (SGLang's own MLA pools) in latent pools, fp8 caches in
fp8 pools. Each host layout has its pool order (kvcore.integrations.sglang.pages.
HOST_ORDERS); a pool of another order is refused, never read as another layout's.
Skips without the SGLang venv (tests/install.sh builds it)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sglang_helpers import HarnessError, run_harness, sglang_venv

from kvcore import Client
from kvcore.daemon_process import DaemonProcess
from kvcore.integrations.sglang.pages import HOST_ORDERS

PAGE = 16
LAYOUT = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "dtype": "bfloat16"}
POOL = (
    "name=default,num_layers=2,num_kv_heads=2,head_dim=16,page_size=16,dtype=bfloat16,num_pages=64"
)
WRITTEN = list(range(1000, 1000 + 4 * PAGE + 5))  # 4 whole pages; the tree cuts the tail
SHARED_HEAD = WRITTEN[: 2 * PAGE] + list(range(7000, 7000 + 2 * PAGE))  # 2 pages in common
NEVER = list(range(9000, 9000 + 3 * PAGE))
MLA = {"kv_lora_rank": 32, "qk_rope_head_dim": 16}  # one latent vector of 48 a token
LATENT = "num_layers=2,num_kv_heads=1,head_dim=48,page_size=16,kind=latent,num_pages=32"
ORDERED = {  # host layout -> the pool of its order (the default pool: layer_first's)
    "page_first": "pf",
    "page_first_direct": "pfd",
    "page_head": "ph",
}
OTHER_POOLS = (
    *(
        POOL.replace("name=default", f"name={name}") + f",order={HOST_ORDERS[layout]}"
        for layout, name in ORDERED.items()
    ),
    f"name=mla,{LATENT},dtype=bfloat16,order={HOST_ORDERS['layer_first']}",
    f"name=mla8,{LATENT},dtype=float8_e4m3fn,order={HOST_ORDERS['page_first_direct']}",
    POOL.replace("name=default", "name=fp8").replace("bfloat16", "float8_e5m2")
    + f",order={HOST_ORDERS['page_head']}",
)


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    sglang_venv()  # skip before starting anything
    default = f"{POOL},order={HOST_ORDERS['layer_first']}"
    pools = [arg for pool in (default, *OTHER_POOLS) for arg in ("--pool", pool)]
    with DaemonProcess.private(*pools) as d:
        yield d


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Two model directories (configs of one geometry, different files) SGLang is
    started with: their paths and files are the ranks' model identities."""
    from transformers import LlamaConfig

    root = tmp_path_factory.mktemp("sglang-models")
    paths = {}
    for name, eps in (("base", 1e-5), ("tuned", 1e-6)):
        LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=LAYOUT["num_layers"],
            num_attention_heads=2,
            num_key_value_heads=LAYOUT["num_kv_heads"],
            head_dim=LAYOUT["head_dim"],
            vocab_size=128,
            rms_norm_eps=eps,
            architectures=["LlamaForCausalLM"],
        ).save_pretrained(root / name)
        paths[name] = str(root / name)
    return paths


def spec(
    op: str,
    endpoint: str,
    host_layout: str,
    prompts: list[list[int]],
    extra: dict[str, Any] | None = None,
    **more: Any,
) -> dict:
    """A harness spec: kvcore's backend by SGLang's dynamic factory; ``extra`` adds
    kvcore's keys to the extra config, ``more`` the harness's own (model_name, tp_rank...)."""
    return {
        "op": op,
        "backend": "dynamic",
        "extra_config": {
            "backend_name": "kvcore",
            "module_path": "kvcore.integrations.sglang",
            "class_name": "KVCoreStorage",
            "interface_v1": 1,
            "prefetch_threshold": PAGE,  # SGLang's own key: it takes it out
            "endpoint": endpoint,
            **(extra or {}),
        },
        "layout": {**LAYOUT, "page_size": PAGE, "host_layout": host_layout},
        "model_name": "kvcore/tiny",  # the served name
        "prompts": prompts,
        **more,
    }


def stats(daemon: DaemonProcess, pool: str = "default") -> tuple[int, int]:
    """(held pages, cached pages) of the daemon's ``pool``."""
    with Client.connect(daemon.endpoint, pool, map_memory=False) as client:
        s = client.stats()
        return s.held_pages, s.cached_pages


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("host_layout", "write_v1", "read_v1", "seed"),
    [
        ("layer_first", 1, 0, 1),  # v0: SGLang's generic calls, flat page tensors
        ("page_first", 1, 1, 2),
        ("page_first_direct", 0, 1, 3),
        ("page_head", 1, 0, 4),
    ],
)
def test_two_sglang_processes_share_pages_through_one_daemon(
    daemon: DaemonProcess,
    models: dict[str, str],
    host_layout: str,
    write_v1: int,
    read_v1: int,
    seed: int,
) -> None:
    """Process 1 backs a prompt up, process 2 (the same host layout, maybe the other
    interface) prefetches it and two other prompts, on the pool of the layout's order:
    exactly the written pages hit, byte for byte; nothing stays held."""
    prompts = [[t + 100_000 * seed for t in p] for p in (WRITTEN, SHARED_HEAD, NEVER)]
    pool = ORDERED.get(host_layout, "default")
    model = models["base"]

    def run(op: str, v1: int, prompts: list[list[int]]) -> dict[str, Any]:
        extra = {"interface_v1": v1, "pool": pool}
        return run_harness(
            spec(op, daemon.endpoint, host_layout, prompts, extra, seed=seed, model_path=model)
        )

    w = run("write", write_v1, prompts[:1])
    assert w["backend_class"] == "kvcore.integrations.sglang.storage.KVCoreStorage"
    page_set = "_page_set_zero_copy" if write_v1 else "_generic_page_set"
    assert (w["page_set"], w["controller"]) == (page_set, "HybridCacheController")
    (wrote,) = w["prompts"]
    assert wrote["completed_tokens"] == 4 * PAGE
    held, cached = stats(daemon, pool)
    assert held == 0 and cached >= 4

    f = run("fetch", read_v1, prompts)
    full, head, never = f["prompts"]
    assert f["page_get"] == ("_page_get_zero_copy" if read_v1 else "_generic_page_get")
    assert full["keys"] == wrote["keys"]
    assert full["hit_tokens"] == full["fetched_tokens"] == 4 * PAGE
    assert full["sha256"] == wrote["sha256"] == full["expected_sha256"]
    assert head["hit_tokens"] == head["fetched_tokens"] == 2 * PAGE
    assert head["page_sha256"] == wrote["page_sha256"][:2]
    assert never["hit_tokens"] == never["fetched_tokens"] == 0
    assert stats(daemon, pool)[0] == 0  # the fetch pinned pages only while it copied


@pytest.mark.timeout(300)
def test_a_host_layout_of_another_order_never_reads_the_pool(daemon: DaemonProcess) -> None:
    """A page_first process backs a prompt up into the pool of its order; a layer_first
    process on that pool is refused at attach (a LayoutMismatch naming its host layout
    and the order to serve a pool in), never fed another layout's bytes."""
    written = [t + 900_000 for t in WRITTEN[: 4 * PAGE]]
    extra = {"pool": ORDERED["page_first"]}
    run_harness(spec("write", daemon.endpoint, "page_first", [written], extra))
    assert stats(daemon, ORDERED["page_first"])[1] >= 4
    with pytest.raises(
        HarnessError,
        match=r"LayoutMismatch.*layer_first host pool.*order=LPKTH.*kvcore serve --pool "
        r"name=pf,.*,order=LPKTH",
    ):
        run_harness(spec("fetch", daemon.endpoint, "layer_first", [written], extra))


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("identity", "hit"),
    [
        ({}, 4 * PAGE),  # the same model and shard: shared
        ({"model_name": "kvcore/other"}, 4 * PAGE),  # another served name, one checkpoint
        ({"model_path": "tuned"}, 0),  # another checkpoint under the same served name
        ({"model_path": None}, 0),  # nothing published: this process's pages alone
        ({"tp_rank": 1, "tp_size": 2}, 0),
        ({"extra": {"namespace": "tenant-b"}}, 0),
    ],
)
def test_other_models_shards_and_namespaces_never_share(
    daemon: DaemonProcess, models: dict[str, str], identity: dict[str, Any], hit: int
) -> None:
    """The writer serves the ``base`` checkpoint as "kvcore/tiny"; the reader differs by
    ``identity`` (a model path by its name in ``models``)."""
    written = WRITTEN[: 4 * PAGE]
    run_harness(spec("write", daemon.endpoint, "layer_first", [written], model_path=models["base"]))
    reader = {"model_path": "base", **identity}
    reader["model_path"] = models.get(reader["model_path"])
    (got,) = run_harness(spec("fetch", daemon.endpoint, "layer_first", [written], **reader))[
        "prompts"
    ]
    assert got["hit_tokens"] == got["fetched_tokens"] == hit


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("pool", "dtype", "kv_cache_dtype", "wrote_in", "read_in", "v1"),
    [
        ("mla", "bfloat16", "auto", "layer_first", "layer_first", 1),
        ("mla8", "float8_e4m3fn", "fp8_e4m3", "page_first_direct", "page_first_direct", 0),
        ("fp8", "float8_e5m2", "fp8_e5m2", "page_head", "page_head", 1),  # MHA, fp8
    ],
)
def test_mla_and_fp8_caches_share_pages_byte_for_byte(
    daemon: DaemonProcess,
    models: dict[str, str],
    pool: str,
    dtype: str,
    kv_cache_dtype: str,
    wrote_in: str,
    read_in: str,
    v1: int,
) -> None:
    """TP rank 0 of 2 backs a prompt up, rank 1 prefetches it (a pool of the host
    layout's order): an
    MLA model's ranks share the one latent cache SGLang writes from rank 0 (its
    is_mla_model); fp8 pages are SGLang's uint8 bytes, any bit pattern, in an fp8 pool."""
    extra = {"interface_v1": v1, "pool": pool}
    args = {"model_path": models["base"], "kv_cache_dtype": kv_cache_dtype, "tp_size": 2}
    mla = {"mla": MLA} if pool.startswith("mla") else {}

    def run(op: str, host_layout: str, tp_rank: int) -> dict[str, Any]:
        s = spec(op, daemon.endpoint, host_layout, [WRITTEN], extra, tp_rank=tp_rank, **args)
        s["layout"] |= {"dtype": dtype, **mla}
        return run_harness(s)

    w = run("write", wrote_in, 0)
    assert w["storage_config"]["is_mla_model"] == bool(mla)
    (wrote,) = w["prompts"]
    assert wrote["completed_tokens"] == 4 * PAGE
    (got,) = run("fetch", read_in, 1)["prompts"]
    assert got["hit_tokens"] == got["fetched_tokens"] == (4 * PAGE if mla else 0)
    if mla:
        assert got["sha256"] == wrote["sha256"] == got["expected_sha256"]
    else:  # an MHA rank reads its own heads: rank 0 reads back what it wrote
        (own,) = run("fetch", read_in, 0)["prompts"]
        assert own["hit_tokens"] == own["fetched_tokens"] == 4 * PAGE
        assert own["sha256"] == wrote["sha256"] == own["expected_sha256"]
    assert stats(daemon, pool) == (0, 4)  # nothing held; what rank 0 wrote


@pytest.mark.timeout(120)
def test_a_pool_of_another_layout_is_refused_naming_both(daemon: DaemonProcess) -> None:
    wrong = spec("write", daemon.endpoint, "layer_first", [WRITTEN])
    wrong["layout"]["num_kv_heads"] = 4
    with pytest.raises(
        HarnessError,
        match=r"LayoutMismatch.*kvcore serve --pool name=default,num_layers=2,num_kv_heads=4,",
    ):
        run_harness(wrong)


@pytest.mark.timeout(120)
def test_no_daemon_is_an_error_naming_the_endpoint(tmp_path: Any) -> None:
    endpoint = f"ipc://{tmp_path}/none.sock"
    gone = spec("write", endpoint, "layer_first", [WRITTEN], extra={"timeout_s": 1})
    with pytest.raises(HarnessError, match=r"no kvcore daemon answers at ipc://.*none\.sock"):
        run_harness(gone)


@pytest.mark.timeout(300)
def test_pages_backed_up_before_a_restart_are_fetched_after_it(
    tmp_path: Any, models: dict[str, str]
) -> None:
    """SGLang process 1 backs a prompt up; the daemon is SIGKILLed and started again with
    ``--restore``; process 2 fetches exactly those pages, byte for byte (issue 40)."""
    import signal

    sglang_venv()
    endpoint = f"ipc://{tmp_path}/kv.sock"
    flags = ("--endpoint", endpoint, "--pool", f"{POOL},order={HOST_ORDERS['layer_first']}")
    prompts = [[t + 100_000 * 9 for t in p] for p in (WRITTEN, NEVER)]

    def run(op: str, prompts: list[list[int]]) -> dict[str, Any]:
        return run_harness(
            spec(op, endpoint, "layer_first", prompts, seed=9, model_path=models["base"])
        )

    daemon = DaemonProcess(*flags, "--restore").start()
    try:
        (wrote,) = run("write", prompts[:1])["prompts"]
        assert wrote["completed_tokens"] == 4 * PAGE
        daemon.stop(signal.SIGKILL)
        daemon = DaemonProcess(*flags, "--restore").start()
        assert "re-adopted 4 committed pages" in daemon.output, daemon.output
        full, never = run("fetch", prompts)["prompts"]
        assert full["hit_tokens"] == full["fetched_tokens"] == 4 * PAGE
        assert full["sha256"] == wrote["sha256"] == full["expected_sha256"]
        assert never["hit_tokens"] == 0
    finally:
        daemon.stop()
        DaemonProcess(*flags, "--no-restore").start().stop()  # unlinks what was kept
