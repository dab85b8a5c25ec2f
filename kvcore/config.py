"""Daemon configuration: pools, endpoints, leases and limits, from TOML, environment and flags.

A TOML file (``kvcore serve --config FILE``) mirrors :class:`ServiceConfig`; each
setting is its field below, whose comment gives its meaning and unit::

    endpoint = "ipc:///run/kvcore/kvcore.sock"
    lease_timeout_s = 10.0

    [[pools]]               # PoolConfig
    name = "default"
    num_layers = 16
    dtype = "bfloat16"
    kind = "kv"
    size = "256MiB"
    eviction = "adaptive-slru"  # or "lru" (kvcore.eviction)

    [pools.tiers]           # TierConfig: the lower tiers below that pool, all off by default
    host = "4GiB"
    disk = "/var/cache/kvcore/default"

    [[tenants]]             # TenantConfig: who may attach to what (docs/security.md)
    name = "alice"
    uids = [1001]

The other sources name the same fields and convert to the same types:

* ``--pool k=v,k=v`` gives one pool. Its keys (:data:`POOL_KEYS`) are PoolConfig's field
  names (``-`` may stand for ``_``: ``num-layers=2``) and TierConfig's flag names: a tier
  field's flag is declared beside it (``host`` is ``host_tier``, ``disk_size``
  ``disk_tier_size``, ``secret_file`` ``tier_secret_file``), else it is the field's name
  (``remote_master``).
* ``KVCORE_<FIELD>`` sets a scalar field of ServiceConfig (``KVCORE_LEASE_TIMEOUT_S=5``),
  ``KVCORE_POOL_<KEY>`` that ``--pool`` key of every configured pool
  (``KVCORE_POOL_SIZE=1GiB``, ``KVCORE_POOL_HOST_TIER=4GiB``), and ``KVCORE_POOLS``
  replaces the pools by ``;``-separated ``--pool`` specs (:func:`apply_env`).

Flags override the environment, which overrides the file. A flag's or variable's text
converts to its field's type one way (:func:`_convert`): ints, floats and bools
(``true``/``false``/``1``/``0``) from their text, strings as given; sizes (``int |
str``: bytes, or "512MiB") stay the text, which :func:`~kvcore.sizes.parse_size` reads.
Invalid configuration raises :class:`~kvcore.errors.BadRequest`, naming the flag or
variable and its value.

This module is the schema alone: it imports neither the tiers (kvcore.tiers)
nor anything that opens a socket. The trust checks of the runtime directory
and of ipc:// socket paths are :mod:`kvcore.paths` (docs/security.md); sizes
are parsed by :mod:`kvcore.sizes`. It is one file over ~400 lines because the
schema is read as one: every setting, its sources, and the checks that hold
between them.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any

import msgspec

from kvcore.errors import BadRequest
from kvcore.eviction import DEFAULT as DEFAULT_EVICTION
from kvcore.eviction import POLICIES as EVICTION_POLICIES
from kvcore.layout import KVLayout
from kvcore.sizes import parse_size

MAX_LEASE_S = 86_400.0  # a day: lease_ms must fit the wire's ints
MAX_FRAME_BYTES = 1 << 31  # ZeroMQ's message-size limit is an int64; 2 GiB is plenty
MAX_BATCH = 1 << 20  # operations
MAX_SHARDS = 64  # regions of one pool (tensor-parallel ranks)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
ENV_PREFIX = "KVCORE_"


def _flag(name: str) -> msgspec.Meta:
    """A TierConfig field's ``--pool`` key (and ``KVCORE_POOL_<KEY>``), where the field's
    own name would not say it is a tier's: read by :func:`_pool_keys`."""
    return msgspec.Meta(extra={"flag": name})


class TierConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The tiers below one pool (docs/concepts.md, "Tiers"); all off by default, and a pool
    with none is served exactly as before. Sizes in bytes (an int or "512MiB"; page counts
    follow from the pool's layout), times in seconds."""

    host: Annotated[int | str, _flag("host_tier")] = 0  # daemon-owned host memory; 0 = none
    # A directory of this user's alone ("" = none), and the bytes it may use.
    disk: Annotated[str, _flag("disk_tier")] = ""
    disk_size: Annotated[int | str, _flag("disk_tier_size")] = "16GiB"
    # A Mooncake store: its master ("host:port"; "" = no remote tier) and metadata server
    # ("http://host:port/metadata"), this node's address to it, and the longest a request
    # waits on the store.
    remote_master: str = ""
    remote_metadata: str = ""
    remote_local_hostname: str = "127.0.0.1"
    remote_timeout_s: float = 1.0
    # The secret the daemons of one deployment share (docs/tiers.md, "Authentication"): a
    # file of this user or root, mode 0600, >= 32 bytes. It MACs every disk and remote
    # entry and names the store's objects; "" = entries only checksummed. A remote tier
    # without one trusts every client of the master, so the daemon refuses it unless
    # ServiceConfig.insecure_remote_tier (--insecure-remote-tier), and then warns.
    secret_file: Annotated[str, _flag("tier_secret_file")] = ""
    # Also accepted on read, during a rotation.
    previous_secret_file: Annotated[str, _flag("tier_previous_secret_file")] = ""
    # Entries also AES-256-GCM encrypted (needs a secret_file).
    encrypt: Annotated[bool, _flag("tier_encrypt")] = False

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
    device: str = "cpu"  # or "cuda:N": allocated on that GPU, shared by CUDA IPC
    num_layers: int = 16
    num_kv_heads: int = 8
    head_dim: int = 64  # elements
    page_size: int = 16  # tokens per page
    dtype: str = "bfloat16"  # kvcore.layout.DTYPE_SIZES: 2- and 4-byte floats, fp8
    kind: str = "kv"  # "kv" (K and V) or "latent" (MLA: num_kv_heads 1, head_dim latent)
    size: int | str = "256MiB"  # bytes (an int or "512MiB"), or give num_pages instead
    num_pages: int | None = None
    shards: int = 1  # regions of the layout (tensor-parallel ranks); cuda: on consecutive GPUs
    # Which evictable page goes first when the pool is full (kvcore.eviction; docs/concepts.md,
    # "Eviction"). Not part of any key or of the wire: it changes what stays, never what a key means.
    eviction: str = DEFAULT_EVICTION
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
    # default. TOML: a [pools.tiers] table; --pool: TierConfig's flags (host_tier=, ...).
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
        if self.eviction not in EVICTION_POLICIES:
            raise BadRequest(
                f"pool {self.name!r}: eviction is one of {', '.join(EVICTION_POLICIES)}, "
                f"not {self.eviction!r}"
            )
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
    """Who may attach to what: peers matched by uid (ipc://) or CURVE key (tcp://). No
    tenants: a single-user daemon, every admitted peer its operator (docs/security.md)."""

    name: str
    uids: list[int] = msgspec.field(default_factory=list)  # ipc:// peers, by the kernel's uid
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
    applied (see the module doc): ``KVCORE_<FIELD>``, then ``KVCORE_POOLS``, then
    ``KVCORE_POOL_<KEY>`` over the pools that leaves. A bad value raises BadRequest
    naming the variable; variables that name no setting are left alone (other parts of
    kvcore read some)."""
    environ = os.environ if environ is None else environ
    changes = {
        f.name: _convert(var, environ[var], f.type)
        for f in msgspec.structs.fields(ServiceConfig)
        if f.name not in ("pools", "tenants") and (var := ENV_PREFIX + f.name.upper()) in environ
    }
    config = msgspec.structs.replace(config, **changes)
    if environ.get(ENV_PREFIX + "POOLS"):
        specs = environ[ENV_PREFIX + "POOLS"].split(";")
        config.pools = [parse_pool_spec(spec, ENV_PREFIX + "POOLS") for spec in specs]
    pool_vars = {key: f"{ENV_PREFIX}POOL_{key.upper()}" for key in POOL_KEYS}
    pool, tiers = _pool_fields(
        {key: environ[var] for key, var in pool_vars.items() if var in environ},
        lambda key: pool_vars[key],
    )
    config.pools = [
        msgspec.structs.replace(p, **pool, tiers=msgspec.structs.replace(p.tiers, **tiers))
        for p in config.pools
    ]
    return config


def _convert(label: str, raw: str, field_type: Any) -> Any:
    """``raw``, the text of the flag or variable ``label``, as ``field_type``: ints, floats
    and bools (true/false/1/0) from their text, strings (and sizes, ``int | str``) as
    given. The one conversion of every flag and variable; BadRequest naming ``label`` and
    ``raw`` if it does not convert."""
    try:
        return msgspec.convert(raw, field_type, strict=False)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"{label}={raw!r}: {exc}") from None


def _pool_keys() -> dict[str, tuple[bool, msgspec.structs.FieldInfo]]:
    """Every ``--pool`` key -> (whether it is a TierConfig field, that field): a PoolConfig
    field's key is its name, a TierConfig field's the flag declared beside it (:func:`_flag`),
    else its name."""
    keys = {f.name: (False, f) for f in msgspec.structs.fields(PoolConfig) if f.name != "tiers"}
    for f in msgspec.structs.fields(TierConfig):
        metas = getattr(f.type, "__metadata__", ())
        flag = next(
            (m.extra["flag"] for m in metas if isinstance(m, msgspec.Meta) and m.extra), f.name
        )
        assert flag not in keys, f"--pool key {flag} names two settings"
        keys[flag] = (True, f)
    return keys


POOL_KEYS = _pool_keys()


def _pool_fields(
    raw: Mapping[str, str], label: Callable[[str], str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The PoolConfig and the TierConfig fields that the ``--pool`` keys of ``raw`` set, each
    value converted to its field's type (:func:`_convert`, naming ``label(key)``)."""
    pool: dict[str, Any] = {}
    tiers: dict[str, Any] = {}
    for key, value in raw.items():
        is_tier, field = POOL_KEYS[key]
        (tiers if is_tier else pool)[field.name] = _convert(label(key), value, field.type)
    return pool, tiers


def parse_pool_spec(spec: str, source: str = "--pool") -> PoolConfig:
    """A PoolConfig from ``"name=a,device=cpu,num_layers=2,size=64MiB,host_tier=1GiB"``
    (the keys of :data:`POOL_KEYS`); BadRequest naming ``source`` (the flag, or the
    variable that held the spec) and the bad item."""
    raw: dict[str, str] = {}
    for item in filter(None, spec.split(",")):
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in POOL_KEYS:
            problem = "unknown key" if sep else "not key=value"
            raise BadRequest(f"{source} {spec!r}: {item!r}: {problem} ({', '.join(POOL_KEYS)})")
        raw[key] = value.strip()
    pool, tiers = _pool_fields(raw, lambda key: f"{source} {key}")
    return PoolConfig(**pool, tiers=TierConfig(**tiers))
