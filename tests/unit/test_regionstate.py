"""The daemon's region is the one its private record names, under a name nobody could
take first (regionstate.py); planted, damaged and foreign segments never stop it."""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import posix_ipc
import pytest

from kvoffload.datapath.regionfmt import HEADER, MAGIC
from kvoffloadd.region.region import Geometry, RegionError
from kvoffloadd.region.regionstate import RegionState, open_region
from kvoffloadd.trust import UntrustedError

MIB = 1 << 20
G = Geometry.plan(8 * MIB, 2 * MIB, 16384)


@pytest.fixture
def instance() -> Iterator[str]:
    """A fresh instance name; every segment under its prefix is removed afterwards."""
    name = f"rs{uuid.uuid4().hex[:8]}"
    yield name
    for entry in os.listdir("/dev/shm"):
        if entry == f"kvoffload-{name}" or entry.startswith(f"kvoffload-{name}@"):
            os.unlink(f"/dev/shm/{entry}")


def draws(*tokens: str) -> Iterator[str]:
    yield from tokens
    while True:
        yield uuid.uuid4().hex[:16]


def state(tmp_path: Path, instance: str, tokens: Iterator[str] | None = None) -> RegionState:
    it = tokens or draws()
    return RegionState(str(tmp_path), instance, lambda: next(it))


def test_a_name_already_taken_is_passed_over(tmp_path: Path, instance: str) -> None:
    taken, linked, free = "0" * 16, "1" * 16, "2" * 16
    open(f"/dev/shm/kvoffload-{instance}@{taken}", "w").close()
    os.symlink("/etc/hostname", f"/dev/shm/kvoffload-{instance}@{linked}")
    st = state(tmp_path, instance, draws(taken, linked, free))
    region = open_region(st, G, discard=False)
    assert region.name == f"/kvoffload-{instance}@{free}" and not region.recovered
    assert json.loads((tmp_path / f"kvoffload-{instance}.region").read_text())["region"] == (
        region.name
    )
    assert os.readlink(f"/dev/shm/kvoffload-{instance}@{linked}") == "/etc/hostname"
    region.close()
    st.release(forget=True)
    assert not (tmp_path / f"kvoffload-{instance}.region").exists()


def test_the_recorded_region_comes_back_and_the_record_is_held(
    tmp_path: Path, instance: str
) -> None:
    st = state(tmp_path, instance)
    first = open_region(st, G, discard=False)
    with pytest.raises(UntrustedError, match="another kvoffloadd holds"):
        state(tmp_path, instance)
    first.close(unlink=False)
    st.release(forget=False)
    st = state(tmp_path, instance)
    again = open_region(st, G, discard=False)
    assert again.name == first.name and again.recovered
    again.close()
    st.release(forget=True)


def test_a_record_made_with_other_settings_is_refused_unless_discarded(
    tmp_path: Path, instance: str
) -> None:
    st = state(tmp_path, instance)
    first = open_region(st, G, discard=False)
    first.close(unlink=False)
    st.release(forget=False)
    bigger = Geometry.plan(16 * MIB, 2 * MIB, 16384)
    st = state(tmp_path, instance)
    with pytest.raises(RegionError, match=r"made with region_size=.*--discard-region"):
        open_region(st, bigger, discard=False)
    assert os.path.exists(f"/dev/shm{first.name}")  # refused, kept
    region = open_region(st, bigger, discard=True)
    assert region.name != first.name and not os.path.exists(f"/dev/shm{first.name}")
    region.close()
    st.release(forget=True)


@pytest.mark.parametrize(
    "damage", ["bad magic", "cut short", "grown", "another uid's", "gone", "a link"]
)
def test_a_recorded_segment_that_cannot_be_recovered_never_stops_the_start(
    tmp_path: Path, instance: str, damage: str
) -> None:
    st = state(tmp_path, instance)
    first = open_region(st, G, discard=False)
    first.close(unlink=False)
    st.release(forget=False)
    path = f"/dev/shm{first.name}"
    if damage == "bad magic":
        with open(path, "r+b") as f:
            f.write(b"garbage!")
    elif damage in ("cut short", "grown"):
        os.truncate(path, G.region_bytes + (MIB if damage == "grown" else -MIB))
    elif damage == "another uid's":
        os.chown(path, 65534, 65534)
    elif damage == "gone":
        os.unlink(path)
    else:
        os.unlink(path)
        os.symlink("/etc/hostname", path)
    st = state(tmp_path, instance)
    region = open_region(st, G, discard=False)
    assert region.name != first.name and not region.recovered
    left_alone = damage in ("another uid's", "a link")
    assert os.path.lexists(path) == left_alone
    region.close()
    st.release(forget=True)
    if left_alone:
        os.unlink(path)


@pytest.mark.parametrize(
    "record",
    [
        b"{not json",
        b'{"region": "/kvoffload-other@0000000000000000", "region_bytes": 1,'
        b' "extent_bytes": 1, "min_slot_bytes": 1, "format": 3}',
        b'{"region": "/etc/passwd"}',
        b"[]",
        b"\xff" * 600,
    ],
)
def test_an_unreadable_record_is_ignored(tmp_path: Path, instance: str, record: bytes) -> None:
    path = tmp_path / f"kvoffload-{instance}.region"
    path.write_bytes(record)
    path.chmod(0o600)
    st = state(tmp_path, instance)
    assert st.recorded is None
    region = open_region(st, G, discard=False)
    assert region.name.startswith(f"/kvoffload-{instance}@")
    region.close()
    st.release(forget=True)


def test_a_planted_record_is_refused(tmp_path: Path, instance: str) -> None:
    os.symlink("/etc/hostname", tmp_path / f"kvoffload-{instance}.region")
    with pytest.raises(UntrustedError, match="symlink"):
        state(tmp_path, instance)


def _legacy(instance: str, version: int, mode: int = 0o600) -> str:
    name = f"/kvoffload-{instance}"
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=mode, size=G.region_bytes)
    with mmap.mmap(shm.fd, HEADER.size) as mm:
        mm[:12] = MAGIC + version.to_bytes(4, "little")
    os.fchmod(shm.fd, mode)
    shm.close_fd()
    return f"/dev/shm{name}"


@pytest.mark.parametrize(("version", "mode", "removed"), [(2, 0o600, True), (3, 0o600, False)])
def test_an_older_daemons_region_under_the_old_name_is_removed(
    tmp_path: Path, instance: str, version: int, mode: int, removed: bool
) -> None:
    """Only a region of an older format, this uid's and held by nobody: an upgrade
    does not leave the old cache in /dev/shm for good."""
    path = _legacy(instance, version, mode)
    st = state(tmp_path, instance)
    region = open_region(st, G, discard=False)
    assert os.path.exists(path) != removed
    region.close()
    st.release(forget=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def test_a_legacy_region_in_use_is_left_alone(tmp_path: Path, instance: str) -> None:
    path = _legacy(instance, 2)
    shm = posix_ipc.SharedMemory(f"/kvoffload-{instance}")
    fcntl.flock(shm.fd, fcntl.LOCK_EX)  # an older daemon still runs on it
    st = state(tmp_path, instance)
    region = open_region(st, G, discard=False)
    assert os.path.exists(path)
    region.close()
    st.release(forget=True)
    shm.close_fd()
