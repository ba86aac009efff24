"""A throwaway server process for tests and benchmarks: its own session and temporary
directory, stopped with SIGTERM (SIGKILL after 10 s), or killed at once as in a crash.

Ports (``free_port``; ``free_ports`` for several, distinct) are chosen below the
kernel's ephemeral range: a port taken from that range is free when chosen but may be
the local port of some outgoing connection by the time the server binds it (a busy
suite makes thousands), and a server that cannot bind one of its ports may still
answer on the others.
"""

from __future__ import annotations

import random
import shutil
import signal
import socket
import subprocess
import tempfile
from types import TracebackType
from typing import Any

_PORTS_FROM = 10000  # below this, well-known and registered services are common


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback TCP port that nothing is bound to now, outside the ephemeral range."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback TCP ports that nothing is bound to now, outside the
    ephemeral range (inside it, the kernel's choice, where the range leaves less than
    1,000 ports below it): each is held bound until all are chosen, so no two are the
    same (three separate choices gave a master the same port twice, and it exited)."""
    high = _ephemeral_low()
    held: list[socket.socket] = []
    try:
        for _ in range(200 * n):
            if len(held) == n:
                break
            port = random.randrange(_PORTS_FROM, high) if high > _PORTS_FROM + 1000 else 0
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            held.append(s)
        if len(held) < n:
            raise RuntimeError("no free loopback port below the ephemeral range")
        return [int(s.getsockname()[1]) for s in held]
    finally:
        for s in held:
            s.close()


def accepts(port: int, timeout_s: float = 0.5) -> bool:
    """Does something accept TCP connections on ``127.0.0.1:port``?"""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s):
            return True
    except OSError:
        return False


class ServerProcess:
    proc: subprocess.Popen[bytes] | None = None
    _dir = ""

    def spawn(self, args: list[str], prefix: str) -> subprocess.Popen[bytes]:
        """Start ``args`` in a fresh temporary directory, output discarded."""
        self._dir = tempfile.mkdtemp(prefix=prefix)
        self.proc = subprocess.Popen(
            args,
            cwd=self._dir,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        return self.proc

    def start(self) -> Any:
        raise NotImplementedError

    def kill(self) -> None:
        """SIGKILL: the server is gone at once, as in a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = ""

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
