"""Start a throwaway mooncake_master on loopback ports (tests and benchmarks).

The master serves its RPC port, its HTTP metadata server (``metadata_url``) and its
admin server (``admin_url``: ``/get_all_keys``, ``/health``), all on 127.0.0.1, and keeps
nothing on disk. ``MooncakeMaster.available()`` says why none can be started (Mooncake
not installed, or its libraries missing), so callers can skip with that reason.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import time
import urllib.request

from .server_process import ServerProcess, accepts, free_ports

_GLOG_ERROR = re.compile(r"[EF]\d{4} ")  # glog's prefix of an ERROR or FATAL line


def _binary() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    return here if os.access(here, os.X_OK) else shutil.which("mooncake_master") or ""


class MooncakeMaster(ServerProcess):
    def __init__(self, lease_ttl_ms: int = 500, ports: tuple[int, int, int] | None = None):
        self.binary = _binary()
        self.rpc_port, self.metadata_port, self.admin_port = ports or free_ports(3)
        self.lease_ttl_ms = lease_ttl_ms

    @staticmethod
    def available() -> str:
        """Empty when a master can be started and a client can load, else why not."""
        if not _binary():
            return "mooncake_master is not installed (make test installs kvoffload[mooncake])"
        probe = [sys.executable, "-c", "import mooncake.store"]
        out = subprocess.run(probe, capture_output=True, text=True, timeout=60, check=False)
        if out.returncode != 0:
            last = (out.stderr.strip().splitlines() or ["?"])[-1]
            return f"Mooncake's client cannot load ({last}); make test installs its libraries"
        return ""

    @property
    def master(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def start(self, timeout_s: float = 20.0) -> MooncakeMaster:
        if not self.binary:
            raise RuntimeError(self.available())
        args = [self.binary, f"-rpc_port={self.rpc_port}", "-rpc_address=127.0.0.1"]
        args += ["-enable_http_metadata_server=true", "-http_metadata_server_host=127.0.0.1"]
        args += [f"-http_metadata_server_port={self.metadata_port}"]
        args += [f"-metrics_port={self.admin_port}", "-metrics_host=127.0.0.1"]
        args += [f"-default_kv_lease_ttl={self.lease_ttl_ms}", "-log_dir=."]
        proc = self.spawn(args, "kvoffload-mooncake-")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                try:
                    why = self._first_error()
                finally:
                    self.stop()
                raise RuntimeError(f"mooncake_master exited with {proc.returncode}{why}")
            if self.healthy():
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(
            f"mooncake_master did not answer on all of ports {self.rpc_port} (RPC), "
            f"{self.metadata_port} (metadata), {self.admin_port} (admin)"
        )

    def _first_error(self) -> str:
        """The first error line of the master's log (it writes it where it runs: the
        cause comes before what failed of it), or nothing."""
        errors = [
            line.split("] ", 1)[-1].strip()
            for log in sorted(pathlib.Path(self._dir).glob("mooncake_master.*"))
            if not log.is_symlink()
            for line in log.read_text(errors="replace").splitlines()
            if _GLOG_ERROR.match(line)
        ]
        return f": {errors[0]}" if errors else ""

    def healthy(self) -> bool:
        """Its admin server says so, and its RPC and metadata ports accept connections
        (a master that could not bind one of them still answers on the others)."""
        if not (accepts(self.rpc_port) and accepts(self.metadata_port)):
            return False
        try:
            with urllib.request.urlopen(self.admin_url + "/health", timeout=0.5) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def objects(self) -> list[str]:
        """Every object the master holds (its admin server's ``/get_all_keys``)."""
        with urllib.request.urlopen(self.admin_url + "/get_all_keys", timeout=5) as r:
            return [k for k in r.read().decode().splitlines() if k]

    def restarted(self) -> MooncakeMaster:
        """A fresh, empty master on the same ports (after ``kill``)."""
        self.stop()
        ports = (self.rpc_port, self.metadata_port, self.admin_port)
        return MooncakeMaster(self.lease_ttl_ms, ports).start()


__all__ = ["MooncakeMaster"]
