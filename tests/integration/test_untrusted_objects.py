"""The daemon trusts no pre-existing object, and one instance owns one region and one
socket. Each scenario is an attack by a second local uid (``nobody``), tried against
a real daemon started as root."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import tempfile
import threading
import uuid

import posix_ipc
import pytest
from helpers import poll
from hostile import NOBODY, as_uid, requires_root

import kvoffload
from kvoffload.peer import UntrustedDaemonError
from kvoffloadbench.launch import DaemonProcess
from kvoffloadd.region import Geometry, SharedOffloadRegion


def start_fails(*args: str, socket_path: str, instance: str) -> str:
    """Start a daemon that must refuse; returns what it printed on stderr."""
    d = DaemonProcess("64MiB", *args, socket_path=socket_path, instance=instance)
    proc = subprocess.run(d.args, capture_output=True, timeout=60)
    assert proc.returncode == 1, f"it started: {proc.stdout!r} {proc.stderr!r}"
    return proc.stderr.decode()


def test_a_region_another_uid_planted_is_never_adopted() -> None:
    """Scenario: nobody pre-creates the daemon's region, mode 0666, with a valid header
    and a READY block, hoping a root engine loads its bytes and it reads later ones."""
    requires_root()
    instance = f"p{uuid.uuid4().hex[:8]}"
    name = f"/kvoffload-{instance}"

    def plant() -> int:
        g = Geometry.plan(64 << 20, 1 << 20, 16384)
        r = SharedOffloadRegion(name, g)
        os.fchmod(r._shm.fd, 0o666)
        r.close(unlink=False)
        return os.stat(f"/dev/shm{name}").st_uid

    assert as_uid(plant) == NOBODY
    sock = os.path.join(tempfile.mkdtemp(), "kvoffloadd.sock")
    try:
        err = start_fails("--extent-size", "1MiB", socket_path=sock, instance=instance)
        assert f"owned by uid {NOBODY} with mode 0666" in err
        assert os.stat(f"/dev/shm{name}").st_uid == NOBODY  # refused, left alone
        # told to discard it, a root daemon drops it and makes its own
        with DaemonProcess(
            "64MiB", "--extent-size", "1MiB", "--discard-region", socket_path=sock,
            instance=instance,
        ) as d:  # fmt: skip
            st = os.stat(f"/dev/shm{name}")
            assert (st.st_uid, st.st_mode & 0o777) == (0, 0o600)
            with kvoffload.connect(d.socket_path) as c:
                assert c.stats()["blocks"]["used_blocks"] == 0  # nothing of nobody's
            assert d.stop() == 0
    finally:
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(name)


def test_a_squatted_runtime_directory_and_a_planted_lock_link_are_refused() -> None:
    """Scenario: with XDG_RUNTIME_DIR unset the socket goes under /tmp. nobody makes
    the directory first (0777) with the lock file as a symlink to a root file."""
    requires_root()
    base = f"/tmp/kvoffload-squat-{uuid.uuid4().hex[:8]}"
    with tempfile.NamedTemporaryFile("w", delete=False) as victim:
        victim.write("precious\n")

    def squat() -> None:
        os.mkdir(base, 0o777)
        os.chmod(base, 0o777)
        os.symlink(victim.name, os.path.join(base, "kvoffloadd.sock.lock"))

    as_uid(squat)
    sock = os.path.join(base, "kvoffloadd.sock")
    try:
        err = start_fails(socket_path=sock, instance=f"s{uuid.uuid4().hex[:8]}")
        assert f"owned by uid {NOBODY}" in err and "own directory" in err
        # root's own directory, but with the planted link inside
        own = tempfile.mkdtemp()
        os.symlink(victim.name, os.path.join(own, "kvoffloadd.sock.lock"))
        err = start_fails(socket_path=os.path.join(own, "kvoffloadd.sock"), instance="x")
        assert "symlink" in err
        with open(victim.name) as f:
            assert f.read() == "precious\n"  # never truncated, never written
    finally:
        os.unlink(os.path.join(base, "kvoffloadd.sock.lock"))
        os.rmdir(base)
        os.unlink(victim.name)


def test_an_engine_never_talks_to_a_socket_another_uid_serves() -> None:
    """Scenario: nobody serves a socket where an engine looks for its daemon. The
    engine refuses it after connecting, before sending a byte."""
    requires_root()
    base = f"/tmp/kvoffload-fake-{uuid.uuid4().hex[:8]}"
    path = os.path.join(base, "kvoffloadd.sock")

    def serve() -> int:
        os.mkdir(base, 0o755)
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(path + ".tmp")
        os.chmod(path + ".tmp", 0o777)
        srv.listen(1)
        os.rename(path + ".tmp", path)  # appears only once it listens
        conn, _ = srv.accept()
        conn.settimeout(5)
        data = b""
        try:
            while chunk := conn.recv(4096):
                data += chunk
        except OSError:
            pass
        return len(data)

    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(as_uid(serve)))
    t.start()
    poll(lambda: os.path.exists(path), "the planted socket")
    try:
        with pytest.raises(UntrustedDaemonError, match=f"runs as uid {NOBODY}"):
            kvoffload.connect(path)
    finally:
        t.join(30)
        os.unlink(path)
        os.rmdir(base)
    assert result == [0]  # not even the Hello


def test_one_instance_owns_one_region_and_one_socket() -> None:
    """Scenario: a second daemon with the same instance name and another socket
    directory, and a third with another name but the same socket path."""
    instance = f"o{uuid.uuid4().hex[:8]}"
    with DaemonProcess("64MiB", "--log-level", "warning", instance=instance) as first:
        with kvoffload.connect(first.socket_path) as c:
            ns = c.namespace("mine", kvoffload.KVLayout([4096]))
            other_dir = os.path.join(tempfile.mkdtemp(), "kvoffloadd.sock")
            err = start_fails(socket_path=other_dir, instance=instance)
            assert "in use by another kvoffloadd" in err
            err = start_fails(socket_path=first.socket_path, instance=f"x{instance}")
            assert "another kvoffloadd holds" in err
            assert os.path.exists(first.socket_path)
            assert ns.lookup([b"k"]) == 0 and c.ping() > 0  # the first serves on
        assert first.stop() == 0
