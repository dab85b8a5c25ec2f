"""Daemon configuration: pools, endpoints, leases and limits, from TOML, environment and flags.

A TOML file (``kvcore serve --config FILE``) mirrors :class:`ServiceConfig`; each
setting is its field below, declared once: a scalar setting of ServiceConfig with its
help text and ``--help`` group (:func:`_setting`), the others with a comment giving
their meaning and unit::

    endpoint = "ipc:///run/kvcore/kvcore.sock"
    lease_timeout_s = 10.0

    [[pools]]               # PoolConfig
    name = "default"
    num_layers = 16
    dtype = "bfloat16"
    kind = "kv"
    order = "LPKTH"         # physical order (kvcore.layout): "PLKTH" is page-major
    size = "256MiB"
    eviction = "adaptive-slru"  # or "lru" (kvcore.eviction)

    [pools.tiers]           # TierConfig: the lower tiers below that pool, all off by default
    host = "4GiB"
    disk = "/var/cache/kvcore/default"

    [[tenants]]             # TenantConfig: who may attach to what (docs/security.md)
    name = "alice"
    uids = [1001]

The other sources name the same fields and convert to the same types:

* ``--field-name`` sets a scalar field of ServiceConfig: its flag is derived from the
  field (:data:`SETTINGS`, by :mod:`kvcore.daemon.flags`): ``--`` and the name with ``-``
  for ``_`` (``--lease-timeout-s``), and the earlier spellings the field declares as
  aliases (``--lease-timeout``). A switch off by default is a flag that turns it on
  (``--insecure``); one on by default has a ``--no-`` form too. A new setting is one
  field: its flag, variable and TOML key follow.
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
A setting whose text msgspec would misread declares its own :class:`TextForm`:
``socket_mode`` reads "0660", "0o660" and "660" alike, as octal. Invalid configuration
raises :class:`~kvcore.errors.BadRequest`, naming the flag or variable and its value.

This module is the schema alone: it imports neither the tiers (kvcore.tiers)
nor anything that opens a socket. The trust checks of the runtime directory
and of ipc:// socket paths are :mod:`kvcore.paths` (docs/security.md); sizes
are parsed by :mod:`kvcore.sizes`; the flags are built by :mod:`kvcore.daemon.flags`.
It is one long file because the schema is read as one: every setting, its help, its
sources, and the checks that hold between them.
"""

from __future__ import annotations

import enum
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, NamedTuple

import msgspec

from kvcore.errors import BadRequest
from kvcore.eviction import DEFAULT as DEFAULT_EVICTION
from kvcore.eviction import POLICIES as EVICTION_POLICIES
from kvcore.layout import DEFAULT_ORDER, KVLayout
from kvcore.sizes import parse_size

MAX_LEASE_S = 86_400.0  # a day: lease_ms must fit the wire's ints
MAX_FRAME_BYTES = 1 << 31  # ZeroMQ's message-size limit is an int64; 2 GiB is plenty
MAX_BATCH = 1 << 20  # operations
MAX_SHARDS = 64  # regions of one pool (pipeline stages)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMATS = ("text", "json")  # json: one object per line, for log shippers
EVENTS_FORMATS = ("kvcore", "vllm")  # spec/protocol.md, spec/vllm-events.md
ENV_PREFIX = "KVCORE_"


def _flag(name: str) -> msgspec.Meta:
    """A TierConfig field's ``--pool`` key (and ``KVCORE_POOL_<KEY>``), where the field's
    own name would not say it is a tier's: read by :func:`_pool_keys`."""
    return msgspec.Meta(extra={"flag": name})


class Group(enum.Enum):
    """Where ``kvcore serve --help`` lists a setting's flag: under the group's name (in
    lower case) and what it holds (the value); the groups are listed in this order."""

    WHERE = "the configuration, the endpoint, the pools, the event stream"
    LIMITS = "leases, and the bounds on frames, batches, sessions and queues"
    ACCESS = "who may connect, and what they may do"
    OBSERVING = "metrics and logs"


class TextForm(NamedTuple):
    """How a setting's value reads from and shows as text, where msgspec's conversion
    would misread it (a file mode's "0660" is octal)."""

    parse: Callable[[str], Any]  # ValueError, saying what the text should be, if not one
    show: Callable[[Any], str]


def _octal_mode(text: str) -> int:
    """A file mode, octal however written: "0660", "0o660" and "660" are all 0o660."""
    if not re.fullmatch(r"(0[oO])?[0-7]{1,4}", text):
        raise ValueError("not an octal file mode such as 0660")
    return int(text, 8)


OCTAL_MODE = TextForm(_octal_mode, lambda mode: f"{mode:04o}")


@dataclass(frozen=True, slots=True)
class FlagSpec:
    """What a ServiceConfig setting's flag needs beyond the field's name, type, default and
    help (:func:`_setting`); ``kvcore.daemon.flags`` builds the flag from it."""

    group: Group
    aliases: tuple[str, ...] = ()  # earlier spellings of the flag, still accepted
    choices: tuple[str, ...] = ()  # the values validate() allows; () = any
    metavar: str | None = None  # None: from the field's unit suffix, else its name
    text: TextForm | None = None  # None: msgspec converts the text (:func:`_convert`)


def _setting(
    group: Group,
    help_text: str,
    *,
    aliases: tuple[str, ...] = (),
    choices: tuple[str, ...] = (),
    metavar: str | None = None,
    text: TextForm | None = None,
) -> msgspec.Meta:
    """A scalar ServiceConfig setting's declaration, beside its type and default: its help
    (``--help`` adds the default unless ``help_text`` says it) and its :class:`FlagSpec`."""
    spec = FlagSpec(group, aliases, choices, metavar, text)
    return msgspec.Meta(description=help_text, extra={"setting": spec})


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

    ``shards`` > 1 serves pipeline parallelism: the layout (``num_layers`` = layers of one
    stage; ``num_kv_heads`` every KV head, whatever the tensor-parallel size, each TP rank
    copying its own) describes one shard, the daemon allocates ``shards`` regions of it and
    one Manager, so page p is page p of every shard and one prefix index serves all ranks."""

    name: str = "default"
    device: str = "cpu"  # or "cuda:N": allocated on that GPU, shared by CUDA IPC
    num_layers: int = 16
    num_kv_heads: int = 8
    head_dim: int = 64  # elements
    page_size: int = 16  # tokens per page
    dtype: str = "bfloat16"  # kvcore.layout.DTYPE_SIZES: 2- and 4-byte floats, fp8
    kind: str = "kv"  # "kv" (K and V) or "latent" (MLA: num_kv_heads 1, head_dim latent)
    # Physical order of the axes layer, page, part, token, head, outermost first
    # (kvcore.layout; docs/concepts.md, "Physical order"): "PLKTH" keeps a page in one run.
    order: str = DEFAULT_ORDER
    size: int | str = "256MiB"  # bytes (an int or "512MiB"), or give num_pages instead
    num_pages: int | None = None
    shards: int = 1  # regions of the layout (pipeline stages); cuda: on consecutive GPUs
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
                f"pool {self.name!r}: shards is 1 to {MAX_SHARDS} (one a pipeline stage), "
                f"not {self.shards}"
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
                self.order,
            )
        return KVLayout.for_budget(
            parse_size(self.size) // max(self.shards, 1),
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            page_size=self.page_size,
            dtype=self.dtype,
            kind=self.kind,
            order=self.order,
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
    """The daemon's settings. Each scalar one is declared here once, with its help and its
    group in ``--help`` (:func:`_setting`); its TOML key, ``KVCORE_<NAME>`` variable and
    ``--name`` flag derive from the field (:data:`SETTINGS`). Sizes in bytes, times in
    seconds; a default of "" or None means what the help says (off, none, a bound
    computed from others)."""

    endpoint: Annotated[
        str,
        _setting(
            Group.WHERE,
            "the ipc:// or tcp:// endpoint of requests "
            "(default: ipc://$XDG_RUNTIME_DIR/kvcore/kvcore.sock)",
            metavar="ENDPOINT",
        ),
    ] = ""
    events: Annotated[
        str,
        _setting(
            Group.WHERE,
            "PUB endpoint for page events "
            "('auto': an ipc:// socket beside the request socket, one per daemon; default: off)",
            metavar="ENDPOINT",
        ),
    ] = ""
    events_format: Annotated[
        str,
        _setting(
            Group.WHERE,
            "the event stream's format: kvcore's own, spec/protocol.md, or vLLM's KV events "
            "as KV-aware routers read them, spec/vllm-events.md",
            choices=EVENTS_FORMATS,
        ),
    ] = "kvcore"
    events_replay: Annotated[
        str,
        _setting(
            Group.WHERE,
            "vllm format: ROUTER endpoint that replays buffered event batches "
            "(vLLM's replay_endpoint; default: off)",
            metavar="ENDPOINT",
        ),
    ] = ""
    restore: Annotated[
        bool,
        _setting(
            Group.WHERE,
            "re-adopt the host pools and committed pages a previous daemon of this endpoint "
            "left (killed, stopped or upgraded); off: every pool starts empty",
        ),
    ] = True
    lease_timeout_s: Annotated[
        float,
        _setting(
            Group.LIMITS,
            "seconds without a request before a session's sequences are freed",
            aliases=("--lease-timeout",),
        ),
    ] = 10.0
    fence_timeout_s: Annotated[
        float,
        _setting(
            Group.LIMITS,
            "seconds a session that expired while its process lives stays fenced (its pages "
            "kept, not reused) unless the process exits or the client acknowledges first, "
            "whether or not the process can be watched",
            aliases=("--fence-timeout",),
        ),
    ] = 300.0
    max_frame_bytes: Annotated[int, _setting(Group.LIMITS, "largest request or reply")] = 8 << 20
    max_batch: Annotated[int, _setting(Group.LIMITS, "operations per batch")] = 4096
    max_request_tokens: Annotated[
        int,
        _setting(Group.LIMITS, "tokens of work one request may carry, summed over a batch"),
    ] = 1 << 20
    max_sessions: Annotated[int, _setting(Group.LIMITS, "sessions at once")] = 1024
    max_sessions_per_process: Annotated[
        int | None,
        _setting(
            Group.LIMITS,
            "sessions one ipc:// client process may hold (default: min(64, the tenant bound))",
        ),
    ] = None
    max_sessions_per_tenant: Annotated[
        int | None,
        _setting(
            Group.LIMITS,
            "sessions one [[tenants]] entry may hold (default: max_sessions less an eighth)",
        ),
    ] = None
    max_queued_bytes: Annotated[
        int,
        _setting(
            Group.LIMITS,
            "bytes of requests queued per connection before the daemon stops reading it "
            "and ZeroMQ pushes back",
        ),
    ] = 64 << 20
    events_buffer_bytes: Annotated[
        int,
        _setting(
            Group.LIMITS,
            "bytes of events buffered per event subscriber; a slower one loses the rest",
        ),
    ] = 16 << 20
    insecure: Annotated[
        bool,
        _setting(
            Group.ACCESS,
            "allow tcp:// without CURVE "
            "(anyone who reaches the port can read and write every pool)",
        ),
    ] = False
    insecure_remote_tier: Annotated[
        bool,
        _setting(
            Group.ACCESS,
            "allow a remote (Mooncake) tier without tier_secret_file "
            "(any client of the master can plant the K/V every daemon on it serves)",
        ),
    ] = False
    curve_secret_key_file: Annotated[
        str,
        _setting(
            Group.ACCESS,
            "CURVE secret key (tcp://): z85 (40 chars), or a `kvcore keys` .key_secret file; "
            "must be mode 0600",
        ),
    ] = ""
    authorized_keys_dir: Annotated[
        str,
        _setting(
            Group.ACCESS,
            "directory of client public keys (*.key, `kvcore keys`): "
            "on tcp:// only they may connect",
            aliases=("--authorized-keys",),
        ),
    ] = ""
    socket_mode: Annotated[
        int,
        _setting(
            Group.ACCESS,
            "mode of ipc:// sockets, octal (0660, 0o660 or 660); "
            "wider than 0600 (0660, 0666) only with [[tenants]]",
            metavar="MODE",
            text=OCTAL_MODE,
        ),
    ] = 0o600
    allow_ephemeral: Annotated[
        bool, _setting(Group.ACCESS, "let attach create private pools (tests and development)")
    ] = False
    metrics_port: Annotated[
        int | None,
        _setting(
            Group.OBSERVING,
            "serve Prometheus metrics and /health over HTTP on this port "
            "(0: any free port; default: off)",
            metavar="PORT",
        ),
    ] = None
    metrics_addr: Annotated[
        str,
        _setting(
            Group.OBSERVING,
            "the address the metrics port binds; loopback unless told otherwise",
            metavar="ADDR",
        ),
    ] = "127.0.0.1"
    metrics_socket: Annotated[
        str,
        _setting(
            Group.OBSERVING,
            "serve metrics on this unix socket (mode 0600: the daemon's user and root only) "
            "instead of a port (default: off)",
            metavar="PATH",
        ),
    ] = ""
    metrics_token_file: Annotated[
        str,
        _setting(
            Group.OBSERVING,
            "a file (mode 0600) of the bearer token that every scrape but /health must send",
        ),
    ] = ""
    metrics_namespace_labels: Annotated[
        bool,
        _setting(
            Group.OBSERVING,
            "per-namespace series, which name every namespace; "
            "off: no namespace's name leaves the daemon",
        ),
    ] = True
    log_level: Annotated[
        str, _setting(Group.OBSERVING, "the least severe records logged", choices=LOG_LEVELS)
    ] = "INFO"
    log_format: Annotated[
        str,
        _setting(
            Group.OBSERVING,
            "text lines, or one JSON object per line for log shippers",
            choices=LOG_FORMATS,
        ),
    ] = "text"
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
        if self.events_format not in EVENTS_FORMATS:
            raise BadRequest(
                f"events_format is one of {EVENTS_FORMATS}, not {self.events_format!r}"
            )
        if self.log_format not in LOG_FORMATS or self.log_level not in LOG_LEVELS:
            raise BadRequest(
                f"log_format is one of {LOG_FORMATS} and log_level one of {LOG_LEVELS}; "
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


@dataclass(frozen=True, slots=True)
class Setting:
    """One scalar setting of ServiceConfig as its field declares it: the TOML key is
    ``name``, the variable :attr:`env`, the flag :attr:`flag` (and ``spec.aliases``)."""

    name: str
    type: Any  # the field's annotation, as msgspec converts to it
    default: Any
    help: str
    spec: FlagSpec

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def flag(self) -> str:
        """The flag: ``--`` and the name, ``_`` as ``-``."""
        return "--" + self.name.replace("_", "-")

    def convert(self, label: str, raw: str) -> Any:
        """``raw``, the text of the flag or variable ``label``, as this setting's value (by
        its :class:`TextForm` if it has one, else :func:`_convert`); BadRequest naming
        ``label`` and ``raw`` if it is not one."""
        if self.spec.text is None:
            return _convert(label, raw, self.type)
        try:
            return self.spec.text.parse(raw)
        except ValueError as exc:
            raise BadRequest(f"{label}={raw!r}: {exc}") from None


def _settings() -> tuple[Setting, ...]:
    """Every field of ServiceConfig but the tables (``pools``, ``tenants``), in declaration
    order: each must be declared with :func:`_setting`, so that a setting is one field."""
    settings = []
    for f in msgspec.structs.fields(ServiceConfig):
        if f.name in ("pools", "tenants"):
            continue
        metas = getattr(f.type, "__metadata__", ())
        meta = next((m for m in metas if isinstance(m, msgspec.Meta) and m.extra), None)
        spec = meta.extra.get("setting") if meta and meta.extra else None
        assert meta and meta.description and isinstance(spec, FlagSpec), (
            f"ServiceConfig.{f.name}: declare it with _setting()"
        )
        settings.append(Setting(f.name, f.type, f.default, meta.description, spec))
    return tuple(settings)


SETTINGS = _settings()


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
    changes = {s.name: s.convert(s.env, environ[s.env]) for s in SETTINGS if s.env in environ}
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
    given. The one conversion of every flag and variable (but a setting's own
    :class:`TextForm`, :meth:`Setting.convert`); BadRequest naming ``label`` and ``raw``
    if it does not convert."""
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
