"""Start a throwaway redis-server on a loopback port (tests and benchmarks).

The server keeps nothing on disk (no RDB, no AOF) and runs in its own temporary
directory. ``RedisServer.available()`` says why none can be started (no binary), so
callers can skip with that reason. Any binary that speaks Redis's protocol and flags
can be named (``valkey-server``: the tests run against both); the benchmarks start
``KVOFFLOAD_REDIS_SERVER`` when the environment names one. With ``tls_dir`` (made by
``make_tls_files``: a throwaway CA and a certificate for 127.0.0.1) the server speaks
TLS only, and ``url`` is a ``rediss://`` one; a client trusts the CA through
``SSL_CERT_FILE``.
"""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import time

from .server_process import ServerProcess, free_port


def server_name() -> str:
    """The server binary tests and benchmarks start: redis-server unless the
    environment names another (valkey-server)."""
    return os.environ.get("KVOFFLOAD_REDIS_SERVER") or "redis-server"


def make_tls_files(directory: str) -> str:
    """A throwaway CA and a server certificate for 127.0.0.1 (key ``server.key``) in
    ``directory``, made with the openssl command; returns the CA's path."""
    steps = [
        "req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=kvoffload-test-CA"
        " -keyout ca.key -out ca.crt",
        "req -newkey rsa:2048 -nodes -subj /CN=127.0.0.1 -keyout server.key -out server.csr",
        "x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 1"
        " -extfile san.ext -out server.crt",
    ]
    with open(os.path.join(directory, "san.ext"), "w") as f:
        f.write("subjectAltName=IP:127.0.0.1\n")
    for args in steps:
        subprocess.run(["openssl", *args.split()], cwd=directory, check=True, capture_output=True)
    return os.path.join(directory, "ca.crt")


class RedisServer(ServerProcess):
    def __init__(
        self, port: int | None = None, maxmemory: str = "0", name: str = "", tls_dir: str = ""
    ) -> None:
        self.name = name or server_name()
        self.binary = shutil.which(self.name) or ""
        self.port = port or free_port()
        self.maxmemory = maxmemory
        self.tls_dir = tls_dir

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
        return f"{'rediss' if self.tls_dir else 'redis'}://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        if not self.binary:
            raise RuntimeError(self.available(self.name))
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        if self.tls_dir:
            at = self.tls_dir
            args = [self.binary, "--port", "0", "--tls-port", str(self.port), "--bind", "127.0.0.1"]
            args += ["--tls-cert-file", f"{at}/server.crt", "--tls-key-file", f"{at}/server.key"]
            args += ["--tls-ca-cert-file", f"{at}/ca.crt", "--tls-auth-clients", "no"]
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
            s = socket.create_connection(("127.0.0.1", self.port), timeout=0.5)
        except OSError:
            return False
        try:
            if self.tls_dir:
                ctx = ssl.create_default_context(cafile=f"{self.tls_dir}/ca.crt")
                s = ctx.wrap_socket(s, server_hostname="127.0.0.1")  # closes s if it fails
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False
        finally:
            s.close()


def restart_on_same_port(old: RedisServer) -> RedisServer:
    """A fresh, empty server where ``old`` was (after ``old.kill()``)."""
    old.stop()
    return RedisServer(
        port=old.port, maxmemory=old.maxmemory, name=old.name, tls_dir=old.tls_dir
    ).start()


__all__ = ["RedisServer", "restart_on_same_port"]
