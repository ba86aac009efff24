"""Start a throwaway redis-server on a loopback port (tests and benchmarks).

The server keeps nothing on disk (no RDB, no AOF) and runs in its own temporary
directory. ``RedisServer.available()`` says why none can be started (no binary), so
callers can skip with that reason. Any binary that speaks Redis's protocol and flags
can be named (``valkey-server``: the tests run against both); the benchmarks start
``KVOFFLOAD_REDIS_SERVER`` when the environment names one.
"""

from __future__ import annotations

import os
import shutil
import socket
import time

from .server_process import ServerProcess, free_port


def server_name() -> str:
    """The server binary tests and benchmarks start: redis-server unless the
    environment names another (valkey-server)."""
    return os.environ.get("KVOFFLOAD_REDIS_SERVER") or "redis-server"


class RedisServer(ServerProcess):
    def __init__(self, port: int | None = None, maxmemory: str = "0", name: str = "") -> None:
        self.name = name or server_name()
        self.binary = shutil.which(self.name) or ""
        self.port = port or free_port()
        self.maxmemory = maxmemory

    @staticmethod
    def available(name: str = "") -> str:
        """Empty when the server (``server_name()`` unless named) can be started, else
        the reason it cannot."""
        name = name or server_name()
        if shutil.which(name) is None:
            return f"{name} is not installed (make test installs Debian's package)"
        return ""

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        if not self.binary:
            raise RuntimeError(self.available(self.name))
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no", "--dir", "."]
        args += ["--maxmemory", self.maxmemory, "--protected-mode", "no"]
        proc = self.spawn(args, "kvoffload-redis-")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{self.binary} exited with {proc.returncode}")
            if self.ping():
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"{self.binary} did not answer on port {self.port}")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False


def restart_on_same_port(old: RedisServer) -> RedisServer:
    """A fresh, empty server where ``old`` was (after ``old.kill()``)."""
    old.stop()
    return RedisServer(port=old.port, maxmemory=old.maxmemory, name=old.name).start()


__all__ = ["RedisServer", "restart_on_same_port"]
