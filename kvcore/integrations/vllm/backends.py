"""What vLLM's attention backend means for the pages an engine writes and loads.

Two questions, answered from the engine's ``VllmConfig`` alone, the same way on the
scheduler side (which keys pages) and on the worker side (which copies them):

* :func:`kv_format`, the byte format of the engine's cache. The connector copies
  vLLM's blocks byte for byte, and a block's bytes are not the logical K/V: vLLM's
  ``CPU_ATTN`` stores each block's K transposed (``[D, N]`` per head) on its ``vec``
  and ``vec16`` paths, and tiled for the AMX unit on its ``amx`` path (chosen for
  bf16 with blocks of a multiple of 32 tokens where the CPU has AMX: vLLM's
  ``_get_attn_isa``). Two engines that would write other bytes for the same K/V
  must never exchange pages, so the format enters the engine's model identity
  (``ModelIdentity.kv_format``; spec/hashing.md, "Byte formats"):
  ``vllm/<backend>`` and, for ``CPU_ATTN``, ``/<isa>``. ``vec16`` is written as
  ``vec``: the two paths store the same bytes for every cache dtype
  (tests/test_vllm_formats.py checks it against vLLM's kernel); every other ISA
  keeps its own name (when unsure, a miss).
* :func:`refusal`, whether vLLM itself refuses to reuse cached context for this
  engine (it turns its own prefix cache off for the cause): kvcore then loads
  nothing there either, since the engine would compute with cached context as it
  never does without kvcore. It is told apart by cause, not by
  ``enable_prefix_caching``: an operator who turns vLLM's cache off still gets
  kvcore's hits. The causes are vLLM 0.32's (each names where vLLM decides it).

The backend is the one vLLM's selector picks for the model's attention layers
(:func:`attention_backend`, on either side); the worker checks it against the
backend its layers really run (:func:`check_backend`), so a wrong guess stops
the engine at start-up with both names, never keys a page by the wrong format.
"""

from __future__ import annotations

from typing import Any

from kvcore.errors import LayoutMismatch

__all__ = ["attention_backend", "check_backend", "cpu_isa", "kv_format", "refusal"]

SAME_BYTES = {"vec16": "vec"}
"""CPU_ATTN ISA paths that store the bytes of another (tests/test_vllm_formats.py)."""

REFERENCE_MLA = "CPU_MLA"
"""vLLM's reference MLA backend on CPUs; its platform turns prefix caching off for it
(vllm/platforms/cpu.py: "MLA is enabled on a non-GPU platform; forcing chunked
prefill and prefix caching to be disabled"); AMX_MLA keeps it on."""

BATCH_INVARIANT_UNCACHED = frozenset({"FLASHINFER", "TRITON_MLA"})
"""Backends whose prefix caching vLLM disables under ``VLLM_BATCH_INVARIANT``
(vllm/model_executor/layers/attention/attention.py and mla_attention.py)."""

UNCACHED_ARCHITECTURES = frozenset({"UnlimitedOCRForCausalLM"})
"""Models whose decode K/V is not a function of the prefix alone, so vLLM disables
prefix caching for them (vllm/model_executor/models/config.py: R-SWA)."""


def attention_backend(vllm_config: Any) -> str:
    """``get_name()`` of the attention backend vLLM's selector picks for the model's
    attention layers under ``vllm_config`` (its ``attention_config.backend`` if set,
    else the platform's choice): what a layer of this engine runs."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.selector import get_attn_backend

    mc = vllm_config.model_config
    with set_current_vllm_config(vllm_config):
        backend = get_attn_backend(
            mc.get_head_size(),
            mc.dtype,
            str(vllm_config.cache_config.cache_dtype),
            use_mla=bool(mc.use_mla),
        )
    return str(backend.get_name())


def cpu_isa(vllm_config: Any) -> str:
    """The ISA path vLLM's ``CPU_ATTN`` writes and reads its cache with under
    ``vllm_config`` on this CPU ("amx", "vec", "vec16", "neon", ...): the function
    vLLM's metadata builder calls, with the same arguments (vLLM 0.32 has no public
    API for it)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    mc, cache = vllm_config.model_config, vllm_config.cache_config
    return str(_get_attn_isa(mc.dtype, cache.block_size, mc.get_head_size(), cache.cache_dtype))


def kv_format(vllm_config: Any, backend: str | None = None) -> str:
    """The byte format of the engine's cache (module docstring): ``vllm/<backend>``,
    and ``/<isa>`` for CPU_ATTN (``vec16`` as ``vec``). ``backend``: the one the
    layers run (default: :func:`attention_backend`)."""
    backend = backend or attention_backend(vllm_config)
    if backend != "CPU_ATTN":
        return f"vllm/{backend}"
    isa = cpu_isa(vllm_config)
    return f"vllm/{backend}/{SAME_BYTES.get(isa, isa)}"


def refusal(vllm_config: Any, backend: str | None = None, kv_cache_config: Any = None) -> str:
    """Why vLLM refuses to reuse cached context for this engine, "" if it does not
    (module docstring): by cause, whatever ``enable_prefix_caching`` says.
    ``kv_cache_config``: vLLM's KV cache groups, where a non-causal layer shows."""
    from vllm import envs
    from vllm.platforms import CpuArchEnum, current_platform

    backend = backend or attention_backend(vllm_config)
    cpu = current_platform.is_cpu()
    if cpu and backend == REFERENCE_MLA:
        return (
            f"vLLM runs MLA on its reference {REFERENCE_MLA} backend on this CPU, where "
            f"it turns prefix caching off (vllm/platforms/cpu.py)"
        )
    if cpu and current_platform.get_cpu_architecture() == CpuArchEnum.RISCV:
        return "vLLM turns prefix caching off on RISC-V CPUs (vllm/engine/arg_utils.py)"
    if envs.VLLM_BATCH_INVARIANT and backend in BATCH_INVARIANT_UNCACHED:
        return f"vLLM turns prefix caching off for {backend} under VLLM_BATCH_INVARIANT"
    archs = set(getattr(vllm_config.model_config, "architectures", None) or ())
    if archs & UNCACHED_ARCHITECTURES:
        return f"vLLM turns prefix caching off for {sorted(archs)[0]} (R-SWA decode K/V)"
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    if any(getattr(group.kv_cache_spec, "non_causal", False) for group in groups):
        return "vLLM turns prefix caching off for models with non-causal attention layers"
    return ""


def check_backend(vllm_config: Any, layers: dict[str, Any]) -> None:
    """:class:`~kvcore.errors.LayoutMismatch` unless every attention layer of
    ``layers`` (vLLM's static forward context: name -> layer) runs the backend
    :func:`attention_backend` names, and a CPU_ATTN layer whose ISA is set already
    runs :func:`cpu_isa`'s: pages are keyed by that format on the scheduler side."""
    expected = attention_backend(vllm_config)
    for name, layer in layers.items():
        backend = getattr(layer, "attn_backend", None)
        if backend is None:
            continue
        actual = str(backend.get_name())
        isa = getattr(layer, "isa", None)
        if actual != expected or (isa is not None and isa != cpu_isa(vllm_config)):
            raise LayoutMismatch(
                f"vLLM layer {name} runs {actual}{f' ({isa})' if isa else ''}, but kvcore "
                f"keys this engine's pages by {kv_format(vllm_config, expected)}: set "
                f"vLLM's attention backend explicitly (--attention-backend {actual})"
            )
