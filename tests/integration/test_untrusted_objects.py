"""The daemon trusts no pre-existing object, and one instance owns one region and one
socket. Each scenario is an attack by a second local uid (``nobody``), tried against
a real daemon started as root."""

from __future__ import annotations

import contextlib
import os
import shutil
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
from kvoffload.link.peer import UntrustedDaemonError
from kvoffloadbench.launch import DaemonProcess
from kvoffloadd.region.region import Geometry, SharedOffloadRegion


def start_fails(*args: str, socket_path: str, instance: str) -> str:
    """Start a daemon that must refuse; returns what it printed on stderr."""
    d = DaemonProcess("64MiB", *args, socket_path=socket_path, instance=instance)
    proc = subprocess.run(d.args, capture_output=True, timeout=60)
    assert proc.returncode == 1, f"it started: {proc.stdout!r} {proc.stderr!r}"
    return proc.stderr.decode()


def plant_region(name: str, mode: int) -> int:
    """As the calling uid: a valid region under ``name`` (64 MiB in extents of 1 MiB,
    the daemons' geometry below), with ``mode``; returns its owner."""
    g = Geometry.plan(64 << 20, 1 << 20, 16384)
    r = SharedOffloadRegion(name, g)
    os.fchmod(r._shm.fd, mode)
    r.close(unlink=False)
    return os.stat(f"/dev/shm{name}").st_uid


def test_files_and_links_planted_at_every_predictable_name_never_stop_the_daemon() -> None:
    """Scenario: before the daemon's first start, nobody takes every name it could
    predict: the old public region name (a valid region, 0666), the random names'
    prefix with guesses, a link to a root file, and the region record next to the
    socket. The daemon starts, makes its own region, and touches none of them (before:
    it refused to start, and under the unit could not remove the file: a restart
    loop any local user could cause)."""
    requires_root()
    instance = f"p{uuid.uuid4().hex[:8]}"
    prefix = f"/kvoffload-{instance}"
    run = tempfile.mkdtemp()  # root's, 0700: where the socket and the record live
    with tempfile.NamedTemporaryFile("w", delete=False, dir="/dev/shm") as victim:
        victim.write("precious\n")
    guesses = [f"{prefix}@{i:016x}" for i in range(4)] + [f"{prefix}@{'f' * 16}"]

    link = f"/dev/shm{prefix}@{'0' * 15}9"

    def plant() -> list[object]:
        owners: list[object] = [plant_region(prefix, 0o666)]
        owners += [plant_region(name, 0o600) for name in guesses]
        os.symlink(victim.name, link)
        try:  # the record's home: out of reach
            os.symlink(victim.name, os.path.join(run, f"kvoffload-{instance}.region"))
        except PermissionError:
            owners.append("no record")
        return owners

    assert as_uid(plant) == [NOBODY] * (1 + len(guesses)) + ["no record"]
    try:
        with DaemonProcess(
            "64MiB", "--extent-size", "1MiB", socket_path=os.path.join(run, "kvoffloadd.sock"),
            instance=instance,
        ) as d:  # fmt: skip
            name = d.region_name
            assert name.startswith(f"{prefix}@") and name not in guesses
            st = os.stat(f"/dev/shm{name}")
            assert (st.st_uid, st.st_mode & 0o777) == (0, 0o600)
            with kvoffload.connect(d.socket_path) as c:
                assert c.stats()["blocks"]["used_blocks"] == 0  # nothing of nobody's
            assert d.stop() == 0
        assert not os.path.exists(f"/dev/shm{name}")
        for planted in [prefix, *guesses]:
            assert os.stat(f"/dev/shm{planted}").st_uid == NOBODY  # left alone
        with open(victim.name) as f:
            assert f.read() == "precious\n"
    finally:
        for planted in [prefix, *guesses]:
            with contextlib.suppress(posix_ipc.ExistentialError):
                posix_ipc.unlink_shared_memory(planted)
        for path in [link, victim.name]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        shutil.rmtree(run, ignore_errors=True)


@pytest.mark.parametrize("what", ["a region", "a link"])
def test_a_region_name_learned_before_a_reboot_is_planted_in_vain(what: str) -> None:
    """Scenario: nobody read the region's name (/dev/shm lists it); a reboot clears
    /dev/shm but not a persistent state directory; nobody plants the recorded name
    before the daemon starts again. The daemon makes a region under a new name."""
    requires_root()
    args = ("--extent-size", "1MiB", "--keep-region", "--log-level", "error")
    d1 = DaemonProcess("64MiB", *args).start()
    with kvoffload.connect(d1.socket_path) as c:
        c.namespace("mine", kvoffload.KVLayout([16384]))
    assert d1.stop() == 0
    name = d1.region_name
    posix_ipc.unlink_shared_memory(name)  # the reboot

    def plant() -> int:
        if what == "a link":
            os.symlink("/etc/hostname", f"/dev/shm{name}")
            return os.lstat(f"/dev/shm{name}").st_uid
        return plant_region(name, 0o600)

    assert as_uid(plant) == NOBODY
    try:
        with DaemonProcess("64MiB", *args, instance=d1.instance, socket_path=d1.socket_path) as d2:
            assert d2.region_name != name
            with kvoffload.connect(d2.socket_path) as c:
                assert c.stats()["namespaces"] == {}  # nothing of nobody's, nothing kept
            assert d2.stop() == 0
        assert os.lstat(f"/dev/shm{name}").st_uid == NOBODY  # left alone
        os.unlink(f"/dev/shm{d2.region_name}")
    finally:
        os.unlink(f"/dev/shm{name}")


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
    """Scenario: a second daemon with the same instance name and the same state
    directory (another socket), one with the same name in another directory, and one
    with another name but the same socket path."""
    instance = f"o{uuid.uuid4().hex[:8]}"
    with DaemonProcess("64MiB", "--log-level", "warning", instance=instance) as first:
        with kvoffload.connect(first.socket_path) as c:
            ns = c.namespace("mine", kvoffload.KVLayout([4096]))
            state = os.path.dirname(first.socket_path)
            config = os.path.join(tempfile.mkdtemp(), "k.toml")
            with open(config, "w") as f:
                f.write(f'state_dir = "{state}"\n')
            other = os.path.join(os.path.dirname(config), "kvoffloadd.sock")
            err = start_fails("--config", config, socket_path=other, instance=instance)
            assert f"another kvoffloadd holds {state}/kvoffload-{instance}.region" in err
            elsewhere = os.path.join(tempfile.mkdtemp(), "kvoffloadd.sock")
            with DaemonProcess("64MiB", instance=instance, socket_path=elsewhere) as second:
                assert second.region_name != first.region_name  # never one region
                assert second.stop() == 0
            err = start_fails(socket_path=first.socket_path, instance=f"x{instance}")
            assert "another kvoffloadd holds" in err
            assert os.path.exists(first.socket_path)
            assert ns.lookup([b"k"]) == 0 and c.ping() > 0  # the first serves on
        assert first.stop() == 0
