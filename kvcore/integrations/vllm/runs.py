"""Page copies as byte runs, where the pool's order matches vLLM's blocks.

When a page of one layer is one dense run of bytes on both sides, with its
elements in the same order (:class:`Side` and :meth:`Side.runs_with`: the pool in
the order :func:`~.orders.matching_order` names), copying it is a ``memcpy`` of
``unit`` bytes, and runs that continue each other on both sides merge::

    layer-major both sides (pool "LPHKT", vLLM "LBHNC"): adjacent pages of a layer
        pool  L0: |p3|p4|p5|...   vLLM L0: |b7|b8|b9|...   -> (p3..p5 -> b7..b9) one run
    page-major pool, block-major vLLM (pool "PLHKT", vLLM "BLHNC"): a page, all layers
        pool  p3: |L0|L1|L2|...   vLLM b7: |L0|L1|L2|...   -> (p3 -> b7) one run

:meth:`ByteRuns.plan` finds them from the tensors' addresses and strides (no layout
name is trusted: a cache that is not what it was named for copies strided, never
wrongly); :meth:`ByteRuns.run` copies each with a ``memmove`` (a page or so) or one
``copy_`` of flat bytes (a longer run: torch spreads it over its threads, as it does a
memcpy). The plan is per page, not per layer: each layer adds one addition per run.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Side:
    """One side of a copy: every layer's ``[pages, parts, N, H, D]`` view, as bytes.
    ``memory``: flat uint8 tensors over the storages the views live in; ``bases[l]``:
    (index into ``memory``, byte offset of page 0 of layer l); ``page_stride``: bytes
    from a page to the next (the same in every layer); ``unit``: bytes of one page of
    one layer, one dense run; ``inner``: (axis of the view, size, byte stride) of each
    axis of a page with more than one element, outermost first (the order of its bytes:
    two axes of one size are told apart by which they are)."""

    memory: tuple[torch.Tensor, ...]
    bases: tuple[tuple[int, int], ...]
    page_stride: int
    unit: int
    inner: tuple[tuple[int, int, int], ...]

    @classmethod
    def of(cls, views: Sequence[torch.Tensor]) -> Side | None:
        """The side of ``views`` (one per layer, of one shape and strides), or None where
        a page of a layer is not one dense run (a strided order)."""
        first = views[0]
        size = first.element_size()
        dims = sorted(
            zip(range(1, 5), first.shape[1:], [s * size for s in first.stride()[1:]], strict=True),
            key=lambda d: -d[2],
        )
        inner = tuple(d for d in dims if d[1] > 1)
        step = size
        for _, n, stride in reversed(inner):
            if stride != step:
                return None
            step *= n
        if any(v.shape != first.shape or v.stride() != first.stride() for v in views):
            return None
        memory: dict[int, torch.Tensor] = {}  # storage address -> its bytes
        bases = []
        for view in views:
            storage = view.untyped_storage()
            if storage.data_ptr() not in memory:
                flat = torch.empty(0, dtype=torch.uint8, device=view.device)
                memory[storage.data_ptr()] = flat.set_(storage)
            index = list(memory).index(storage.data_ptr())
            bases.append((index, view.data_ptr() - storage.data_ptr()))
        return cls(tuple(memory.values()), tuple(bases), first.stride(0) * size, step, inner)

    def runs_with(self, other: Side) -> bool:
        """Whether a page of a layer is the same bytes in the same order on both sides."""
        return self.unit == other.unit and self.inner == other.inner

    def layers_adjacent(self, layers: Sequence[int]) -> bool:
        """Whether, within a page, layer ``layers[i + 1]`` follows ``layers[i]`` at once."""
        return all(
            self.bases[b] == (self.bases[a][0], self.bases[a][1] + self.unit)
            for a, b in itertools.pairwise(layers)
        )


THREADED_BYTES = 1 << 20
"""A run of at least this many bytes is one torch ``copy_`` (spread over torch's threads);
a shorter one one ``memmove`` (no dispatch, no thread wake-up: a scattered 128 KiB page
copies faster so)."""


@dataclass(frozen=True, slots=True)
class ByteRuns:
    """One step's copies of one KV cache group between two sides: ``runs`` as
    ``(src page, dst page, pages)`` (pages adjacent on both sides merged), copied in
    every layer of ``layers``, or, ``across_layers``, as one run of all of them per
    page (both sides keep a page's layers adjacent). ``pages``: pages per layer."""

    src: Side
    dst: Side
    layers: tuple[int, ...]
    across_layers: bool
    pages: int
    runs: tuple[tuple[int, int, int], ...]

    @classmethod
    def plan(
        cls,
        src: Side,
        dst: Side,
        layers: Sequence[int],
        pages: Sequence[tuple[int, int]],
    ) -> ByteRuns:
        """The runs that copy page ``s`` of ``src`` to page ``d`` of ``dst`` for each
        ``(s, d)`` of ``pages`` (no ``d`` twice), in every layer of ``layers`` (one
        page size on both sides: :meth:`Side.runs_with`)."""
        assert src.runs_with(dst), (src, dst)
        across = src.layers_adjacent(layers) and dst.layers_adjacent(layers)
        span = src.unit * (len(layers) if across else 1)  # bytes of one page's run
        merge = src.page_stride == span and dst.page_stride == span  # pages adjacent too
        runs: list[tuple[int, int, int]] = []
        for s, d in pages:
            if merge and runs:
                s0, d0, n = runs[-1]
                if s == s0 + n and d == d0 + n:
                    runs[-1] = (s0, d0, n + 1)
                    continue
            runs.append((s, d, 1))
        return cls(src, dst, tuple(layers), across, len(pages), tuple(runs))

    def run(self) -> None:
        """Copy every run (CPU memory on both sides; synchronous)."""
        src, dst = self.src, self.dst
        firsts = self.layers[:1] if self.across_layers else self.layers
        span = src.unit * (len(self.layers) if self.across_layers else 1)
        move = ctypes.memmove
        for layer in firsts:
            (i, a0), (j, b0) = src.bases[layer], dst.bases[layer]
            source, target = src.memory[i], dst.memory[j]
            a_ptr, b_ptr = source.data_ptr() + a0, target.data_ptr() + b0
            for s, d, n in self.runs:
                a, b, size = s * src.page_stride, d * dst.page_stride, n * span
                if size >= THREADED_BYTES:
                    target[b0 + b : b0 + b + size].copy_(source[a0 + a : a0 + a + size])
                else:
                    move(b_ptr + b, a_ptr + a, size)
