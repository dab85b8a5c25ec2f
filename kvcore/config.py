"""Daemon configuration: pools, endpoints, leases and limits, from flags or TOML.

A TOML file (``kvcore serve --config FILE``) mirrors :class:`ServiceConfig`::

    endpoint = "ipc:///run/kvcore/kvcore.sock"   # default: see default_endpoint()
    events = ""                                  # PUB endpoint; "" = no event stream
    lease_timeout_s = 10.0

    [[pools]]
    name = "default"
    device = "cpu"          # or "cuda:N"
    num_layers = 16
    num_kv_heads = 8
    head_dim = 64
    page_size = 16          # tokens per page
    dtype = "bfloat16"
    size = "256MiB"         # bytes (int, or "512MiB", "2GiB"); or give num_pages instead

Flags override the file; ``--pool`` takes the same keys as ``k=v,k=v``.
Invalid configuration raises :class:`~kvcore.errors.BadRequest`.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import msgspec

from kvcore.errors import BadRequest
from kvcore.layout import KVLayout

SOCKET_NAME = "kvcore.sock"
MAX_LEASE_S = 86_400.0  # a day: lease_ms must fit the wire's ints
MAX_FRAME_BYTES = 1 << 31  # ZeroMQ's message-size limit is an int64; 2 GiB is plenty
MAX_BATCH = 1 << 20  # operations
_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}  # fmt: skip


class PoolConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One pool. Its page count is ``num_pages`` if given, else as many pages as ``size`` holds."""

    name: str = "default"
    device: str = "cpu"
    num_layers: int = 16
    num_kv_heads: int = 8
    head_dim: int = 64
    page_size: int = 16
    dtype: str = "bfloat16"
    size: int | str = "256MiB"
    num_pages: int | None = None

    def layout(self) -> KVLayout:
        if self.device != "cpu" and not re.fullmatch(r"cuda:\d+", self.device):
            raise BadRequest(f"pool {self.name!r}: device must be 'cpu' or 'cuda:N'")
        if self.num_pages is not None:
            return KVLayout(self.num_layers, self.num_kv_heads, self.head_dim, self.page_size,
                            self.dtype, self.num_pages)  # fmt: skip
        return KVLayout.for_budget(
            parse_size(self.size), num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, page_size=self.page_size, dtype=self.dtype,
        )  # fmt: skip


class ServiceConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    endpoint: str = ""  # "" = default_endpoint()
    events: str = ""  # "" = no event stream; "auto" = an ipc socket next to the endpoint
    lease_timeout_s: float = 10.0
    max_frame_bytes: int = 8 << 20
    max_batch: int = 4096
    insecure: bool = False  # allow tcp:// without CURVE
    curve_secret_key_file: str = ""  # z85 secret key (40 chars) for tcp://
    allow_ephemeral: bool = False  # attach may create private pools (tests, development)
    pools: list[PoolConfig] = msgspec.field(default_factory=lambda: [PoolConfig()])

    def validate(self) -> None:
        if not self.pools:
            raise BadRequest("no pools configured")
        names = [pool.name for pool in self.pools]
        if len(set(names)) != len(names):
            raise BadRequest(f"pool names repeat: {names}")
        for pool in self.pools:
            pool.layout()
        if not (
            math.isfinite(self.lease_timeout_s)
            and 0 < self.lease_timeout_s <= MAX_LEASE_S
            and 1024 <= self.max_frame_bytes <= MAX_FRAME_BYTES
            and 1 <= self.max_batch <= MAX_BATCH
        ):
            raise BadRequest(
                f"need 0 < lease_timeout_s <= {MAX_LEASE_S} (seconds), "
                f"1024 <= max_frame_bytes <= {MAX_FRAME_BYTES}, 1 <= max_batch <= {MAX_BATCH}; "
                f"got {self.lease_timeout_s}, {self.max_frame_bytes}, {self.max_batch}"
            )


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string like "256MiB", "1.5GiB", "4096"."""
    if isinstance(size, int) and not isinstance(size, bool):
        return size
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(size))
    if match is None or match.group(2).lower() not in _UNITS:
        raise BadRequest(f"not a size: {size!r} (try 256MiB, 2GiB or a byte count)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def load_toml(path: str | Path) -> ServiceConfig:
    try:
        return msgspec.toml.decode(Path(path).read_bytes(), type=ServiceConfig)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BadRequest(f"{path}: {exc}") from None


def parse_pool_spec(spec: str) -> PoolConfig:
    """A PoolConfig from ``"name=a,device=cpu,num_layers=2,size=64MiB"``."""
    fields: dict[str, object] = {}
    for item in filter(None, spec.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise BadRequest(f"--pool: {item!r} is not key=value")
        key = key.strip().replace("-", "_")
        value = value.strip()
        fields[key] = int(value) if re.fullmatch(r"[0-9]+", value) else value
    try:
        return msgspec.convert(fields, PoolConfig)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"--pool {spec!r}: {exc}") from None


def runtime_dir() -> Path:
    """$XDG_RUNTIME_DIR/kvcore, else /tmp/kvcore-$UID; created 0700 on first use."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    path = Path(base) / "kvcore" if base else Path(f"/tmp/kvcore-{os.getuid()}")
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def default_endpoint() -> str:
    """The endpoint ``kvcore serve`` binds and ``Client.connect()`` uses by default
    ($KVCORE_ENDPOINT overrides)."""
    return os.environ.get("KVCORE_ENDPOINT") or f"ipc://{runtime_dir() / SOCKET_NAME}"
