"""kvcore_torch: the reference backend in plain PyTorch (entry point ``torch``), the
oracle of the conformance suite; it runs on any device torch runs on.

Modules, one job each: :mod:`~kvcore_torch.backend` (the :class:`TorchBackend`:
its plans' gather and scatter indices, plain decode by SDPA, prefill and every
feature by the reference numerics), :mod:`~kvcore_torch.reference` (those
numerics: ``gather_kv``, ``attend``, ``quantize``), :mod:`~kvcore_torch.rows`
(the cache seen as rows, so a gather or scatter is one ``index_select`` /
``index_copy_``).
"""

from kvcore_torch.backend import DecodeGather, TorchBackend
from kvcore_torch.reference import attend, gather_kv, quantize

__all__ = ["DecodeGather", "TorchBackend", "attend", "gather_kv", "quantize"]
