"""Shared fixtures: a real kvoffloadd subprocess per test module or per test.

A test session leaves nothing behind: every temporary file and directory (the tests',
the daemons' sockets, pytest's own) goes under one session directory, removed at the
end; so do the regions this session's daemons left in /dev/shm (one killed with
SIGKILL, or one that kept its region for a warm restart), except those a live daemon
still holds.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from kvoffloadbench.launch import DaemonProcess
from kvoffloadbench.redis_server import RedisServer

SHM = "/dev/shm"
_session: dict[str, object] = {}


def pytest_configure(config: pytest.Config) -> None:
    base = tempfile.mkdtemp(prefix="kvoffload-tests-")
    os.chmod(base, 0o1777)  # as /tmp is: tests acting as another uid work below it too
    _session.update(base=base, tmpdir=os.environ.get("TMPDIR"), shm=set(os.listdir(SHM)))
    os.environ["TMPDIR"] = tempfile.tempdir = base
    if config.option.basetemp is None:
        config.option.basetemp = os.path.join(base, "pytest")


def pytest_unconfigure(config: pytest.Config) -> None:
    if "base" not in _session:
        return
    tempfile.tempdir = None
    if (old := _session["tmpdir"]) is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = str(old)
    shutil.rmtree(str(_session["base"]), ignore_errors=True)
    before = _session["shm"]
    assert isinstance(before, set)
    for name in set(os.listdir(SHM)) - before:
        if name.startswith("kvoffload-") and not _held(os.path.join(SHM, name)):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(SHM, name))


def _held(path: str) -> bool:
    """Whether a live daemon holds this region (its lock on the segment)."""
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = bool(torch.cuda.is_available())
    except ImportError:
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


@pytest.fixture(params=("redis-server", "valkey-server"), ids=("redis", "valkey"))
def redis_server_name(request: pytest.FixtureRequest) -> str:
    """Each Redis tier test runs against Redis and against Valkey (make test installs
    both from Debian); one that is not installed skips, naming it."""
    name: str = request.param
    if why := RedisServer.available(name):
        pytest.skip(why)
    return name


@pytest.fixture
def redis_server(redis_server_name: str) -> Iterator[RedisServer]:
    """A fresh Redis (or Valkey) server on loopback for one test."""
    server = RedisServer(name=redis_server_name).start()
    yield server
    server.stop()


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    """A fresh daemon with a 64 MiB region; must stop cleanly (exit 0, nothing leaked)."""
    with DaemonProcess("64MiB", "--log-level", "warning") as d:
        yield d
        rc = d.stop()
    assert rc == 0, f"kvoffloadd exited with {rc}"
    assert not os.path.exists(f"/dev/shm{d.region_name}"), "region leaked"
    assert not os.path.exists(d.socket_path), "socket leaked"
