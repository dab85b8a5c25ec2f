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
    tenant_max_pages = 0               # the same over a tenant's sessions (tenant_max_*)
    process_max_sequences = 65536      # and over one client process's (process_max_*)
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
Invalid configuration raises :class:`~kvcore.errors.BadRequest`.

Under a pool, a ``[pools.tiers]`` table declares the lower tiers below it
(:class:`TierConfig`; docs/concepts.md, "Tiers")::

    [pools.tiers]
    host = "4GiB"                         # daemon-owned host memory (bytes; 0 = none)
    disk = "/var/cache/kvcore/default"    # a directory of this user's alone ("" = none)
    disk_size = "64GiB"                   # bytes the disk tier may use
    remote_master = "10.0.0.1:50051"      # Mooncake master ("" = no remote tier)
    remote_metadata = "http://10.0.0.1:8080/metadata"
    remote_timeout_s = 1.0                # the longest a request waits on the store
    secret_file = "/etc/kvcore/tier.secret"  # the deployment's secret (docs/tiers.md)

As ``--pool`` keys: ``host_tier=4GiB``, ``disk_tier=/path``,
``disk_tier_size=64GiB``, ``remote_master=host:port``,
``remote_metadata=http://host:port/metadata``, ``remote_timeout_s=0.5``,
``tier_secret_file=/path`` (:data:`TIER_FLAG_KEYS`). A remote tier without a
secret is refused unless ``insecure_remote_tier`` (``--insecure-remote-tier``):
any client of the master could plant the K/V it serves. Every tier is off by
default; a pool with none is served exactly as before. Sizes are bytes (an int
or "512MiB"); page counts follow from the pool's layout.

This module is the schema alone: it imports neither the tiers (kvcore.tiers)
nor anything that opens a socket. The trust checks of the runtime directory
and of ipc:// socket paths are :mod:`kvcore.paths` (docs/security.md); sizes
are parsed by :mod:`kvcore.sizes`. It is one file over ~400 lines because the
schema is read as one: every setting of the TOML file, its flag and its
``KVCORE_*`` variable, and the checks that hold between them.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from pathlib import Path

import msgspec

from kvcore.errors import BadRequest
from kvcore.layout import KVLayout
from kvcore.sizes import parse_size

MAX_LEASE_S = 86_400.0  # a day: lease_ms must fit the wire's ints
MAX_FRAME_BYTES = 1 << 31  # ZeroMQ's message-size limit is an int64; 2 GiB is plenty
MAX_BATCH = 1 << 20  # operations
MAX_SHARDS = 64  # regions of one pool (tensor-parallel ranks)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
ENV_PREFIX = "KVCORE_"

# --pool keys -> TierConfig fields
TIER_FLAG_KEYS = {
    "host_tier": "host",
    "disk_tier": "disk",
    "disk_tier_size": "disk_size",
    "remote_master": "remote_master",
    "remote_metadata": "remote_metadata",
    "remote_timeout_s": "remote_timeout_s",
    "remote_local_hostname": "remote_local_hostname",
    "tier_secret_file": "secret_file",
    "tier_previous_secret_file": "previous_secret_file",
    "tier_encrypt": "encrypt",
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
    # The secret the daemons of one deployment share (docs/tiers.md, "Authentication"): a
    # file of this user or root, mode 0600, >= 32 bytes. It MACs every disk and remote
    # entry and names the store's objects; "" = entries only checksummed. A remote tier
    # without one trusts every client of the master, so the daemon refuses it unless
    # ServiceConfig.insecure_remote_tier (--insecure-remote-tier), and then warns.
    secret_file: str = ""
    previous_secret_file: str = ""  # also accepted on read, during a rotation
    encrypt: bool = False  # entries also AES-256-GCM encrypted (needs a secret_file)

    @property
    def enabled(self) -> bool:
        return bool(self.host_bytes() or self.disk or self.remote_master)

    def host_bytes(self) -> int:
        return parse_size(self.host)

    def disk_bytes(self) -> int:
        return parse_size(self.disk_size)

    def validate(self, pool: str, page_bytes: int) -> None:
        """BadRequest unless each declared tier holds at least one page of ``page_bytes``."""
        host = self.host_bytes()
        if host < 0 or 0 < host < page_bytes:
            raise BadRequest(
                f"pool {pool!r}: host tier of {host} bytes holds no page of {page_bytes} bytes"
            )
        if self.disk and self.disk_bytes() < page_bytes:
            raise BadRequest(
                f"pool {pool!r}: disk tier of {self.disk_bytes()} bytes holds "
                f"no page of {page_bytes} bytes"
            )
        if bool(self.remote_master) != bool(self.remote_metadata):
            raise BadRequest(
                f"pool {pool!r}: a remote tier needs both remote_master and remote_metadata"
            )
        if not self.remote_timeout_s > 0:
            raise BadRequest(f"pool {pool!r}: remote_timeout_s must be > 0")
        if (self.previous_secret_file or self.encrypt) and not self.secret_file:
            raise BadRequest(f"pool {pool!r}: previous_secret_file and encrypt need a secret_file")


class PoolConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One pool. Its page count is ``num_pages`` if given, else as many pages as ``size`` holds
    in all its shards together.

    ``shards`` > 1 serves tensor parallelism: the layout (``num_kv_heads`` = heads of one
    rank) describes one shard, the daemon allocates ``shards`` regions of it and one
    Manager, so page p is page p of every shard and one prefix index serves all ranks."""

    name: str = "default"
    device: str = "cpu"
    num_layers: int = 16
    num_kv_heads: int = 8
    head_dim: int = 64
    page_size: int = 16
    dtype: str = "bfloat16"  # kvcore.layout.DTYPE_SIZES: 2- and 4-byte floats, fp8
    kind: str = "kv"  # "kv" (K and V) or "latent" (MLA: num_kv_heads 1, head_dim latent)
    size: int | str = "256MiB"
    num_pages: int | None = None
    shards: int = 1  # regions of the layout (tensor-parallel ranks); cuda: on consecutive GPUs
    # Quotas, 0 = none. Pages count page references: a page shared by n of the
    # session's sequences (forks) counts n times, so the quota bounds daemon memory too.
    session_max_pages: int = 0
    session_max_sequences: int = 65536
    namespace_max_pages: int = 0
    namespace_max_sequences: int = 0
    # The same for all the sessions of a named tenant, and of one ipc:// client process
    # (the kernel's pid): re-attaching gives no more. A process's sequences default to
    # session_max_sequences, at least 65,536 (0 = none; unbounded if sessions are).
    tenant_max_pages: int = 0
    tenant_max_sequences: int = 0
    process_max_pages: int = 0
    process_max_sequences: int | None = None
    # A host pool's segment is the daemon user's alone (0600); with a group (name or gid)
    # it is 0660 of that group, so tenants of other uids in it can map the pool.
    group: str = ""
    # Lower tiers below the pool (host memory, a disk directory, a Mooncake store); off by
    # default. TOML: a [pools.tiers] table; --pool: host_tier=, disk_tier=, ... (TierConfig).
    tiers: TierConfig = msgspec.field(default_factory=TierConfig)

    def validate(self) -> None:
        """BadRequest unless the layout is valid, ``shards`` is 1 to MAX_SHARDS and every
        quota is a count >= 0."""
        if not 1 <= self.shards <= MAX_SHARDS:
            raise BadRequest(
                f"pool {self.name!r}: shards is 1 to {MAX_SHARDS} (one a tensor-parallel "
                f"rank), not {self.shards}"
            )
        if self.shards > 1 and self.tiers.enabled:
            raise BadRequest(
                f"pool {self.name!r}: lower tiers copy one region; a pool of {self.shards} "
                "shards has none yet (drop shards or the tiers)"
            )
        self.layout()
        quotas = (
            self.session_max_pages,
            self.session_max_sequences,
            self.namespace_max_pages,
            self.namespace_max_sequences,
            self.tenant_max_pages,
            self.tenant_max_sequences,
            self.process_max_pages,
            self.process_max_sequences or 0,
        )
        if min(quotas) < 0:
            raise BadRequest(f"pool {self.name!r}: quotas are counts >= 0 (0 = none)")

    def total_bytes(self) -> int:
        """Bytes of all the pool's shards (what its memory costs)."""
        return self.layout().total_bytes * self.shards

    def layout(self) -> KVLayout:
        """The layout of one shard (each of the ``shards`` regions has it)."""
        if self.device != "cpu" and not re.fullmatch(r"cuda:\d+", self.device):
            raise BadRequest(f"pool {self.name!r}: device must be 'cpu' or 'cuda:N'")
        if self.num_pages is not None:
            return KVLayout(
                self.num_layers,
                self.num_kv_heads,
                self.head_dim,
                self.page_size,
                self.dtype,
                self.num_pages,
                self.kind,
            )
        return KVLayout.for_budget(
            parse_size(self.size) // max(self.shards, 1),
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            page_size=self.page_size,
            dtype=self.dtype,
            kind=self.kind,
        )


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
    # until the process exits, the client acknowledges, or this many seconds pass, whether
    # or not the process can be watched.
    fence_timeout_s: float = 300.0
    max_frame_bytes: int = 8 << 20
    max_batch: int = 4096
    max_request_tokens: int = 1 << 20  # tokens one request may carry, summed over a batch
    max_sessions: int = 1024
    # Sessions one ipc:// client process may hold; None: min(64, max_sessions_per_tenant).
    max_sessions_per_process: int | None = None
    # Sessions one [[tenants]] entry may hold; None: max_sessions less an eighth of it.
    max_sessions_per_tenant: int | None = None
    max_queued_bytes: int = 64 << 20  # bytes queued per connection before ZeroMQ pushes back
    events_buffer_bytes: int = 16 << 20  # bytes buffered per event subscriber, then dropped
    insecure: bool = False  # allow tcp:// without CURVE
    insecure_remote_tier: bool = False  # allow a remote tier without a tier secret_file
    curve_secret_key_file: str = ""  # z85 secret key (40 chars) or a `kvcore keys` secret file
    authorized_keys_dir: str = ""  # tcp://: only clients whose public key is here may connect
    socket_mode: int = 0o600  # of ipc:// sockets; 0o660/0o666 only with [[tenants]]
    allow_ephemeral: bool = False  # attach may create private pools (tests, development)
    metrics_port: int | None = None  # HTTP port of /metrics and /health; None = off, 0 = any free
    metrics_addr: str = "127.0.0.1"  # the address it binds (loopback unless told otherwise)
    metrics_socket: str = ""  # serve metrics on this unix socket (0600) instead of a port
    metrics_token_file: str = ""  # a bearer token (mode 0600 file) every scrape must send
    metrics_namespace_labels: bool = True  # False: no per-namespace series (names stay private)
    log_level: str = "INFO"  # DEBUG, INFO, WARNING or ERROR
    log_format: str = "text"  # "text" or "json" (one object per line, for log shippers)
    pools: list[PoolConfig] = msgspec.field(default_factory=lambda: [PoolConfig()])
    tenants: list[TenantConfig] = msgspec.field(default_factory=list)

    def _validate_tenants(self) -> None:
        """Each tenant is named, once, and each uid and key belongs to one tenant: a
        credential in two entries would get whichever grant was read last."""
        names: set[str] = set()
        owner: dict[int | str, str] = {}
        for tenant in self.tenants:
            if not tenant.name or tenant.name in names:
                raise BadRequest(f"tenant names must be non-empty and unique: {tenant.name!r}")
            names.add(tenant.name)
            if any(len(key) != 40 for key in tenant.keys):
                raise BadRequest(f"tenant {tenant.name!r}: keys are z85 public keys (40 chars)")
            credentials: list[int | str] = [*tenant.uids, *tenant.keys]
            for credential in credentials:
                if credential in owner:
                    raise BadRequest(
                        f"tenants {owner[credential]!r} and {tenant.name!r} both name "
                        f"{'uid' if isinstance(credential, int) else 'key'} {credential}: "
                        "a credential belongs to one tenant"
                    )
                owner[credential] = tenant.name

    def _validate_event_sockets(self) -> None:
        """Event sockets keep the request socket's rule: tcp:// is encrypted (CURVE) or
        explicitly ``insecure``. Stored events carry token ids, and the replay socket hands
        out every buffered batch: a plain tcp:// one shows any local user (or, off
        loopback, anyone) every tenant's prompts. vLLM's subscribers speak no CURVE, so
        the vllm format is plain on tcp:// and needs ``insecure`` even beside a CURVE key."""
        if self.events_replay and self.events_format != "vllm":
            raise BadRequest("events_replay serves the vllm events format only")
        curve = bool(self.curve_secret_key_file) and self.events_format == "kvcore"
        for name, endpoint in (("events", self.events), ("events_replay", self.events_replay)):
            if endpoint.startswith("tcp://") and not (curve or self.insecure):
                raise BadRequest(
                    f"{name} {endpoint}: a plain tcp:// event socket shows every tenant's "
                    "token ids to anyone who reaches it; use ipc:// (or --events auto), "
                    + ("CURVE (--curve-secret-key-file), " if name == "events" else "")
                    + "or --insecure"
                )

    def _validate_remote_tiers(self) -> None:
        """A remote tier needs the deployment's secret (``secret_file``) unless the operator
        opts out with ``insecure_remote_tier``: Mooncake authenticates no one, so without
        the secret any client of the master can plant or replace K/V that every daemon of
        the store then serves as prefix hits (docs/security.md, "Lower tiers").

        An opt-out of its own, not ``insecure``: that one lets peers reach the daemon's own
        tcp:// sockets (and vLLM's plain event sockets need it even beside CURVE), a
        separate decision that must not also open every pool to a store's peers. One flag
        for the daemon, as ``insecure`` is: the master is the deployment's, whichever
        pools use it."""
        if self.insecure_remote_tier:
            return
        for pool in self.pools:
            tiers = pool.tiers
            if tiers.remote_master and not tiers.secret_file:
                raise BadRequest(
                    f"pool {pool.name!r}: a remote tier without a secret serves K/V that any "
                    f"client of the Mooncake master {tiers.remote_master} can forge or "
                    "replace; give the deployment's secret (tier_secret_file= in --pool, "
                    "secret_file in [pools.tiers]; docs/tiers.md), or opt out with "
                    "--insecure-remote-tier"
                )

    def validate(self) -> None:
        if not self.pools:
            raise BadRequest("no pools configured")
        if self.events_format not in ("kvcore", "vllm"):
            raise BadRequest(f"events_format is 'kvcore' or 'vllm', not {self.events_format!r}")
        if self.log_format not in ("text", "json") or self.log_level not in LOG_LEVELS:
            raise BadRequest(
                f"log_format is 'text' or 'json' and log_level one of {LOG_LEVELS}; "
                f"got {self.log_format!r}, {self.log_level!r}"
            )
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise BadRequest(
                f"metrics_port is a TCP port (0: any free one), not {self.metrics_port}"
            )
        if self.metrics_port is not None and self.metrics_socket:
            raise BadRequest("metrics_port and metrics_socket: choose one")
        self._validate_event_sockets()
        names = [pool.name for pool in self.pools]
        if len(set(names)) != len(names):
            raise BadRequest(f"pool names repeat: {names}")
        for pool in self.pools:
            pool.validate()
        self._validate_remote_tiers()
        if self.socket_mode & ~0o666 or (self.socket_mode & 0o066 and not self.tenants):
            raise BadRequest("socket_mode: at most 0o666, and wider than 0o600 only with tenants")
        self._validate_tenants()
        for bound in (self.max_sessions_per_process, self.max_sessions_per_tenant):
            if bound is not None and not 1 <= bound <= self.max_sessions:
                raise BadRequest(
                    "max_sessions_per_process and max_sessions_per_tenant are session "
                    f"counts from 1 to max_sessions ({self.max_sessions}), not {bound}"
                )
        limits = (
            self.max_request_tokens,
            self.max_sessions,
            self.max_queued_bytes,
            self.events_buffer_bytes,
        )
        if min(limits) < 1 or not (
            math.isfinite(self.fence_timeout_s) and self.fence_timeout_s > 0
        ):
            raise BadRequest(
                "max_request_tokens, max_sessions, max_queued_bytes, "
                "events_buffer_bytes and fence_timeout_s must be positive"
            )
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
    scalar = {
        f.name: f.type
        for f in msgspec.structs.fields(ServiceConfig)
        if f.name not in ("pools", "tenants")
    }
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
    tiers = split_tier_flags(fields)
    if tiers is not None:
        fields["tiers"] = tiers
    try:
        return msgspec.convert(fields, PoolConfig)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"--pool {spec!r}: {exc}") from None


def split_tier_flags(fields: dict[str, object]) -> dict[str, object] | None:
    """Move the tier keys of a ``--pool`` spec out of ``fields`` (in place) into the
    fields of a TierConfig; None if there are none."""
    tiers = {TIER_FLAG_KEYS[key]: fields.pop(key) for key in list(fields) if key in TIER_FLAG_KEYS}
    if "disk" in tiers:
        tiers["disk"] = str(tiers["disk"])
    if "remote_timeout_s" in tiers:
        tiers["remote_timeout_s"] = float(str(tiers["remote_timeout_s"]))
    for key in ("secret_file", "previous_secret_file"):
        if key in tiers:
            tiers[key] = str(tiers[key])
    if "encrypt" in tiers:
        flag = str(tiers["encrypt"]).lower()
        if flag not in ("true", "1", "false", "0"):
            raise BadRequest(f"tier_encrypt is true or false, not {tiers['encrypt']!r}")
        tiers["encrypt"] = flag in ("true", "1")
    return tiers or None
