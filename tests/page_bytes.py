"""Pages of every byte value, for tests that fp8 and latent pages travel byte for byte.

:data:`BYTE_LAYOUTS` are small layouts of the page formats a tier must carry as bytes:
fp8 K/V pages (both formats), a latent (MLA) page, an fp8 latent page. Their pages
hold every byte value 0..255, so e4m3fn NaNs (0x7F, 0xFF) and e5m2 infinities (0x7C,
0xFC) and NaNs are among them; compare with :func:`same_bytes` (torch has no float8
comparison on the CPU, and NaN != NaN anyway).
"""

from __future__ import annotations

import pytest
import torch

from kvcore.layout import KVLayout

BYTE_LAYOUTS = [
    pytest.param(KVLayout(2, 2, 8, 4, "float8_e4m3fn", 8), id="e4m3fn"),
    pytest.param(KVLayout(2, 2, 8, 4, "float8_e5m2", 8), id="e5m2"),
    pytest.param(KVLayout(2, 1, 24, 4, "bfloat16", 8, kind="latent"), id="latent-bf16"),
    pytest.param(KVLayout(2, 1, 24, 4, "float8_e4m3fn", 8, kind="latent"), id="latent-e4m3fn"),
]
ORDERS = [
    pytest.param("LPKTH", id="LPKTH"),  # layer-major: a page is L runs
    pytest.param("PLKTH", id="PLKTH"),  # page-major: a page is one run
    pytest.param("LPHKT", id="LPHKT"),  # head-outer, layer-major
    pytest.param("PLHKT", id="PLHKT"),  # head-outer, page-major: the default
]
"""Physical orders (kvcore.layout) a tier must carry pages of, each in its stored form."""
FP8_SPECIALS = (0x7F, 0xFF, 0x7C, 0xFC, 0x7E, 0x80)
"""e4m3fn NaNs; e5m2 +inf, -inf, a NaN; negative zero."""


def byte_pages(layout: KVLayout, count: int, salt: int = 0) -> torch.Tensor:
    """``count`` pages ``[count, *stored_page_shape]`` of the layout's dtype whose
    bytes run through every value (page ``i`` starts at byte ``salt + 7 * i``), with
    the fp8 special patterns at each page's start."""
    page = layout.page_bytes
    flat = torch.arange(count * page, dtype=torch.int64).reshape(count, page)
    flat = (flat + salt + 7 * torch.arange(count).reshape(-1, 1)) % 256
    data = flat.to(torch.uint8)
    data[:, : len(FP8_SPECIALS)] = torch.tensor(FP8_SPECIALS, dtype=torch.uint8)
    return data.view(layout.torch_dtype()).reshape(count, *layout.stored_page_shape)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, one uint8 row per leading index."""
    return (
        tensor.contiguous()
        .reshape(len(tensor), tensor[0].numel() if len(tensor) else 0)
        .view(torch.uint8)
    )


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True iff ``a`` and ``b`` have one shape and dtype and the same bytes."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(as_bytes(a), as_bytes(b))
