"""``kvcore bench kernels``' per-feature figures: each attention variant of the kernel
contract (kvcore/backend.py ``Attention``, fp8 pages) timed per backend against the
torch reference backend and against the same attention on dense tensors, in one run.

Per feature and op (decode: one query per sequence; prefill: the last ``prefill_q``
tokens of each sequence), for every backend that declares the feature:

* ``time_ms``: the run alone (the plan is made once, outside the timed loop);
* ``over_reference``: time / the torch reference backend's time of the same call;
* ``paged_over_dense``: time / the same attention computed on contiguous tensors
  (:func:`dense`: fp32 matmuls, the window and causal masks, soft-cap and sinks as
  the contract states them; fp8 pages dequantized once, outside the timing);
* ``max_abs_err``: the output against that dense output.

Features: ``window`` (the last 256 tokens), ``soft_cap`` (30), ``sinks`` (one
logit per query head), ``fp8`` (float8_e4m3fn pages with per-layer scales) and
``mla`` (a latent cache, DeepSeek's 576 = 512 + 64, V = the first 512). Triton under
``TRITON_INTERPRET=1`` is the interpreter's speed, not the kernel's: such entries
carry ``interpreted: true``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvcore.layout import cdiv

if TYPE_CHECKING:
    import torch

    from kvcore.backend import Attention, Backend

FEATURES = ("window", "soft_cap", "sinks", "fp8", "mla")
WINDOW_LEFT = 255
SOFT_CAP = 30.0
MLA_DIMS = (512, 64)  # kv_lora_rank, qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class Case:
    """One feature's paged inputs and their dense twin (K and V [B, Hkv, ctx, D])."""

    attention: Attention
    kv_cache: torch.Tensor  # [num_pages, parts, page_size, Hkv, D]
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    q_decode: torch.Tensor  # [B, Hq, D]
    q_prefill: torch.Tensor  # [B * prefill_q, Hq, D]
    dense_k: torch.Tensor  # fp32
    dense_v: torch.Tensor  # fp32
    prefill_q: int
    run_options: dict[str, Any]  # k_scale, v_scale, sinks

    @property
    def scale(self) -> float:
        return float(self.q_decode.shape[-1] ** -0.5)


def cases(
    batch: int, context: int, hq: int, hkv: int, dim: int, page: int, prefill_q: int, device: Any
) -> dict[str, Case]:
    """One :class:`Case` per feature, float32 queries, pages scattered at random."""
    import torch

    from kvcore.backend import Attention

    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=gen, device=device)

    def paged(
        parts: int, heads: int, width: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        per_seq = cdiv(context, page)
        kv = randn(batch * per_seq, parts, page, heads, width)
        table = torch.randperm(batch * per_seq, generator=gen, device=device)
        table = table.view(batch, per_seq).to(torch.int32)
        tokens = kv[table.long()].permute(0, 2, 4, 1, 3, 5)  # [B, parts, H, pages, page, W]
        return kv, table, tokens.reshape(batch, parts, heads, -1, width)[:, :, :, :context]

    def case(
        attention: Attention,
        kv: torch.Tensor,
        table: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        width: int,
        **run: Any,
    ) -> Case:
        return Case(
            attention,
            kv,
            table,
            torch.full((batch,), context, dtype=torch.int32, device=device),
            torch.arange(batch + 1, dtype=torch.int32, device=device) * prefill_q,
            randn(batch, hq, width),
            randn(batch * prefill_q, hq, width),
            k.float().contiguous(),
            v.float().contiguous(),
            prefill_q,
            run,
        )

    kv, table, tokens = paged(2, hkv, dim)
    k, v = tokens[:, 0], tokens[:, 1]
    out = {
        "window": case(Attention(window_left=WINDOW_LEFT), kv, table, k, v, dim),
        "soft_cap": case(Attention(logits_soft_cap=SOFT_CAP), kv, table, k, v, dim),
        "sinks": case(Attention(sinks=True), kv, table, k, v, dim, sinks=randn(hq)),
    }
    k_scale, v_scale = 0.5, 0.25
    fp8 = torch.cat([kv[:, :1] / k_scale, kv[:, 1:] / v_scale], 1).to(torch.float8_e4m3fn)
    deq = fp8.float()
    deq = torch.cat([deq[:, :1] * k_scale, deq[:, 1:] * v_scale], 1)
    tokens8 = deq[table.long()].permute(0, 2, 4, 1, 3, 5).reshape(batch, 2, hkv, -1, dim)
    out["fp8"] = case(
        Attention(),
        fp8,
        table,
        tokens8[:, 0, :, :context],
        tokens8[:, 1, :, :context],
        dim,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    rank, rope = MLA_DIMS
    latent, ltable, ltokens = paged(1, 1, rank + rope)
    lk = ltokens[:, 0]
    out["mla"] = case(Attention(v_head_dim=rank), latent, ltable, lk, lk[..., :rank], rank + rope)
    return out


def dense(case: Case, decode: bool) -> torch.Tensor:
    """The case's attention on contiguous fp32 K/V: [rows, Hq, Dv]."""
    import torch

    q = case.q_decode if decode else case.q_prefill
    batch, heads, ctx, _ = case.dense_k.shape
    n = 1 if decode else case.prefill_q
    hq = q.shape[1]
    q = q.float().view(batch, n, hq, -1).transpose(1, 2)  # [B, Hq, n, D]
    k = case.dense_k.repeat_interleave(hq // heads, 1)
    v = case.dense_v.repeat_interleave(hq // heads, 1)
    logits = case.scale * q @ k.transpose(-1, -2)  # [B, Hq, n, ctx]
    a = case.attention
    if a.logits_soft_cap > 0:
        logits = a.logits_soft_cap * torch.tanh(logits / a.logits_soft_cap)
    pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
    key = torch.arange(ctx, device=q.device)[None, :]
    allowed = key <= pos
    if a.window_left >= 0:
        allowed &= key >= pos - a.window_left
    logits = logits.masked_fill(~allowed, float("-inf"))
    sinks = case.run_options.get("sinks")
    if sinks is not None:
        sink = sinks.float().view(1, hq, 1, 1).expand(batch, hq, n, 1)
        weights = torch.softmax(torch.cat([logits, sink], -1), -1)[..., :-1]
    else:
        weights = torch.softmax(logits, -1)
    out = weights @ v  # [B, Hq, n, Dv]
    return out.transpose(1, 2).reshape(batch * n, hq, -1)


def measure(
    names: list[str],
    shape_args: dict[str, int],
    device: Any,
    timer: Callable[[Callable[[], object]], float],
) -> dict[str, Any]:
    """Per feature: the dense time and, per backend declaring it, its figures (the torch
    reference's time is measured first, in the same loop); a backend that cannot run
    the feature reports why."""
    from kvcore import backend as registry

    built = cases(device=device, **shape_args)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    order = ["torch", *(n for n in names if n != "torch")]  # the reference first
    out: dict[str, Any] = {}
    for feature, case in built.items():
        dense_s = {op: timer(_dense_call(case, op)) for op in ("decode", "prefill")}
        entry: dict[str, Any] = {"dense_ms": {op: s * 1e3 for op, s in dense_s.items()}}
        reference: dict[str, float] = {}
        for name in order:
            try:
                backend = registry.get(name)
            except Exception as exc:
                entry[name] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            if feature not in backend.capabilities.features:
                entry[name] = {"error": f"{name} does not declare {feature}"}
                continue
            figures: dict[str, Any] = {}
            for op in dense_s:
                try:
                    seconds, err = _time(backend, case, op, timer)
                except Exception as exc:
                    figures[op] = {"error": f"{type(exc).__name__}: {exc}"}
                    continue
                reference.setdefault(op, seconds)
                figures[op] = {
                    "time_ms": seconds * 1e3,
                    "over_reference": seconds / reference[op],
                    "paged_over_dense": seconds / dense_s[op],
                    "max_abs_err": err,
                }
            if name == "triton" and interpreted:
                figures["interpreted"] = True  # the interpreter's speed, not the kernel's
            entry[name] = figures
        if "torch" not in names:
            entry.pop("torch", None)  # timed as the reference only
        out[feature] = entry
    return out


def _dense_call(case: Case, op: str) -> Callable[[], torch.Tensor]:
    return lambda: dense(case, op == "decode")


def _time(
    backend: Backend, case: Case, op: str, timer: Callable[[Callable[[], object]], float]
) -> tuple[float, float]:
    """(seconds of the run, max abs error against dense) of ``op`` on ``backend``."""
    if op == "decode":
        plan = backend.plan_decode(
            case.kv_cache, case.block_table, case.seq_lens, attention=case.attention
        )

        def call() -> torch.Tensor:
            return backend.decode(
                plan, case.q_decode, case.kv_cache, case.scale, **case.run_options
            )

    else:
        prefill = backend.plan_prefill(
            case.kv_cache,
            case.block_table,
            case.cu_seqlens_q,
            case.seq_lens,
            attention=case.attention,
        )

        def call() -> torch.Tensor:
            return backend.prefill(
                prefill, case.q_prefill, case.kv_cache, case.scale, **case.run_options
            )

    err = float((call().float() - dense(case, op == "decode")).abs().max())
    return timer(call), err
