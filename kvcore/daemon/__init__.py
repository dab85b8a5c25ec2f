"""The daemon (`kvcore serve`): the Manager of each pool served over kvcore_ipc.

Parts, one job each (docs/architecture.md, "The daemon"):

* :mod:`.sessions` — leases, fencing and sequence ownership in both directions;
* :mod:`.auth` — credentials (peer uid, CURVE key) -> grants of pools and namespaces;
* :mod:`.quotas` — the ledger of what sessions and namespaces hold; bounded work;
* :mod:`.pools` — a pool's memory region, its Manager, its event numbering;
* :mod:`.handler` — one frame in, one frame out, through :mod:`kvcore.ops`;
* :mod:`.daemon` — the Daemon: its parts built in order, the loop's tick;
* :mod:`.serve` — the command line: configuration, locks, signals, banner, logs;
* :mod:`.flags` — serve's setting flags, derived from the configuration's fields.
"""

from kvcore.daemon.daemon import Daemon

__all__ = ["Daemon"]
