"""Tolerances derived from the arithmetic: how far two computations of one quantity may be
apart, from the formats they round to and the sizes of their sums, on any CPU or GPU.

Every numeric comparison of the test suite takes its bound from here and names the
derivation next to its assert; none is a number fitted to one machine. A bound covers
any order of summation and any vector width (AVX-512, AVX2, scalar, a GPU's), and is no
wider than that: a wrong page, a wrong scale or a dropped token still fails it (the
tests that claim so also run the corrupted case: their negative controls).

Unit roundoff ``u`` (the largest relative error of rounding to nearest) of each format,
``2^-p`` for a significand of ``p`` bits::

    float64 2^-53   float32 2^-24   tf32 2^-11   float16 2^-11   bfloat16 2^-8
    float8_e4m3fn 2^-4   float8_e5m2 2^-3

A sum or dot product of ``n`` terms evaluated in precision ``u``, in any order, is within
``gamma(n) * sum |x_i y_i|`` of the exact one, ``gamma(n) = n u / (1 - n u)`` (Higham,
*Accuracy and Stability of Numerical Algorithms*, 2nd ed., section 3.1); two evaluations
in different orders are within twice that of each other. ``gamma(a) + gamma(b) <=
gamma(a + b)``, so the terms of a chain of sums add up as one longer sum.

Three kinds of bound live here:

* :func:`attention`: two attention kernels (or a kernel and float64) over the same
  stored K/V, a forward-error bound from the tensors' own magnitudes;
* :func:`rescaled`: a whole model's outputs (logits, log-probabilities) computed in two
  orders, from the effect of a rounding of known size measured on the same inputs;
* :func:`fp8_flips` and :func:`subset_effect`: two runs that each round K/V to fp8 from
  fp32 values a few ulps apart, and so may round a few elements to neighbouring values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

UNIT_ROUNDOFF: dict[str, float] = {
    "float64": 2.0**-53,
    "float32": 2.0**-24,
    "tf32": 2.0**-11,  # fp32 operands of tensor-core dots: 10 stored significand bits
    "float16": 2.0**-11,
    "bfloat16": 2.0**-8,
    "float8_e4m3fn": 2.0**-4,
    "float8_e5m2": 2.0**-3,
}
FP32 = UNIT_ROUNDOFF["float32"]
EXP_ULPS = 8
"""fp32 roundings charged to each softmax weight besides its score's error: the
exponential (libm within 1 ulp, a GPU's ``ex2.approx`` within 2, an emulation of it
within 4), the subtraction of the running max, a log2(e) factor, the division by the
denominator: at most 8."""


def format_name(fmt: str | torch.dtype) -> str:
    """``torch.bfloat16`` or ``"bfloat16"`` -> ``"bfloat16"``."""
    return fmt if isinstance(fmt, str) else str(fmt).removeprefix("torch.")


def unit_roundoff(fmt: str | torch.dtype) -> float:
    """``u`` of a format (module docstring); KeyError for a format without one."""
    return UNIT_ROUNDOFF[format_name(fmt)]


def gamma(n: int, u: float = FP32) -> float:
    """Higham's ``gamma_n = n u / (1 - n u)``: the relative error bound of a sum or dot
    product of ``n`` terms in precision ``u``, in any order."""
    if n * u >= 1:
        raise ValueError(f"gamma_{n} is unbounded at u = {u}")
    return n * u / (1 - n * u)


@dataclass(frozen=True, slots=True)
class Tolerance:
    """``|actual - expected| <= atol + rtol * |expected|`` elementwise (torch's
    assert_close rule); ``why`` names the derivation and its numbers."""

    atol: float
    rtol: float
    why: str

    def __str__(self) -> str:
        return f"atol {self.atol:.3g}, rtol {self.rtol:.3g}: {self.why}"


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance, what: str = ""
) -> None:
    """torch.testing.assert_close in float32 on the CPU, the bound and its derivation in
    the failure message."""
    torch.testing.assert_close(
        actual.float().cpu(),
        expected.float().cpu(),
        atol=tol.atol,
        rtol=tol.rtol,
        msg=lambda m: f"{what} differs beyond {tol}\n{m}".lstrip(),
    )


# -- attention kernels ------------------------------------------------------------------


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    *,
    keys: int,
    operands: str | None = None,
    sides: int = 1,
    same_qk: bool = False,
    implementations: int = 2,
) -> Tolerance:
    """Bound on two attention outputs over the same stored K/V: ``o = sum_j p_j v_j``,
    ``p = softmax(s)``, ``s_j = scale * q . k_j`` (soft-capped or not, sinks or not).

    ``query`` in the output's dtype; ``key`` / ``value`` as the kernels read them,
    dequantized (fp8 values times their scales), any shape whose last dim is the head
    dim, NaN (poisoned slots) ignored; ``keys``: the most keys one query attends.
    ``implementations``: 2 for two computations in fp32 arithmetic, 1 against float64.
    ``operands``: the format the kernel under test may round its dot operands to
    besides fp32 -- "float16"/"bfloat16" (P rounded to the query's 16-bit dtype for
    P V, as FlashAttention does; Q, K and V are already in it), "tf32" (fp32 operands
    of tensor-core dots: Q, K, P and V rounded to 10 stored bits), None (fp32
    operands); ``sides``: how many of the two computations round so (1: a backend
    against the oracle or a dense reference; 2: a backend against itself);
    ``same_qk``: both round the same Q and K the same way (one kernel under another
    page order or layout), so that rounding cancels, while P, computed in other
    orders, may still round apart.

    Derivation, u = fp32's, D the head dim, n = keys + 1 (a sink)::

        S   = |scale| max ||q||_2 max ||k||_2  >=  |scale| sum_i |q_i k_ji|  (Cauchy-Schwarz)
        V   = max |v|
        e_s = (gamma(D + 6) + u_qk) S         a score's error: D products and sums;
                                              the scale (on Q or the scores), k_scale
                                              (on K or the scale), a soft cap's
                                              division, tanh (2 ulps) and product
                                              (slope <= 1); u_qk = 2 u(tf32) when Q
                                              and K are rounded to tf32, else 0
        |dp_j| / p_j <= 2 e_s + gamma(4 n) + 8 u
            softmax: every score's error enters twice (its own, the max and the
            normaliser's); the sums of numerator and denominator, the online
            rescalings and the split-KV merge are 4 sums of <= n terms; EXP_ULPS
        |do| <= sum_j |dp_j| |v_j| + (gamma(n + 1) + u_pv) sum_j p_j |v_j|
             <= (2 e_s + gamma(5 n + 1) + 8 u + u_pv) V
            (the P V sum, v_scale applied to V or the output; u_pv: P, and V on tf32,
            rounded)

    The fp32 part ``(2 gamma(D + 6) S + gamma(5n + 1) + 8u) V`` is charged to each of the
    ``implementations``, the operand part ``(2 u_qk S + u_pv) V`` to each of the
    ``sides`` (u_qk = 0 when ``same_qk``): ``atol``. Each
    output is then rounded once to its dtype (relative u_out each): ``rtol = 2 u_out``.
    Both sides read the same stored K/V and query, so their rounding to the cache's
    format is shared and not charged.
    """
    out = format_name(query.dtype)
    head_dim, n = query.shape[-1], keys + 1
    s_abs = abs(scale) * _max_row_norm(query) * _max_row_norm(key)
    v_max = _max_abs(value)
    u_op = unit_roundoff(operands) if operands is not None else 0.0
    u_qk = 2 * u_op if operands == "tf32" and not same_qk else 0.0
    u_pv = 2 * u_op if operands == "tf32" else u_op
    fp32_part = (2 * gamma(head_dim + 6) * s_abs + gamma(5 * n + 1) + EXP_ULPS * FP32) * v_max
    operand_part = (2 * u_qk * s_abs + u_pv) * v_max
    atol = implementations * fp32_part + sides * operand_part
    why = (
        f"attention: {implementations} x (2 gamma({head_dim} + 6) S + gamma(5 x {n} + 1) + "
        f"{EXP_ULPS}u) V + {sides} x (2 u_qk S + u_pv) V, S = {s_abs:.3g}, V = {v_max:.3g}, "
        f"u_qk = {u_qk:.2g}, u_pv = {u_pv:.2g}; rtol 2 u({out})"
    )
    return Tolerance(atol, 2 * unit_roundoff(out), why)


def _finite(x: torch.Tensor) -> torch.Tensor:
    x = x.detach().float().cpu()
    return torch.where(x.isfinite(), x, torch.zeros((), dtype=x.dtype))


def _max_row_norm(x: torch.Tensor) -> float:
    """Largest 2-norm of the rows (last dim) of ``x``, NaN rows' NaNs as 0."""
    finite = _finite(x)
    return float(finite.norm(dim=-1).max()) if finite.numel() else 0.0


def _max_abs(x: torch.Tensor) -> float:
    finite = _finite(x)
    return float(finite.abs().max()) if finite.numel() else 0.0


def cache_parts(
    kv_cache: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    v_head_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(key, value) of a paged cache ``[pages, parts, page_size, Hkv, D]`` as a kernel reads
    them, dequantized to float32 (fp8 values times their scales, NaN bytes stay NaN); a
    latent cache (one part) gives its vectors as K and their first ``v_head_dim``
    elements, scaled by ``k_scale``, as V."""
    cache = kv_cache.detach().cpu()
    key = cache[:, 0].float() * k_scale
    if v_head_dim is not None:
        return key, key[..., :v_head_dim]
    return key, cache[:, 1].float() * v_scale


# -- whole models -------------------------------------------------------------------------


def reordered(n: int, fmt: str | torch.dtype = "float32") -> float:
    """The largest relative difference of one sum or dot product of ``n`` terms evaluated
    in ``fmt`` in two orders: ``2 gamma(n)``."""
    return 2 * gamma(n, unit_roundoff(fmt))


def rescaled(effect: float, measured_u: float, compared_u: float) -> float:
    """A model's outputs computed twice with every operation's result perturbed by a
    relative ``compared_u`` at most, given ``effect``: how far they move when every
    operation is perturbed by ``measured_u`` (a run in a coarser format, measured on the
    same inputs).

    Derivation: to first order an output moves by ``J delta``, ``delta`` the relative
    perturbations of the operations' results; scaling every ``delta`` by ``c`` scales
    the move by ``c``. A bf16 run rounds every weight and every operation's result
    (``measured_u = u(bf16)``); two fp32 runs whose sums take other orders perturb each
    by at most ``compared_u = reordered(n)``, ``n`` the longest reduction. So the bound
    is ``effect * compared_u / measured_u``. The bf16 run's roundings are random in
    sign, and so in practice are the fp32 runs' (``reordered`` is their worst case), so
    the ratio keeps a margin of ``gamma(n) / (sqrt(n) u)`` over the typical case.
    """
    return effect * compared_u / measured_u


# -- two independent fp8 roundings ----------------------------------------------------------


def fp8_flips(elements: int, fmt: str | torch.dtype, disagreement: float, tail: float) -> int:
    """How many of ``elements`` fp8 values two runs may round differently, except with
    probability ``tail``, when their fp32 values before rounding are within a relative
    ``disagreement`` of each other.

    Derivation: in a binade of an fp8 format with ``p`` significand bits the values are
    ``s = 2 u |x|`` .. ``u |x|`` apart (``u = 2^-p``); two values ``x`` and ``x (1 + d)``
    round to different neighbours only if a rounding midpoint lies between them, with
    probability ``|d x| / s <= d / u`` for a position on the grid that is uniform (the
    values' low bits are noise at this scale). Over ``elements`` independent elements
    the count is Poisson with mean ``lam = elements * d / u``; the bound is its upper
    quantile at ``tail``.
    """
    lam = elements * disagreement / unit_roundoff(fmt)
    term = math.exp(-lam)
    below, k = term, 0
    while 1 - below > tail:
        k += 1
        term *= lam / k
        below += term
    return k


def subset_effect(effect_all: float, elements: int, flips: int) -> float:
    """How far ``flips`` elements rounded to a neighbouring fp8 value (one step, ``s``)
    move an output, given ``effect_all``: how far rounding all ``elements`` (error
    uniform in ``+-s/2``) moves it (the quantized run against the float run, measured).

    Derivation: to first order both moves are sums ``sum_e g_e err_e`` over elements
    with independent signs, so they scale with the root of the summed squares: the
    rounding of all has ``E err^2 = s^2 / 12`` on each of ``elements`` terms, the flips
    ``s^2`` on ``flips`` terms, and which elements flip does not depend on their weights
    ``g_e``. Hence ``effect_all * sqrt(12 flips / elements)``.
    """
    return effect_all * math.sqrt(12 * flips / elements)
