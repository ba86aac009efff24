"""Start a kvoffloadd subprocess and wait until it listens (tests and benchmarks).

The daemon prints one "listening on" line on stdout once its socket is bound; this
waits for that line with a deadline, never by polling the socket path (a stale path
could exist before the daemon binds it).

Each daemon gets a private temporary directory (socket, config, region record). It
outlives the daemon, so that a test can start another on the same state, and is
removed when the process that made it exits.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

# Benchmarks store most of the region in one prepare_store from one client, which the
# daemon's default max_writing_fraction refuses (a client may have half in flight).
BULK_STORES = {"max_writing_fraction": 1.0}


_made: list[tuple[int, str]] = []  # (pid that made it, temporary directory)


@atexit.register
def _remove_made() -> None:
    for pid, path in _made:
        if pid == os.getpid():  # never from a forked child
            shutil.rmtree(path, ignore_errors=True)


SHM = "/dev/shm"
# Set by tools/test-suites for the suites it runs side by side: a region new to one
# suite may be another's, so the runner, not each suite, removes what they left.
SUITES_SIDE_BY_SIDE = "KVOFFLOAD_SUITES_SIDE_BY_SIDE"


def region_held(path: str) -> bool:
    """Whether a live daemon holds the region at ``path`` (its lock on the segment)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def remove_regions_left(before: set[str]) -> None:
    """Remove the kvoffload regions in /dev/shm that are not in ``before`` and that no
    live daemon holds (one killed with SIGKILL, one kept for a warm restart)."""
    for name in set(os.listdir(SHM)) - before:
        if name.startswith("kvoffload-") and not region_held(os.path.join(SHM, name)):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(SHM, name))


def toml_value(v: Any) -> str:
    """A config value as TOML: JSON scalars are TOML; lists and tables go inline."""
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(map(toml_value, v)) + "]"
    return json.dumps(v)


class DaemonProcess:
    def __init__(
        self,
        region_size: str = "64MiB",
        *extra_args: str,
        instance: str | None = None,
        socket_path: str | None = None,
        start_timeout_s: float = 20.0,
        settings: dict[str, Any] | None = None,
        command: Sequence[str] = (sys.executable, "-m", "kvoffloadd"),
        preexec: Callable[[], None] | None = None,
        env: dict[str, str] | None = None,
        log_path: str | None = None,
    ) -> None:
        """``settings``: config keys with scalar or table values, written to a config
        file; ``command``: how to start the daemon (another installation's
        ``kvoffloadd``); ``preexec``: run in the child before the daemon starts
        (entering a cgroup); ``env``: the daemon's environment (default: this
        process's); ``log_path``: a file for its log (default: this process's stderr)."""
        self.instance = instance or f"t{uuid.uuid4().hex[:10]}"
        self._tmp = tempfile.mkdtemp(prefix="kvoffload-")
        _made.append((os.getpid(), self._tmp))
        self.socket_path = socket_path or os.path.join(self._tmp, "kvoffloadd.sock")
        if settings:
            config = os.path.join(self._tmp, "kvoffloadd.toml")
            with open(config, "w") as f:  # JSON scalars are TOML scalars
                f.writelines(f"{k} = {toml_value(v)}\n" for k, v in settings.items())
            extra_args = ("--config", config, *extra_args)
        self.args = [
            *command,
            "--socket",
            self.socket_path,
            "--instance",
            self.instance,
            "--region-size",
            region_size,
            *extra_args,
        ]
        self.start_timeout_s = start_timeout_s
        self.preexec = preexec
        self.env = env
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.banner = ""

    def start(self) -> DaemonProcess:
        log = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(
                self.args,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,
                preexec_fn=self.preexec,
                env=self.env,
            )
        finally:
            if log is not None:
                log.close()  # the daemon has its own copy
        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + self.start_timeout_s
        line = b""
        while b"\n" not in line:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                self.kill()
                raise RuntimeError(f"kvoffloadd did not start: {line.decode(errors='replace')!r}")
            if sel.select(left):
                chunk = os.read(self.proc.stdout.fileno(), 4096)
                if not chunk:
                    continue
                line += chunk
        sel.close()
        self.banner = line.decode(errors="replace").strip()
        return self

    @property
    def region_name(self) -> str:
        """The region's shared-memory name, from the banner (it has a random part)."""
        return self.banner.split("; region ", 1)[1].split()[0]

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM and wait; returns the exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        self._close_pipes()
        return rc

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._close_pipes()

    def _close_pipes(self) -> None:
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> DaemonProcess:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.alive():
            self.stop()
        else:
            self._close_pipes()


def drop_kept_region(socket_path: str, instance: str) -> None:
    """Remove the region a daemon of ``instance`` kept (``--keep-region``, or a kill),
    as named in its record next to ``socket_path`` (the default ``state_dir``), and the
    record: the next daemon there starts cold."""
    record = os.path.join(os.path.dirname(socket_path), f"kvoffload-{instance}.region")
    try:
        with open(record) as f:
            name = json.load(f)["region"]
    except (OSError, ValueError, KeyError):
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(f"/dev/shm{name}")
    os.unlink(record)


def wait_prefault(client: Any, deadline_s: float = 120.0, poll_s: float = 0.1) -> None:
    """Until the daemon's region is pre-faulted; RuntimeError after ``deadline_s``."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        region = client.stats()["region"]
        if region["prefaulted_bytes"] >= region["data_bytes"]:
            return
        time.sleep(poll_s)
    raise RuntimeError(f"the region was not pre-faulted after {deadline_s} s")
