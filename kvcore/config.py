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
    session_max_pages = 0   # quotas (0 = none): page references a session's sequences hold,
    session_max_sequences = 65536      # live sequences per session,
    namespace_max_pages = 0            # and the same summed over a namespace's sessions
    namespace_max_sequences = 0
    group = ""              # host pools: a group whose members (tenants) may map it

    [[tenants]]             # who may attach to what (docs/security.md); none: single user
    name = "alice"
    uids = [1001]           # ipc:// peers by the uid the kernel reports
    keys = ["<z85 public key>"]        # tcp:// peers by CURVE key
    namespaces = ["alice"]  # the namespaces its sessions may use ("*": any)
    pools = []              # the pools it may attach to ([]: every pool)

``KVCORE_<FIELD>`` environment variables override the file for every scalar field
(``KVCORE_LEASE_TIMEOUT_S=5``, ``KVCORE_EVENTS=auto``), ``KVCORE_POOL_<FIELD>``
sets a field of every configured pool (``KVCORE_POOL_SIZE=1GiB``) and
``KVCORE_POOLS`` replaces the pools by ``;``-separated ``--pool`` specs
(:func:`apply_env`). Flags override both; ``--pool`` takes the same keys as
``k=v,k=v``.
Invalid configuration raises :class:`~kvcore.errors.BadRequest`. Paths of
the runtime directory and of ipc:// sockets are checked by
:func:`check_runtime_dir` and :func:`check_socket_path` (docs/security.md).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path

import msgspec

from kvcore.errors import BadRequest, Timeout, UntrustedEndpoint
from kvcore.layout import KVLayout
from kvcore.tiers.config import TierConfig, split_flags

SOCKET_NAME = "kvcore.sock"
MAX_LEASE_S = 86_400.0  # a day: lease_ms must fit the wire's ints
MAX_FRAME_BYTES = 1 << 31  # ZeroMQ's message-size limit is an int64; 2 GiB is plenty
MAX_BATCH = 1 << 20  # operations
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
ENV_PREFIX = "KVCORE_"
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
    # Quotas, 0 = none. Pages count page references: a page shared by n of the
    # session's sequences (forks) counts n times, so the quota bounds daemon memory too.
    session_max_pages: int = 0
    session_max_sequences: int = 65536
    namespace_max_pages: int = 0
    namespace_max_sequences: int = 0
    # A host pool's segment is the daemon user's alone (0600); with a group (name or gid)
    # it is 0660 of that group, so tenants of other uids in it can map the pool.
    group: str = ""
    # Lower tiers below the pool (host memory, a disk directory, a Mooncake store); off by
    # default. TOML: a [pools.tiers] table; --pool: host_tier=, disk_tier=, ... (tiers/config.py).
    tiers: TierConfig = msgspec.field(default_factory=TierConfig)

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


class TenantConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Who may attach to what: peers matched by uid (ipc://) or CURVE key (tcp://)."""

    name: str
    uids: list[int] = msgspec.field(default_factory=list)
    keys: list[str] = msgspec.field(default_factory=list)  # z85 CURVE public keys (40 chars)
    namespaces: list[str] = msgspec.field(default_factory=lambda: ["*"])  # "*": any
    pools: list[str] = msgspec.field(default_factory=list)  # []: every pool


class ServiceConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    endpoint: str = ""  # "" = default_endpoint()
    events: str = ""  # "" = no event stream; "auto" = an ipc socket next to the endpoint
    events_format: str = "kvcore"  # "kvcore" (spec/protocol.md) or "vllm" (spec/vllm-events.md)
    events_replay: str = ""  # vllm format: ROUTER endpoint replaying buffered batches; "" = off
    lease_timeout_s: float = 10.0
    # A session that expired while its process lives is fenced (its pages kept, not reused)
    # until the process exits or the client acknowledges; a peer whose process the daemon
    # cannot watch (tcp://) is released after this many seconds instead.
    fence_timeout_s: float = 300.0
    max_frame_bytes: int = 8 << 20
    max_batch: int = 4096
    max_request_tokens: int = 1 << 20  # tokens one request may carry, summed over a batch
    max_sessions: int = 1024
    max_queued_bytes: int = 64 << 20  # bytes queued per connection before ZeroMQ pushes back
    events_buffer_bytes: int = 16 << 20  # bytes buffered per event subscriber, then dropped
    insecure: bool = False  # allow tcp:// without CURVE
    curve_secret_key_file: str = ""  # z85 secret key (40 chars) or a `kvcore keys` secret file
    authorized_keys_dir: str = ""  # tcp://: only clients whose public key is here may connect
    socket_mode: int = 0o600  # of ipc:// sockets; 0o660/0o666 only with [[tenants]]
    allow_ephemeral: bool = False  # attach may create private pools (tests, development)
    metrics_port: int | None = None  # HTTP port of /metrics and /health; None = off, 0 = any free
    metrics_addr: str = "127.0.0.1"  # the address it binds (loopback unless told otherwise)
    log_level: str = "INFO"  # DEBUG, INFO, WARNING or ERROR
    log_format: str = "text"  # "text" or "json" (one object per line, for log shippers)
    pools: list[PoolConfig] = msgspec.field(default_factory=lambda: [PoolConfig()])
    tenants: list[TenantConfig] = msgspec.field(default_factory=list)

    def validate(self) -> None:
        if not self.pools:
            raise BadRequest("no pools configured")
        if self.events_format not in ("kvcore", "vllm"):
            raise BadRequest(f"events_format is 'kvcore' or 'vllm', not {self.events_format!r}")
        if self.log_format not in ("text", "json") or self.log_level not in LOG_LEVELS:
            raise BadRequest(f"log_format is 'text' or 'json' and log_level one of {LOG_LEVELS}; "
                             f"got {self.log_format!r}, {self.log_level!r}")  # fmt: skip
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise BadRequest(
                f"metrics_port is a TCP port (0: any free one), not {self.metrics_port}"
            )
        if self.events_replay and self.events_format != "vllm":
            raise BadRequest("events_replay serves the vllm events format only")
        names = [pool.name for pool in self.pools]
        if len(set(names)) != len(names):
            raise BadRequest(f"pool names repeat: {names}")
        for pool in self.pools:
            pool.layout()
            quotas = (pool.session_max_pages, pool.session_max_sequences,
                      pool.namespace_max_pages, pool.namespace_max_sequences)  # fmt: skip
            if min(quotas) < 0:
                raise BadRequest(f"pool {pool.name!r}: quotas are counts >= 0 (0 = none)")
        if self.socket_mode & ~0o666 or (self.socket_mode & 0o066 and not self.tenants):
            raise BadRequest("socket_mode: at most 0o666, and wider than 0o600 only with tenants")
        for tenant in self.tenants:
            if any(len(key) != 40 for key in tenant.keys):
                raise BadRequest(f"tenant {tenant.name!r}: keys are z85 public keys (40 chars)")
        limits = (self.max_request_tokens, self.max_sessions, self.max_queued_bytes,
                  self.events_buffer_bytes)  # fmt: skip
        if min(limits) < 1 or not (
            math.isfinite(self.fence_timeout_s) and self.fence_timeout_s > 0
        ):
            raise BadRequest("max_request_tokens, max_sessions, max_queued_bytes, "
                             "events_buffer_bytes and fence_timeout_s must be positive")  # fmt: skip
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


def apply_env(config: ServiceConfig, environ: Mapping[str, str] | None = None) -> ServiceConfig:
    """``config`` with the ``KVCORE_*`` variables of ``environ`` (default: os.environ)
    applied (see the module doc). Values are converted to the field's type (``1``,
    ``true``, ``2.5``); a bad value raises BadRequest naming the variable. Variables
    that name no field are left alone (other parts of kvcore read some)."""
    environ = os.environ if environ is None else environ
    scalar = {f.name: f.type for f in msgspec.structs.fields(ServiceConfig)
              if f.name not in ("pools", "tenants")}  # fmt: skip
    changes: dict[str, object] = {}
    for field_name, field_type in scalar.items():
        var = ENV_PREFIX + field_name.upper()
        if var in environ:
            changes[field_name] = _env_value(var, environ[var], field_type)
    config = msgspec.structs.replace(config, **changes)
    if environ.get(ENV_PREFIX + "POOLS"):
        config.pools = [parse_pool_spec(spec) for spec in environ[ENV_PREFIX + "POOLS"].split(";")]
    for f in msgspec.structs.fields(PoolConfig):
        var = f"{ENV_PREFIX}POOL_{f.name.upper()}"
        if var in environ and f.name != "tiers":  # tiers: a table, in TOML or --pool
            value = _env_value(var, environ[var], f.type)
            config.pools = [msgspec.structs.replace(p, **{f.name: value}) for p in config.pools]
    return config


def _env_value(var: str, raw: str, field_type: object) -> object:
    try:
        return msgspec.convert(raw, field_type, strict=False)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"{var}={raw!r}: {exc}") from None


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
    tiers = split_flags(fields)
    if tiers is not None:
        fields["tiers"] = tiers
    try:
        return msgspec.convert(fields, PoolConfig)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"--pool {spec!r}: {exc}") from None


def runtime_dir() -> Path:
    """$XDG_RUNTIME_DIR/kvcore, else /tmp/kvcore-$UID; created 0700 on first use, and
    refused (UntrustedEndpoint) unless it is a real directory of this user, mode 0700."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    path = Path(base) / "kvcore" if base else Path(f"/tmp/kvcore-{os.getuid()}")
    if base:
        Path(base).mkdir(mode=0o700, parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)  # never through a symlink: mkdir does not follow one
    check_runtime_dir(path)
    return path


def check_runtime_dir(path: Path) -> None:
    """UntrustedEndpoint unless ``path`` is a directory (not a symlink) owned by this user
    with mode 0700: anyone else who could write there could swap the daemon's socket."""
    st = os.lstat(path)
    why = _untrusted(st, {os.getuid()})
    if why is None and not stat.S_ISDIR(st.st_mode):
        why = "is not a directory"
    if why is None and stat.S_IMODE(st.st_mode) != 0o700:
        why = f"has mode {stat.S_IMODE(st.st_mode):04o}, not 0700"
    if why is not None:
        raise UntrustedEndpoint(
            f"runtime directory {path} {why}: another user may have made it. Remove it "
            f"(as its owner or root) or choose another place (XDG_RUNTIME_DIR, --endpoint)"
        )


def check_socket_path(path: str, trusted_uids: set[int], *, creating: bool) -> None:
    """UntrustedEndpoint unless an ipc:// socket path can only be a trusted daemon's: its
    directory belongs to a trusted uid or root and nobody else can write there (or it is
    sticky, like /tmp), and the file, if it exists, is a socket (not a symlink) of a
    trusted uid. A client (not ``creating``) also needs the socket to exist already in a
    directory others can write. The daemon trusts its own uid; a client also root."""
    parent = os.path.dirname(os.path.abspath(path))
    try:
        pst = os.stat(parent)
    except FileNotFoundError:
        if not creating:  # a client: no daemon ever bound there
            raise Timeout(f"no daemon answers on ipc://{path} (its directory {parent} does "
                          f"not exist) — start one with `kvcore serve`") from None  # fmt: skip
        raise BadRequest(f"socket directory {parent} does not exist: create it (yours, mode "
                         f"0700) or choose another endpoint") from None  # fmt: skip
    shared = bool(pst.st_mode & 0o022)
    why = _untrusted(pst, trusted_uids | {0})
    if why is None and shared and not pst.st_mode & stat.S_ISVTX:
        why = f"is writable by others (mode {stat.S_IMODE(pst.st_mode):04o})"
    if why is not None:
        raise UntrustedEndpoint(f"socket directory {parent} {why}: use a directory only "
                                f"you (or root) can write")  # fmt: skip
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if shared and not creating:
            raise UntrustedEndpoint(f"no socket at {path} yet, and others may create one "
                                    f"there: start the daemon first") from None  # fmt: skip
        return
    why = _untrusted(st, trusted_uids)
    if why is None and not stat.S_ISSOCK(st.st_mode):
        why = "is not a socket"
    if why is not None:
        raise UntrustedEndpoint(f"{path} {why}: not a daemon you trust; remove it (as its "
                                f"owner or root), or trust its owner (trusted_uids)")  # fmt: skip


def _untrusted(st: os.stat_result, uids: set[int]) -> str | None:
    if stat.S_ISLNK(st.st_mode):
        return "is a symlink"
    if st.st_uid not in uids:
        return f"is owned by uid {st.st_uid}"
    return None


def default_endpoint() -> str:
    """The endpoint ``kvcore serve`` binds and ``Client.connect()`` uses by default
    ($KVCORE_ENDPOINT overrides)."""
    return os.environ.get("KVCORE_ENDPOINT") or f"ipc://{runtime_dir() / SOCKET_NAME}"
