"""Every .cu file of kvcore_cupy compiles for a real GPU (sm_90) with the machine's nvcc.

CuPy compiles the kernels with NVRTC at run time, on the GPU machine; a kernel
that does not build would only fail there. So CI compiles here, with nvcc, the
exact text and instantiations the backend hands NVRTC (kvcore_cupy.kernels):
one generated translation unit per file holds ``kernels.source(file)`` (the
.cu with common.cuh pasted in) and takes the address of every name
expression, which instantiates it, and ``-cubin`` runs ptxas on each. The
cubin must then hold a kernel symbol for each instantiation. Warnings are
errors.

NVRTC has no host headers: the sources may include nothing but our own
``common.cuh`` (checked below, with or without nvcc).

nvcc: the one on PATH, else the CUDA compiler wheel (``nvidia-cuda-nvcc``) that
tests/install.sh installs from PyPI where PATH has none (:func:`find_nvcc`). In CI
(``CI=true``) a missing nvcc fails these tests instead of skipping them, so the
compile check cannot silently disappear on a clean machine. The three files
compile in parallel (60-75 s on 2 cores: 5 dtypes x 5 head dims x 2 widths x 3 tiles).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from kvcore_cupy import kernels

ARCH = "sm_90"
#: where tests/install.sh puts the nvcc wheel (``pip install --target``) when PATH has no nvcc
NVCC_WHEEL_DIR = Path(
    os.environ.get("KVCORE_NVCC_DIR", Path.home() / ".cache" / "kvcore" / "nvcc-13.5.37")
)


def find_nvcc(path: str | None = None, wheel_dir: Path = NVCC_WHEEL_DIR) -> str | None:
    """nvcc on ``path`` (default: PATH), else ``bin/nvcc`` of the nvidia-cuda-nvcc
    wheel: in ``wheel_dir`` (tests/install.sh) or in this interpreter's site-packages
    (``nvidia/cu13``; ``nvidia/cuda_nvcc`` for the cu12 wheels); None if none.
    The wheel's nvcc.profile finds its ptxas, cicc and headers beside it."""
    found = shutil.which("nvcc", path=path)
    if found:
        return found
    roots = [wheel_dir / "nvidia"]
    spec = importlib.util.find_spec("nvidia")
    if spec is not None and spec.submodule_search_locations:
        roots += [Path(p) for p in spec.submodule_search_locations]
    for root in roots:
        for sub in ("cu13", "cuda_nvcc"):
            nvcc = root / sub / "bin" / "nvcc"
            if nvcc.is_file() and os.access(nvcc, os.X_OK):
                return str(nvcc)
    return None


NVCC = find_nvcc()
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture(scope="module")
def nvcc() -> str:
    """The nvcc to run: a skip without one, a failure in CI (tests/install.sh installs it)."""
    if NVCC is None:
        why = f"nvcc not found (PATH, {NVCC_WHEEL_DIR}, site-packages nvidia/*/bin)"
        if IN_CI:
            pytest.fail(f"{why}: CI must compile the kernels; tests/install.sh installs nvcc")
        pytest.skip(why)
    return NVCC


def test_find_nvcc_takes_the_wheel_without_path(tmp_path: Path) -> None:
    """With no nvcc on PATH, the locator finds a wheel-laid ``nvidia/cu13/bin/nvcc``."""
    fake = tmp_path / "nvidia" / "cu13" / "bin" / "nvcc"
    fake.parent.mkdir(parents=True)
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert find_nvcc(path=str(tmp_path / "empty"), wheel_dir=tmp_path) == str(fake)


def translation_unit(file: str, names: list[str]) -> str:
    """The source NVRTC gets, then every name expression instantiated by taking its address."""
    body = "".join(f"    (void*)&{name},\n" for name in names)
    return (
        f"{kernels.source(file)}\n"
        f"void* const kvcore_instantiations[] = {{\n{body}}};\n"
        f"void* const* kvcore_use() {{ return kvcore_instantiations; }}\n"
    )


_SIMPLE_TYPES = {"float": "f", "int": "i", "bool": "b"}


def mangled_fragment(name: str) -> str:
    """The Itanium-mangled ``name<args>`` part of a kernel symbol, for our simple
    template arguments: ``decode_partial<kv_bf16, 128, 4, true>`` ->
    ``14decode_partialI7kv_bf16Li128ELi4ELb1EE``."""
    m = re.fullmatch(r"(\w+)<(.*)>", name)
    assert m is not None, name
    base, args = m.group(1), [a.strip() for a in m.group(2).split(",")]
    out = f"{len(base)}{base}I"
    for arg in args:
        if arg in ("true", "false"):
            out += f"Lb{int(arg == 'true')}E"
        elif re.fullmatch(r"-?\d+", arg):
            out += f"Li{arg.replace('-', 'n')}E"
        elif arg in _SIMPLE_TYPES:
            out += _SIMPLE_TYPES[arg]
        else:
            out += f"{len(arg)}{arg}"
    return out + "E"


def test_mangling_helper() -> None:
    assert mangled_fragment("decode_partial<kv_bf16, 128, 4, true>") == (
        "14decode_partialI7kv_bf16Li128ELi4ELb1EE"
    )
    assert mangled_fragment("write_kv<16>") == "8write_kvILi16EE"
    assert mangled_fragment("decode_merge<float>") == "12decode_mergeIfE"


def test_sources_include_no_host_header() -> None:
    """NVRTC compiles without host headers: only our own quoted includes are allowed."""
    for path in [*kernels.KERNEL_DIR.glob("*.cu"), *kernels.KERNEL_DIR.glob("*.cuh")]:
        for line in path.read_text().splitlines():
            if line.strip().startswith("#include"):
                assert line.strip() == '#include "common.cuh"', f"{path.name}: {line}"


def test_every_capability_has_an_instantiation() -> None:
    """The backend's declared dtypes x head dims x group tiles x widths are all compiled."""
    names = kernels.all_name_expressions()
    per_config = len(kernels.GROUP_TILES)
    combos = len(kernels.C_TYPES) * len(kernels.HEAD_DIMS) * 2  # wide and element-wise
    assert len(names["prefill.cu"]) == combos * per_config
    merges = {kernels.decode_merge_name(dtype) for dtype in kernels.C_TYPES}
    assert merges == {"decode_merge<float>", "decode_merge<kv_f16>", "decode_merge<kv_bf16>"}
    assert len(names["decode.cu"]) == combos * per_config + len(merges)  # fp8 merges are fp32
    fp8_writes = [kernels.write_fp8_name(dtype) for dtype in sorted(kernels.FP8_DTYPES)]
    assert set(fp8_writes) <= set(names[kernels.CACHE_OPS_FILE])
    assert len(names[kernels.CACHE_OPS_FILE]) == 2 * len(kernels.COPY_CHUNK_BYTES) + 2
    assert set(names) == set(kernels.ALL_FILES)


@pytest.fixture(scope="module")
def cubins(
    nvcc: str, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[int, str, bytes]]:
    """Compile each kernel file (all its instantiations) in parallel: file ->
    (return code, compiler output, cubin bytes)."""
    out_dir = tmp_path_factory.mktemp("cubin")
    jobs: dict[str, tuple[subprocess.Popen[str], Path]] = {}
    for file, names in kernels.all_name_expressions().items():
        unit = out_dir / f"inst_{file}"
        unit.write_text(translation_unit(file, names))
        cubin = out_dir / f"{file}.cubin"
        cmd = [
            nvcc,
            f"-arch={ARCH}",
            "-cubin",
            "-Werror",
            "all-warnings",
            "-Xptxas",
            "-v",
            *kernels.options(),
            "-o",
            str(cubin),
            str(unit),
        ]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        jobs[file] = (proc, cubin)
    results: dict[str, tuple[int, str, bytes]] = {}
    for file, (proc, cubin) in jobs.items():
        output, _ = proc.communicate(timeout=600)
        data = cubin.read_bytes() if cubin.exists() else b""
        results[file] = (proc.returncode, output, data)
    return results


@pytest.mark.parametrize("file", kernels.ALL_FILES)
def test_nvcc_compiles_for_sm90(file: str, cubins: dict[str, tuple[int, str, bytes]]) -> None:
    rc, output, data = cubins[file]
    assert rc == 0, f"nvcc -arch={ARCH} failed on {file}:\n{output[-6000:]}"
    missing = [
        name
        for name in kernels.all_name_expressions()[file]
        if mangled_fragment(name).encode() not in data
    ]
    assert not missing, f"{file}: no device code for {missing[:8]} ({len(missing)} in all)"


def ptxas_figures(output: str) -> dict[str, tuple[int, int]]:
    """``-Xptxas -v`` output -> {mangled kernel symbol: (registers, spill store bytes)}."""
    figures: dict[str, tuple[int, int]] = {}
    name, spills = "", 0
    for line in output.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            name, spills = m.group(1), 0
        elif m := re.search(r"(\d+) bytes spill stores", line):
            spills = int(m.group(1))
        elif (m := re.search(r"Used (\d+) registers", line)) and name:
            figures[name] = (int(m.group(1)), spills)
    return figures


def _figures_of(file: str, cubins: dict[str, tuple[int, str, bytes]]) -> dict[str, tuple[int, int]]:
    rc, output, _ = cubins[file]
    assert rc == 0, output[-4000:]
    figures = ptxas_figures(output)
    out = {}
    for name in kernels.all_name_expressions()[file]:
        (symbol,) = [s for s in figures if mangled_fragment(name) in s]
        out[name] = figures[symbol]
    return out


def test_decode_fits_its_register_budget_without_spills(
    cubins: dict[str, tuple[int, str, bytes]],
) -> None:
    """decode_partial's __launch_bounds__ holds ptxas to KV_DECODE_MIN_CTAS CTAs of 128
    threads per SM (<= 128 registers; the split count is sized for it), and no
    instantiation spills. Unbounded, with a
    group tile of 8, it took 128 registers at the benchmark shape, up to 255 at NG=8
    (2 CTAs/SM) and spilled up to 16 bytes in some variants."""
    text = (kernels.KERNEL_DIR / "decode.cu").read_text()
    m = re.search(r"#define KV_DECODE_MIN_CTAS (\d+)", text)
    assert m is not None and "__launch_bounds__(KV_DECODE_WARPS * 32, KV_DECODE_MIN_CTAS)" in text
    from kvcore_cupy.plan import CTAS_PER_SM

    min_ctas = int(m.group(1))
    assert min_ctas >= CTAS_PER_SM, "the split count assumes CTAS_PER_SM resident CTAs"
    budget = 65536 // (min_ctas * 128)
    for name, (registers, spills) in _figures_of("decode.cu", cubins).items():
        assert spills == 0, (name, spills)
        if name.startswith("decode_partial"):
            assert registers <= budget, (name, registers)


def test_prefill_fits_its_register_budget_without_spills(
    cubins: dict[str, tuple[int, str, bytes]],
) -> None:
    """prefill's bound (KV_PREFILL_MIN_CTAS CTAs per SM): unbounded, ptxas capped some
    variants at 64 registers and spilled up to 12 bytes."""
    text = (kernels.KERNEL_DIR / "prefill.cu").read_text()
    m = re.search(r"#define KV_PREFILL_MIN_CTAS (\d+)", text)
    assert m is not None and "__launch_bounds__(KV_PREFILL_WARPS * 32, KV_PREFILL_MIN_CTAS)" in text
    budget = 65536 // (int(m.group(1)) * 128)
    for name, (registers, spills) in _figures_of("prefill.cu", cubins).items():
        assert spills == 0 and registers <= budget, (name, registers, spills)


@pytest.mark.parametrize(
    ("name", "vector", "scalar"),
    [
        (kernels.decode_partial_name("bfloat16", 128, 4, wide=True), "v4.u32", "u16"),
        (kernels.prefill_name("bfloat16", 128, 4, wide=True), "v4.u32", "u16"),
        # fp8: 8-byte chunks (as many elements per lane as bf16's 16 bytes)
        (kernels.decode_partial_name("float8_e4m3fn", 128, 4, wide=True), "v2.u32", "u8"),
    ],
)
def test_wide_kernels_load_k_and_v_in_vectors(
    name: str, vector: str, scalar: str, nvcc: str, tmp_path: Path
) -> None:
    """The benchmark shape's kernels read K/V rows with ld.global[.nc].v4.u32 (fp8:
    .v2.u32; the bandwidth lever), not element by element."""
    file = "decode.cu" if name.startswith("decode") else "prefill.cu"
    unit = tmp_path / "one.cu"
    unit.write_text(translation_unit(file, [name]))
    ptx = tmp_path / "one.ptx"
    cmd = [nvcc, f"-arch={ARCH}", "-ptx", *kernels.options(), "-o", str(ptx), str(unit)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    entries = re.split(r"\.entry ", ptx.read_text())[1:]
    (body,) = [e for e in entries if e.startswith("_Z" + mangled_fragment(name))]
    vector_loads = re.findall(rf"ld\.global(?:\.nc)?\.{re.escape(vector)}", body)
    # per lane and loop step: kUnroll (4) K rows + 4 V rows
    assert len(vector_loads) >= 8, f"{name}: {len(vector_loads)} vector loads"
    assert not re.search(rf"ld\.global(?:\.nc)?\.{scalar}\b", body), f"{name}: element-wise"
