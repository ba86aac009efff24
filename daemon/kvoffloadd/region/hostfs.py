"""Where things are mounted and which cgroups hold this process (procfs, read only).

Rules:
- Read under a root directory (``/`` on a node, a fake tree in tests): the mount
  table is ``/proc/self/mountinfo``, the cgroups ``/proc/self/cgroup``; mount points
  found there are read under the same root.
- cgroup v2 (one ``0::`` line, the ``cgroup2`` mount) and v1 (one hierarchy per
  controller, a ``cgroup`` mount whose options name it) are both followed, hybrid
  hosts included; a container's cgroup namespace shows its own cgroup as ``/``.
- A cgroup's ancestors inside the mount are listed too: a limit anywhere above the
  process binds it (a Kubernetes pod's limit sits one level above its container's).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Mount:
    root: str  # the directory of the filesystem mounted there
    point: str
    fstype: str
    source: str
    options: tuple[str, ...]  # mount options, then the filesystem's own

    def option(self, key: str) -> str | None:
        """The value of ``key=value`` (the last one wins), ``""`` for a bare flag."""
        found = None
        for opt in self.options:
            name, eq, value = opt.partition("=")
            if name == key:
                found = value if eq else ""
        return found


def _unescape(field: str) -> str:
    return field.encode().decode("unicode_escape") if "\\" in field else field


def read_text(root: str, path: str) -> str | None:
    try:
        with open(os.path.join(root, path.lstrip("/"))) as f:
            return f.read()
    except OSError:
        return None


def mounts(root: str = "/") -> list[Mount]:
    out = []
    for line in (read_text(root, "/proc/self/mountinfo") or "").splitlines():
        head, sep, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if not sep or len(fields) < 6 or len(rest) < 2:
            continue
        supers = rest[2].split(",") if len(rest) > 2 else []
        out.append(
            Mount(
                _unescape(fields[3]),
                _unescape(fields[4]),
                rest[0],
                rest[1],
                tuple(fields[5].split(",") + supers),
            )
        )
    return out


def mount_of(path: str, table: list[Mount]) -> Mount | None:
    """The mount that ``path`` lies on (the longest mount point above it)."""
    best = None
    norm = os.path.normpath(path)
    for m in table:
        under = norm == m.point or norm.startswith(m.point.rstrip("/") + "/")
        if under and (best is None or len(m.point) >= len(best.point)):
            best = m
    return best


@dataclass(frozen=True)
class CgroupDirs:
    version: int  # 1 or 2
    paths: list[str]  # the cgroup's directory (under root), then each ancestor in the mount
    names: list[str]  # the same as the cgroup hierarchy names them ("/kubepods/pod1/c1")


def cgroup_dirs(controller: str, root: str = "/") -> CgroupDirs | None:
    """Directories of this process's cgroup for ``controller`` ("memory", "cpu",
    "hugetlb"), own first; None when no hierarchy has it."""
    table = mounts(root)
    for line in (read_text(root, "/proc/self/cgroup") or "").splitlines():
        hid, controllers, path = [*line.split(":", 2), "", ""][:3]
        if hid == "0" and controllers == "":
            version = 2
            found = [
                m
                for m in table
                if m.fstype == "cgroup2"
                and controller in (read_text(root, f"{m.point}/cgroup.controllers") or "").split()
            ]
        elif controller in controllers.split(","):
            version = 1
            found = [m for m in table if m.fstype == "cgroup" and controller in m.options]
        else:
            continue
        for m in found:
            paths, names = _walk(root, m, path)
            if paths:
                return CgroupDirs(version, paths, names)
    return None


def _under(m: Mount, cgroup_path: str) -> str:
    rel = cgroup_path
    if m.root != "/" and (rel == m.root or rel.startswith(m.root.rstrip("/") + "/")):
        rel = rel[len(m.root.rstrip("/")) :]
    return m.point.rstrip("/") + (rel if rel.startswith("/") else "/" + rel).rstrip("/")


def _walk(root: str, m: Mount, cgroup_path: str) -> tuple[list[str], list[str]]:
    at, name = _under(m, cgroup_path), cgroup_path.rstrip("/") or "/"
    paths, names = [], []
    while True:
        full = os.path.join(root, at.lstrip("/"))
        if os.path.isdir(full):
            paths.append(full)
            names.append(name)
        if at.rstrip("/") == m.point.rstrip("/") or at in ("/", ""):
            return paths, names
        at = os.path.dirname(at.rstrip("/"))
        name = os.path.dirname(name.rstrip("/")) or "/"


HUGE_SMAPS_FIELDS = ("ShmemPmdMapped", "FilePmdMapped", "Shared_Hugetlb", "Private_Hugetlb")


def huge_mapped_bytes(address: int, root: str = "/") -> int:
    """Bytes of this process's mapping at ``address`` mapped by huge pages (THP or
    hugetlbfs), from /proc/self/smaps."""
    inside = False
    total = 0
    for line in (read_text(root, "/proc/self/smaps") or "").splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:
            lo, _, hi = head.partition("-")
            try:
                inside = int(lo, 16) <= address < int(hi, 16)
            except ValueError:
                inside = False
        elif inside:
            key, _, rest = line.partition(":")
            if key in HUGE_SMAPS_FIELDS:
                total += int(rest.split()[0]) << 10
    return total
