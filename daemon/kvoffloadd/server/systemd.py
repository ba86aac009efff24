"""systemd integration without a dependency: sd_notify, socket activation, watchdog.

Rules:
- Every function is a no-op when the daemon was not started by systemd
  (``NOTIFY_SOCKET`` / ``LISTEN_PID`` unset), so the same binary runs by hand.
- ``listen_fds`` consumes the LISTEN_* variables (so children never inherit them) and
  accepts descriptors only when ``LISTEN_PID`` is this process.
- The watchdog interval is half of ``WATCHDOG_USEC``, as sd_watchdog_enabled(3) advises.
"""

from __future__ import annotations

import os
import socket

SD_LISTEN_FDS_START = 3


class Notifier:
    """Sends state strings to the service manager's NOTIFY_SOCKET (sd_notify(3))."""

    def __init__(self, address: str | None = None) -> None:
        addr = address if address is not None else os.environ.get("NOTIFY_SOCKET", "")
        if addr.startswith("@"):
            addr = "\0" + addr[1:]  # abstract namespace
        self._addr = addr
        self._sock: socket.socket | None = None
        if addr:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, **fields: str | int) -> bool:
        """``notify(READY=1, STATUS="...")``; returns False when not under systemd."""
        if self._sock is None:
            return False
        state = "\n".join(f"{k}={v}" for k, v in fields.items())
        try:
            self._sock.sendto(state.encode(), self._addr)
        except OSError:
            return False
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def watchdog_interval_s() -> float | None:
    """Seconds between WATCHDOG=1 pings, or None when no watchdog is configured."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2e6
    except ValueError:
        return None


def listen_fds() -> list[tuple[socket.socket, str | None]]:
    """Sockets passed by socket activation (sd_listen_fds(3)), with their names."""
    pid = os.environ.get("LISTEN_PID")
    count = os.environ.get("LISTEN_FDS")
    names = os.environ.get("LISTEN_FDNAMES", "")
    for var in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(var, None)
    if pid != str(os.getpid()) or not count:
        return []
    name_list = names.split(":") if names else []
    out = []
    for i in range(int(count)):
        fd = SD_LISTEN_FDS_START + i
        os.set_inheritable(fd, False)
        sock = socket.socket(fileno=fd)
        out.append((sock, name_list[i] if i < len(name_list) else None))
    return out
