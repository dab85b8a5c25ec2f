"""The service manager's readiness protocol (systemd's ``sd_notify``), when it asks for it.

With ``NOTIFY_SOCKET`` in the environment (systemd's ``Type=notify``), the daemon
sends ``READY=1`` once it listens and ``STOPPING=1`` when it stops; a takeover
(kvcore.daemon.takeover) sends ``MAINPID=<its pid>`` before it asks the running
daemon to stop, so the service does not end when the old main process exits
(the unit needs ``NotifyAccess=all``: docs/deploy.md). Without the variable,
nothing is sent. A datagram carries state only, never a secret: whoever reads
it learns what ``systemctl status`` shows.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("kvcore.daemon")


def notify(state: str) -> bool:
    """Send ``state`` (``KEY=value`` lines) to the service manager; whether it was sent.
    A socket that cannot be reached is logged, never raised: the daemon serves anyway."""
    path = os.environ.get("NOTIFY_SOCKET", "")
    if path.startswith("@"):
        path = "\0" + path[1:]  # an abstract socket
    elif not path.startswith("/"):
        return False  # unset, or a transport (vsock) this daemon does not speak
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(state.encode(), path)
    except OSError as exc:
        log.warning("cannot notify the service manager at %s: %s", path.lstrip("\0"), exc)
        return False
    return True
