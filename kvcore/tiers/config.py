"""TierConfig: the lower tiers a pool declares (docs/concepts.md, "Tiers").

In TOML, under a pool::

    [[pools]]
    name = "default"
    size = "256MiB"
    [pools.tiers]
    host = "4GiB"                         # daemon-owned host memory (bytes; 0 = none)
    disk = "/var/cache/kvcore/default"    # a directory of this user's alone ("" = none)
    disk_size = "64GiB"                   # bytes the disk tier may use
    remote_master = "10.0.0.1:50051"      # Mooncake master ("" = no remote tier)
    remote_metadata = "http://10.0.0.1:8080/metadata"
    remote_timeout_s = 1.0                # the longest a request waits on the store

As ``--pool`` keys (``kvcore serve --pool ...``): ``host_tier=4GiB``,
``disk_tier=/path``, ``disk_tier_size=64GiB``, ``remote_master=host:port``,
``remote_metadata=http://host:port/metadata``, ``remote_timeout_s=0.5``.
Every tier is off by default; a pool with none is served exactly as before.
Sizes are bytes (an int or "512MiB"); page counts follow from the pool's layout.
"""

from __future__ import annotations

import msgspec

from kvcore.errors import BadRequest

# --pool keys -> TierConfig fields
FLAG_KEYS = {
    "host_tier": "host",
    "disk_tier": "disk",
    "disk_tier_size": "disk_size",
    "remote_master": "remote_master",
    "remote_metadata": "remote_metadata",
    "remote_timeout_s": "remote_timeout_s",
    "remote_local_hostname": "remote_local_hostname",
}


class TierConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The tiers below one pool; all off by default. Sizes in bytes, times in seconds."""

    host: int | str = 0
    disk: str = ""
    disk_size: int | str = "16GiB"
    remote_master: str = ""
    remote_metadata: str = ""
    remote_local_hostname: str = "127.0.0.1"
    remote_timeout_s: float = 1.0

    @property
    def enabled(self) -> bool:
        return bool(self.host_bytes() or self.disk or self.remote_master)

    def host_bytes(self) -> int:
        from kvcore.config import parse_size

        return parse_size(self.host)

    def disk_bytes(self) -> int:
        from kvcore.config import parse_size

        return parse_size(self.disk_size)

    def validate(self, pool: str, page_bytes: int) -> None:
        """BadRequest unless each declared tier holds at least one page of ``page_bytes``."""
        host = self.host_bytes()
        if host < 0 or 0 < host < page_bytes:
            raise BadRequest(f"pool {pool!r}: host tier of {host} bytes holds no page "
                             f"of {page_bytes} bytes")  # fmt: skip
        if self.disk and self.disk_bytes() < page_bytes:
            raise BadRequest(f"pool {pool!r}: disk tier of {self.disk_bytes()} bytes holds "
                             f"no page of {page_bytes} bytes")  # fmt: skip
        if bool(self.remote_master) != bool(self.remote_metadata):
            raise BadRequest(f"pool {pool!r}: a remote tier needs both remote_master "
                             "and remote_metadata")  # fmt: skip
        if not self.remote_timeout_s > 0:
            raise BadRequest(f"pool {pool!r}: remote_timeout_s must be > 0")


def split_flags(fields: dict[str, object]) -> dict[str, object] | None:
    """Move the tier keys of a ``--pool`` spec out of ``fields`` (in place) into the
    fields of a TierConfig; None if there are none."""
    tiers = {FLAG_KEYS[key]: fields.pop(key) for key in list(fields) if key in FLAG_KEYS}
    if "disk" in tiers:
        tiers["disk"] = str(tiers["disk"])
    if "remote_timeout_s" in tiers:
        tiers["remote_timeout_s"] = float(str(tiers["remote_timeout_s"]))
    return tiers or None
