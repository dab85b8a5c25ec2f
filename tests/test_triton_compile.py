"""Every Triton kernel of kvcore_triton compiles for a real GPU (sm_90), even on a CPU-only CI.

The interpreter (TRITON_INTERPRET=1, set by conftest on machines without CUDA)
replaces ``@triton.jit`` functions with interpreted ones, which cannot be
compiled; so the compilation runs in a subprocess with TRITON_INTERPRET
removed from its environment. That subprocess is this file run as a script:
it compiles each kernel over a grid of the constexpr configurations the host
wrappers really launch (taken from ``plan_decode`` / ``plan_prefill``: head
dims 64/80/96/128/256, GQA groups 1..16, page sizes 1..128, fp32/fp16/bf16, and
the constexpr variants of issue 30: fp8 caches (e4m3fn, e5m2) under 16-bit and
fp32 queries, sliding window + soft-cap + sinks together, MLA's latent cache at
576 = 512 + 64 with 16 and 128 query heads, latent and fp8 writes) with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`` and
prints one JSON line per compilation. The test asserts PTX and a cubin came out
of every one (ptxas ships inside the Triton wheel).

The file runs past 400 lines on purpose: it is the test and its compile worker
(the job grid, the signatures, the PTX/cubin/TTGIR readers) in one script, so
the subprocess needs nothing but this path.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from kvcore.layout import cdiv

TARGET = ("cuda", 90, 32)  # backend, compute capability, warp size (H100/H200)
DTYPES = {
    "float32": "fp32",
    "float16": "fp16",
    "bfloat16": "bf16",
    "float8_e4m3fn": "fp8e4nv",
    "float8_e5m2": "fp8e5",
}
# The query's (and output's, key's, value's) dtype over an fp8 cache in these builds.
FP8_QUERY = {"float8_e4m3fn": "bfloat16", "float8_e5m2": "float32"}
CACHE_POINTERS = {"kv_ptr"}  # the rest of the float pointers take the query's dtype

# Pointer arguments whose element type does not follow the cache dtype.
INDEX_POINTERS = {
    "block_table_ptr": "*i32",
    "seq_lens_ptr": "*i32",
    "cu_seqlens_q_ptr": "*i32",
    "slots_ptr": "*i64",
    "src_ptr": "*i64",
    "dst_ptr": "*i64",
    "part_out_ptr": "*fp32",
    "part_lse_ptr": "*fp32",
    "sinks_ptr": "*fp32",
}
FLOAT_SCALARS = {name: "fp32" for name in ("qk_scale", "cap_log2", "k_scale", "v_scale")}

# Options of a variant (kvcore.backend.Attention's): all three of window, soft-cap, sinks.
WINDOWED = {"window_left": 511, "soft_cap": 30.0, "sinks": True}
MLA = {"v_head_dim": 512}
# (head_dim, query group, dtype, page_size, options): the grid, trimmed to what
# exercises distinct code: every head dim, powers and non-powers of two, MHA to wide GQA,
# then the variants of issue 30.
ATTENTION_GRID: list[tuple[int, int, str, int, dict[str, Any]]] = [
    (64, 1, "float16", 16, {}),
    (80, 4, "float16", 16, {}),
    (96, 2, "float32", 16, {}),
    (128, 4, "bfloat16", 16, {}),  # the benchmark shape (Hq 32, Hkv 8)
    (128, 8, "bfloat16", 1, {}),
    (128, 4, "bfloat16", 7, {}),
    (128, 2, "float16", 128, {}),
    (256, 8, "bfloat16", 16, {}),
    (64, 16, "float32", 100, {}),
    (128, 4, "float8_e4m3fn", 16, {}),
    (64, 1, "float8_e5m2", 16, {}),
    (128, 4, "bfloat16", 16, WINDOWED),
    (256, 2, "float8_e4m3fn", 16, WINDOWED),
    (576, 16, "bfloat16", 64, MLA),  # DeepSeek: 128 heads over TP 8
    (576, 128, "float8_e4m3fn", 16, {**MLA, **WINDOWED}),
]
# (num_kv_heads, head_dim, dtype, page_size, parts) for write_kv / copy_pages.
CACHE_GRID = [
    (8, 128, "bfloat16", 16, 2),
    (2, 80, "float16", 7, 2),
    (1, 256, "float32", 128, 2),
    (8, 128, "float8_e4m3fn", 16, 2),
    (1, 576, "bfloat16", 64, 1),
    (1, 576, "float8_e5m2", 16, 1),
]


def _signature(fn: Any, dtype: str, constexprs: dict[str, Any], int_type: str) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in INDEX_POINTERS:
            sig[name] = INDEX_POINTERS[name]
        elif name.endswith("_ptr"):
            rows = dtype if name in CACHE_POINTERS else FP8_QUERY.get(dtype, dtype)
            sig[name] = "*" + DTYPES[rows]
        else:
            sig[name] = FLOAT_SCALARS.get(name, int_type)
    return sig


def _aligned(fn: Any) -> dict[tuple[int], list[list[Any]]]:
    """What Triton's launcher infers for real tensors: every pointer 16-byte aligned and
    every stride a multiple of 16 elements (true for Hkv * D and D = 64, 80, 96, 128, 256).
    Without these hints the compiler cannot prove 16-byte vector loads along D."""
    return {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if name.endswith("_ptr") or name.startswith("stride_")
    }


def _jobs() -> Iterator[tuple[str, Any, str, dict[str, Any], int, int, str]]:
    """(label, kernel, dtype, constexprs, num_warps, num_stages, int type) per compilation."""
    import torch
    from kvcore_triton import cache_ops, decode, decode_plan, prefill

    for i, (head_dim, group, dtype, page, options) in enumerate(ATTENTION_GRID):
        int_type = "i64" if i == 0 else "i32"  # one config with 64-bit strides
        label = f"D={head_dim} G={group} {dtype} page={page}"
        label += "".join(f" {key}={value}" for key, value in options.items())
        num_kv_heads = 1 if "v_head_dim" in options else 8
        for batch in (64, 1):  # 64: few splits; 1: the most splits (widest merge)
            plan = decode_plan.plan_decode(
                batch=batch,
                num_kv_heads=num_kv_heads,
                group=group,
                head_dim=head_dim,
                page_size=page,
                max_tokens=4096,
                sm_count=132,
                interpreted=False,
                v_head_dim=options.get("v_head_dim"),
                window_left=options.get("window_left", -1),
                soft_cap=options.get("soft_cap", 0.0) > 0,
                sinks=options.get("sinks", False),
            )
            if batch == 64:
                yield (
                    label,
                    decode._decode_split_kernel,
                    dtype,
                    plan.split_constexprs(),
                    plan.num_warps,
                    plan.num_stages,
                    int_type,
                )
            if batch == 1 or i == 0:  # the widest merge everywhere, the narrow one once
                yield (
                    f"{label} merge",
                    decode._decode_merge_kernel,
                    dtype,
                    plan.merge_constexprs(),
                    plan.merge_warps,
                    1,
                    "i32",
                )
        pplan = prefill.plan_prefill(
            group=group,
            head_dim=head_dim,
            page_size=page,
            dtype=getattr(torch, FP8_QUERY.get(dtype, dtype)),
            interpreted=False,
            v_head_dim=options.get("v_head_dim"),
            window="window_left" in options,
            soft_cap=options.get("soft_cap", 0.0) > 0,
            sinks=options.get("sinks", False),
        )
        yield (
            label,
            prefill._prefill_kernel,
            dtype,
            pplan.constexprs(),
            pplan.num_warps,
            pplan.num_stages,
            int_type,
        )
    for heads, head_dim, dtype, page, parts in CACHE_GRID:
        block_h, block_d = cache_ops._tile(heads, head_dim)
        label = f"Hkv={heads} D={head_dim} {dtype} page={page} parts={parts}"
        fp8_max, mantissa, exp_min = cache_ops.FP8_FORMATS.get(dtype, (0.0, 0, 0))
        write = {
            "PAGE_SIZE": page,
            "HEAD_DIM": head_dim,
            "BLOCK_H": block_h,
            "BLOCK_D": block_d,
            "HAS_VALUE": parts == 2,
            "FP8_MAX": fp8_max,
            "MANTISSA": mantissa,
            "EXP_MIN": exp_min,
        }
        yield (label, cache_ops._write_kv_kernel, dtype, write, 4, 1, "i32")
        copy = {"HEAD_DIM": head_dim, "BLOCK_H": block_h, "BLOCK_D": block_d}
        yield (label, cache_ops._copy_pages_kernel, dtype, copy, 4, 1, "i32")


def _kernel_names() -> set[str]:
    """Names of every @triton.jit kernel (``*_kernel``) in the kvcore_triton modules (their
    device functions, such as cache_ops._round_fp8, are compiled inside them)."""
    from kvcore_triton import cache_ops, decode, prefill
    from triton.runtime.jit import JITFunction

    return {
        f"{module.__name__}.{name}"
        for module in (cache_ops, decode, prefill)
        for name, obj in vars(module).items()
        if isinstance(obj, JITFunction) and name.endswith("_kernel")
    }


def _worker(shard: int, num_shards: int) -> None:
    """Compile every ``num_shards``-th job from ``shard``; one JSON line each.

    Runs without TRITON_INTERPRET; shards let CI compile on every core."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget(*TARGET)
    print(json.dumps({"kernels": sorted(_kernel_names())}), flush=True)
    for index, job in enumerate(_jobs()):
        if index % num_shards != shard:
            continue
        label, fn, dtype, constexprs, num_warps, num_stages, int_type = job
        name = f"{fn.fn.__module__}.{fn.__name__}"
        record: dict[str, Any] = {
            "kernel": name,
            "config": label,
            "constexprs": constexprs,
            "dtype": dtype,
            "num_warps": num_warps,
        }
        try:
            src = ASTSource(
                fn=fn,
                signature=_signature(fn, dtype, constexprs, int_type),
                constexprs=constexprs,
                attrs=_aligned(fn),
            )
            compiled = triton.compile(
                src, target=target, options={"num_warps": num_warps, "num_stages": num_stages}
            )
            record["ptx_entry"] = ".entry" in compiled.asm["ptx"]
            record["vector_loads"] = compiled.asm["ptx"].count("ld.global.v4")
            record["cubin_bytes"] = len(compiled.asm["cubin"])
            record["shared_bytes"] = compiled.metadata.shared
            record.update(_resources(compiled.asm["cubin"]))
            record["kv_buffers"] = _pipeline_buffers(compiled.asm["ttgir"])
            record["mma_operands"] = sorted(set(WGMMA.findall(compiled.asm["ptx"])))
            record["mma_sync_operands"] = sorted(set(MMA_SYNC.findall(compiled.asm["ptx"])))
        except Exception as exc:
            record["error"] = f"{type(exc).__name__}: {exc}"[-2000:]
        print(json.dumps(record), flush=True)


# wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16: the A operand's type (tf32 for fp32)
WGMMA = re.compile(r"wgmma\.mma_async\.sync\.aligned\.m\d+n\d+k\d+\.\w+\.(\w+)\.")
# mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32: Ampere-style tensor-core MMA (A's type)
MMA_SYNC = re.compile(r"mma\.sync\.aligned\.m\d+n\d+k\d+\.row\.col\.\w+\.(\w+)\.")


def _resources(cubin: bytes) -> dict[str, int]:
    """Registers per thread and stack / local bytes (spills) of the cubin's kernel, as
    ``cuobjdump -res-usage`` (shipped with Triton's ptxas) reports them."""
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.knobs.nvidia.ptxas.path), "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        report = subprocess.run(
            [tool, "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    fields = dict(re.findall(r"\b(REG|STACK|LOCAL):(\d+)", report))
    return {
        "registers": int(fields["REG"]),
        "stack_bytes": int(fields["STACK"]),
        "local_bytes": int(fields["LOCAL"]),
    }


def _pipeline_buffers(ttgir: str) -> int:
    """How many copies of a K/V tile the software pipeliner keeps in shared memory: the
    leading dim of the 3-D ``ttg.local_alloc`` buffers (``memdesc<2x32x128xbf16>``); 0
    when nothing is staged through shared memory that way."""
    shapes = re.findall(r"ttg\.local_alloc[^\n]*?memdesc<((?:\d+x){3})", ttgir)
    return max((int(shape.split("x")[0]) for shape in shapes), default=0)


def resident_ctas(registers: int, shared_bytes: int, num_warps: int) -> int:
    """CTAs of one kernel an sm_90 SM holds: 64K registers allocated 8 per thread at a
    time, 228 KB of shared memory with 1 KB reserved per CTA, at most 32 CTAs."""
    by_registers = 65536 // (cdiv(registers, 8) * 8 * 32 * num_warps)
    by_shared = 228 * 1024 // (shared_bytes + 1024)
    return min(32, by_registers, by_shared)


def _ptxas_missing() -> str | None:
    try:
        import triton

        path = triton.knobs.nvidia.ptxas.path
    except Exception as exc:
        return f"Triton's ptxas cannot be located ({exc})"
    if not path or not os.path.exists(path):
        return "ptxas (shipped in the Triton wheel) is absent: no sm_90 cubin can be built"
    return None


@pytest.fixture(scope="module")
def compiled() -> dict[str, Any]:
    reason = _ptxas_missing()
    if reason is not None:
        pytest.skip(reason)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silence 3.9's default-change warning
    shards = max(1, min(4, os.cpu_count() or 1))
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(shard), str(shards)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for shard in range(shards)
    ]
    kernels: list[str] = []
    records: list[dict[str, Any]] = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=900)
        lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        assert proc.returncode == 0 and lines, f"compile worker failed:\n{stderr[-4000:]}"
        kernels = lines[0]["kernels"]
        records.extend(lines[1:])
    return {"kernels": kernels, "records": records}


def test_every_kernel_is_compiled(compiled: dict[str, Any]) -> None:
    built = {r["kernel"] for r in compiled["records"]}
    assert len(compiled["kernels"]) >= 5
    assert set(compiled["kernels"]) <= built, set(compiled["kernels"]) - built


def test_every_config_yields_ptx_and_cubin(compiled: dict[str, Any]) -> None:
    failures = [r for r in compiled["records"] if "error" in r]
    assert not failures, "\n\n".join(
        f"{r['kernel']} [{r['config']}]: {r['error']}" for r in failures
    )
    for r in compiled["records"]:
        assert r["ptx_entry"], r
        assert r["cubin_bytes"] > 0, r
        assert r["shared_bytes"] <= 227 * 1024, r  # fits an H100/H200 SM


def test_attention_kernels_read_kv_in_16_byte_vectors(compiled: dict[str, Any]) -> None:
    """Decode is bound by reading K/V: rows of D elements must load as 16-byte vectors
    (ld.global.v4), including head dims 80 and 96 that are masked to a power of two."""
    for r in compiled["records"]:
        if r["kernel"].endswith(("_decode_split_kernel", "_prefill_kernel")):
            assert r.get("vector_loads", 0) > 0, r


def _records(compiled: dict[str, Any], kernel: str) -> list[dict[str, Any]]:
    found = [r for r in compiled["records"] if r["kernel"].endswith(kernel)]
    assert found, kernel
    return found


def test_decode_double_buffers_kv_within_its_register_budget(compiled: dict[str, Any]) -> None:
    """Page ids loaded one block ahead let the pipeliner keep two K/V buffers in flight
    (with the id load beside its K/V loads it keeps one at any num_stages). No spills;
    16-bit caches keep the CTAS_PER_SM residency the split count is sized for; the
    benchmark shape (bf16, D=128, group 4) was 78 registers and 43 KB when written."""
    from kvcore_triton.decode_plan import CTAS_PER_SM, CTAS_PER_SM_D256, MLA_CTAS_PER_SM

    for r in _records(compiled, "_decode_split_kernel"):
        assert r["kv_buffers"] == 2, r
        assert r["stack_bytes"] == 0 and r["local_bytes"] == 0, r  # no spills
        if r["dtype"] != "float32":
            want = CTAS_PER_SM_D256 if r["constexprs"]["BLOCK_D"] >= 256 else CTAS_PER_SM
            want = MLA_CTAS_PER_SM if r["constexprs"]["LATENT"] else want
            ctas = resident_ctas(r["registers"], r["shared_bytes"], r["num_warps"])
            assert ctas >= want, (ctas, r)
        if r["config"] == "D=128 G=4 bfloat16 page=16":
            assert r["registers"] <= 88 and r["shared_bytes"] <= 44 * 1024, r


def test_prefill_runs_16_bit_operands_on_tensor_cores_with_pipelined_loads(
    compiled: dict[str, Any],
) -> None:
    """fp16/bf16 queries (over their own caches, or fp8 ones converted to them): wgmma
    on 16-bit operands (not TF32 on widened ones), K/V staged through at least two
    shared buffers, no spills (the benchmark shape: 96 registers, 64 KB, 3 buffers when
    written; before: TF32, 1 stage, 159 registers). MLA's 32-row tiles (64 spill at
    D = 512) run mma.sync on the same operands (166 registers when written)."""
    for r in _records(compiled, "_prefill_kernel"):
        assert r["stack_bytes"] == 0 and r["local_bytes"] == 0, r
        assert r["kv_buffers"] >= 2, r
        query = FP8_QUERY.get(r["dtype"], r["dtype"])  # fp8 K/V go to the query's dtype
        want = {"float16": ["f16"], "bfloat16": ["bf16"], "float32": ["tf32"]}[query]
        mma = "mma_sync_operands" if r["constexprs"]["BLOCK_M"] < 64 else "mma_operands"
        assert r[mma] == want, r


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]))
