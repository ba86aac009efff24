"""The region on a real node (invariant 16): a cgroup too small for it refuses the
start naming the limit (the test makes the cgroup and starts the daemon in it), where
without the check the daemon was OOM-killed after listening; hugetlbfs backing with
pages the test reserves (and gives back), adopted on warm restart and refused when
too few; transparent huge pages on a tmpfs mounted for them; the pages' real NUMA
placement; a kept region found resident, not populated again; ``kvoffloadctl check``.

Mounting, reserving huge pages and making cgroups need root: those tests skip
without it.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import re
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers import poll, store_blocks

import kvoffload
from kvoffloadbench.launch import DaemonProcess, drop_kept_region
from kvoffloadd.region import kernel
from kvoffloadd.region.hostfs import cgroup_dirs

GIB = 1 << 30
MIB = 1 << 20
HUGE_NR = "/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages"
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


def populated(client: kvoffload.Client) -> bool:
    """Populated, its placement sampled and its huge pages counted."""
    return bool(client.stats()["region"]["populate_done"])


def run_refused(
    *args: str, settings: dict[str, object], preexec: Callable[[], object] | None = None
) -> str:
    """Start a daemon that must refuse: its exit status and what it said."""
    tmp = tempfile.mkdtemp(prefix="kvoffload-refused-")
    config = os.path.join(tmp, "k.toml")
    with open(config, "w") as f:
        f.writelines(f"{k} = {json_value(v)}\n" for k, v in settings.items())
    instance = f"r{uuid.uuid4().hex[:10]}"
    sock = os.path.join(tmp, "s.sock")
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvoffloadd",
                "--socket",
                sock,
                "--instance",
                instance,
                "--config",
                config,
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            preexec_fn=preexec,
        )
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "listening" not in proc.stdout
        assert not [e for e in os.listdir("/dev/shm") if e.startswith(f"kvoffload-{instance}@")]
        return proc.stderr
    finally:
        drop_kept_region(sock, instance)
        with contextlib.suppress(OSError):
            for entry in os.listdir(tmp):
                os.unlink(os.path.join(tmp, entry))
            os.rmdir(tmp)


def json_value(v: object) -> str:
    import json

    return json.dumps(v)


# ------------------------------------------------------------------ cgroups


@contextlib.contextmanager
def memory_cgroup(limit_bytes: int) -> Iterator[str]:
    """A child of this process's memory cgroup with ``limit_bytes``; yields its
    cgroup.procs (a process writes 0 there to enter it). Removed after."""
    dirs = cgroup_dirs("memory")
    if dirs is None:
        pytest.skip("no memory cgroup controller here")
    path = os.path.join(dirs.paths[0], f"kvoffload-test-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(path)
    except OSError as exc:
        pytest.skip(f"cannot make a cgroup under {dirs.paths[0]}: {exc}")
    try:
        limit_file = "memory.max" if dirs.version == 2 else "memory.limit_in_bytes"
        try:
            Path(path, limit_file).write_text(f"{limit_bytes}\n")
        except OSError as exc:  # v2 without the memory controller delegated there
            pytest.skip(f"cannot limit {path}: {exc}")
        yield os.path.join(path, "cgroup.procs")
    finally:
        for _ in range(100):  # the daemon just exited: its cgroup empties
            try:
                os.rmdir(path)
                break
            except OSError:
                import time

                time.sleep(0.05)


def entering(procs: str) -> Callable[[], None]:
    def enter() -> None:
        with open(procs, "w") as f:
            f.write("0\n")

    return enter


@needs_root
def test_a_cgroup_too_small_for_the_region_refuses_the_start() -> None:
    """Scenario (the issue's): a 3 GiB memory limit and a 4 GiB region. Before, the
    daemon listened and was OOM-killed by its own pre-fault 2 s later, nothing in its
    log; now it refuses to start, names the limit and says how to fix it."""
    with memory_cgroup(3 * GIB) as procs:
        said = run_refused("--region-size", "4GiB", settings={}, preexec=entering(procs))
    assert "cannot start: the region does not fit in the memory cgroup" in said
    assert "memory.max" in said or "memory.limit_in_bytes" in said
    assert re.search(r"3\.\d\d GiB more for the region plus 1\.00 GiB of memory_headroom", said)
    assert "MemoryMax=" in said and "resources.limits.memory" in said
    assert "lower region_size to at most" in said


@needs_root
def test_without_the_check_the_same_daemon_is_oom_killed() -> None:
    """What the check prevents, shown: the daemon listens, then dies of its region."""
    with memory_cgroup(3 * GIB) as procs:
        d = DaemonProcess(
            "4GiB",
            "--log-level",
            "warning",
            settings={"check_memory_limits": False},
            preexec=entering(procs),
        )
        d.start()
        try:
            assert d.proc is not None
            rc = d.proc.wait(60)
            assert rc == -9  # SIGKILL: the OOM killer
        finally:
            d.kill()
            drop_kept_region(d.socket_path, d.instance)


@needs_root
def test_a_region_that_fits_its_cgroup_comes_up_whole() -> None:
    with (
        memory_cgroup(3 * GIB) as procs,
        DaemonProcess(
            "1GiB",
            "--log-level",
            "warning",
            preexec=entering(procs),
        ) as d,
    ):
        client = kvoffload.connect(d.socket_path)
        poll(lambda: populated(client), "the region populated")
        assert d.alive()
        client.close()


# ------------------------------------------------------------------ huge pages


@contextlib.contextmanager
def huge_pages_mounted(pages: int) -> Iterator[str]:
    """``pages`` more 2 MiB pages reserved and a hugetlbfs mount of them; both given
    back after."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    before = int(Path(HUGE_NR).read_text())
    mount = tempfile.mkdtemp(prefix="kvoffload-huge-")
    mounted = False
    try:
        Path(HUGE_NR).write_text(f"{before + pages}\n")
        got = int(Path(HUGE_NR).read_text())
        if got < before + pages:
            pytest.skip(f"could reserve only {got - before} of {pages} huge pages")
        subprocess.run(
            ["mount", "-t", "hugetlbfs", "-o", "pagesize=2M,mode=0700", "none", mount],
            check=True,
            capture_output=True,
        )
        mounted = True
        yield mount
    finally:
        if mounted:
            for entry in os.listdir(mount):
                os.unlink(os.path.join(mount, entry))
            subprocess.run(["umount", mount], check=True)
        os.rmdir(mount)
        Path(HUGE_NR).write_text(f"{before}\n")


def test_a_region_in_reserved_huge_pages_survives_a_restart() -> None:
    with huge_pages_mounted(544) as mount:  # 1 GiB and 64 MiB more
        settings = {"huge_pages": "2M", "region_dir": mount, "keep_region": True}
        d1 = DaemonProcess("1GiB", "--log-level", "warning", settings=settings).start()
        keys = [b"huge%04d" % i for i in range(64)]
        try:
            client = kvoffload.connect(d1.socket_path)
            poll(lambda: populated(client), "the region populated")
            region = client.stats()["region"]
            assert region["page_bytes"] == 2 * MIB
            assert region["huge_page_bytes"] >= region["data_bytes"]
            (name,) = os.listdir(mount)
            assert f"/{name}" == d1.region_name
            store_blocks(client, "huge", keys, page_bytes=64 * 1024)
            client.close()
            assert d1.stop() == 0
            d2 = DaemonProcess(
                "1GiB",
                "--log-level",
                "warning",
                instance=d1.instance,
                socket_path=d1.socket_path,
                settings=settings,
            ).start()
        except BaseException:
            d1.kill()
            raise
        try:
            assert d2.region_name == d1.region_name
            client = kvoffload.connect(d2.socket_path)
            poll(lambda: client.stats()["region"]["ready_bytes"] > 0, "the kept region ready")
            region = client.stats()["region"]
            assert region["resident_at_start_bytes"] == region["data_bytes"]
            ns = client.namespace("huge", kvoffload.KVLayout(tensor_page_bytes=[64 * 1024]))
            assert ns.lookup(keys) == len(keys)
            client.close()
        finally:
            d2.stop()
            drop_kept_region(d2.socket_path, d2.instance)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(mount, d2.region_name.lstrip("/")))


def test_too_few_reserved_huge_pages_refuse_the_start() -> None:
    with huge_pages_mounted(128) as mount:  # 256 MiB for a 1 GiB region
        said = run_refused(
            "--region-size", "1GiB", settings={"huge_pages": "2M", "region_dir": mount}
        )
    assert "the region does not fit in the 2M huge pages" in said
    assert f"> {HUGE_NR}" in said and "echo " in said


@needs_root
def test_transparent_huge_pages_on_a_tmpfs_mounted_for_them() -> None:
    mount = tempfile.mkdtemp(prefix="kvoffload-thp-")
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1G,huge=within_size,mode=0700", "none", mount],
        check=True,
    )
    try:
        settings = {"huge_pages": "thp", "region_dir": mount}
        with DaemonProcess("512MiB", "--log-level", "warning", settings=settings) as d:
            client = kvoffload.connect(d.socket_path)
            poll(lambda: populated(client), "the region populated")
            region = client.stats()["region"]
            assert region["huge_page_bytes"] > 0  # the kernel gave huge pages
            client.close()
        # and /dev/shm, mounted without huge pages, is refused with the fix
        said = run_refused("--region-size", "64MiB", settings={"huge_pages": "thp"})
        assert "mount -o remount,huge=within_size" in said or "shmem_enabled" in said
    finally:
        for entry in os.listdir(mount):
            os.unlink(os.path.join(mount, entry))
        subprocess.run(["umount", mount], check=True)
        os.rmdir(mount)


# ------------------------------------------------------------------ placement


def test_pages_sit_on_the_node_the_stats_say() -> None:
    """Real placement on this machine: the test maps the region itself and asks the
    kernel (move_pages, get_mempolicy) where sampled pages of each part lie."""
    with DaemonProcess("256MiB", "--log-level", "warning") as d:
        client = kvoffload.connect(d.socket_path)
        poll(lambda: populated(client), "the region populated")
        stats = client.stats()
        nodes = stats["numa_nodes"]
        data_bytes = stats["region"]["data_bytes"]
        assert sum(n["bytes"] for n in nodes.values()) == data_bytes
        fd = os.open(f"/dev/shm{d.region_name}", os.O_RDONLY)
        try:
            size = stats["region"]["region_bytes"]
            mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
            view = np.frombuffer(mm, dtype=np.uint8)
            base = view.ctypes.data
            data = size - data_bytes
            samples = [base + data + i * MIB for i in range(0, data_bytes // MIB, 7)]
            for a in samples:
                ctypes.c_char.from_address(a).value  # noqa: B018 - map the page here
            where = kernel.nodes_of_pages(samples)
            assert kernel.node_of_page(samples[0]) == where[0]
            del view
            mm.close()
        finally:
            os.close(fd)
        (node,) = [k for k in nodes if k != "all"] or ["0"]
        assert set(where) == {int(node)}
        assert nodes[node]["local_ratio"] == 1.0
        client.close()


def test_a_kept_region_comes_back_resident_not_populated_again() -> None:
    d1 = DaemonProcess("256MiB", "--log-level", "warning", "--keep-region").start()
    try:
        client = kvoffload.connect(d1.socket_path)
        poll(lambda: populated(client), "the region populated")
        client.close()
        assert d1.stop() == 0
        path = f"/dev/shm{d1.region_name}"
        blocks_before = os.stat(path).st_blocks
        with DaemonProcess(
            "256MiB",
            "--log-level",
            "warning",
            instance=d1.instance,
            socket_path=d1.socket_path,
        ) as d2:
            client = kvoffload.connect(d2.socket_path)
            poll(lambda: populated(client), "the region mapped")
            region = client.stats()["region"]
            assert region["resident_at_start_bytes"] == region["data_bytes"]
            assert region["ready_bytes"] == region["data_bytes"]
            assert os.stat(path).st_blocks == blocks_before
            client.close()
    finally:
        d1.kill()
        drop_kept_region(d1.socket_path, d1.instance)


# ------------------------------------------------------------------ kvoffloadctl check


def ctl_check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvoffloadctl", "check", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_check_reports_the_node_and_whether_the_region_fits(tmp_path: Path) -> None:
    cfg = tmp_path / "k.toml"
    cfg.write_text('region_size = "256MiB"\n')
    ok = ctl_check("--config", str(cfg))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    for needle in ("limits:", "host memory", "NUMA nodes:", "node 0:", "fits this node"):
        assert needle in ok.stdout
    too_big = ctl_check("--config", str(cfg), "--region-size", "64TiB")
    assert too_big.returncode == 4
    assert "does not fit" in too_big.stdout and "Fix:" in too_big.stdout
    as_json = ctl_check("--config", str(cfg), "--json")
    import json

    report = json.loads(as_json.stdout)
    assert report["fits"] and report["region"]["region_bytes"] <= 256 * MIB
    whats = {lim["what"] for lim in report["limits"]}
    assert "host memory (MemAvailable in /proc/meminfo)" in whats
    bad = ctl_check("--config", str(cfg), "--region-size", "lots")
    assert bad.returncode == 2 and "region_size" in bad.stderr
