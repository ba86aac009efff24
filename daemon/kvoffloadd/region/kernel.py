"""The memory system calls the region makes: populate, advise, place, and ask where.

Rules:
- Every call goes through one ``ctypes.CDLL`` handle of libc: ctypes releases the GIL
  for the length of a foreign call, so a thread faulting in gigabytes (or asking the
  kernel where pages sit) never holds up the loop or the copier threads
  (``tests/unit/test_populate.py`` checks that the handle releases it).
- NUMA calls have no glibc wrapper (libnuma has them): they go through ``syscall``
  with the number of this machine's architecture; on one without a number here they
  report ``ENOSYS``, which callers treat as "placement by thread affinity only".
- Errors come back as ``OSError`` with the errno; nothing here logs or retries.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import platform

MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23  # Linux 5.14
MPOL_DEFAULT, MPOL_PREFERRED, MPOL_BIND, MPOL_INTERLEAVE = 0, 1, 2, 3
MPOL_F_NODE, MPOL_F_ADDR = 1 << 0, 1 << 1
MAX_NODES = 1024  # bits in the node masks passed to the kernel

# (mbind, get_mempolicy, move_pages) by architecture
_SYSCALLS = {
    "x86_64": (237, 239, 279),
    "aarch64": (235, 236, 239),
    "ppc64le": (259, 260, 301),
}

libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)


def _raise(call: str) -> None:
    err = ctypes.get_errno()
    raise OSError(err, f"{call}: {os.strerror(err)}")


def madvise(address: int, nbytes: int, advice: int) -> None:
    if libc.madvise(address, nbytes, advice) != 0:
        _raise("madvise")


def resident_bytes(address: int, nbytes: int) -> int:
    """Bytes of the range that are in memory (``mincore``: for a shared file, whether
    a page is in its page cache, mapped here or not). The kernel answers per base page
    (4 KiB) whatever backs the range, huge pages too."""
    page = mmap.PAGESIZE
    pages = -(-nbytes // page)
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(address, nbytes, vec) != 0:
        _raise("mincore")
    return bytes(vec).count(1) * page  # bit 0: resident; the rest is reserved (0)


def _numbers() -> tuple[int, int, int] | None:
    return _SYSCALLS.get(platform.machine())


def _mask(nodes: list[int]) -> ctypes.Array[ctypes.c_ulong]:
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    mask = (ctypes.c_ulong * (MAX_NODES // bits))()
    for n in nodes:
        mask[n // bits] |= 1 << (n % bits)
    return mask


def mbind(address: int, nbytes: int, mode: int, nodes: list[int]) -> None:
    """Set the memory policy of a range; for shared memory the policy belongs to the
    object (every mapper's faults follow it). ``EPERM`` where a seccomp filter allows
    it only with CAP_SYS_NICE (Docker, containerd)."""
    nums = _numbers()
    if nums is None:
        raise OSError(errno.ENOSYS, "mbind: no syscall number for this architecture")
    mask = _mask(nodes)
    rc = libc.syscall(
        ctypes.c_long(nums[0]),
        ctypes.c_void_p(address),
        ctypes.c_ulong(nbytes),
        ctypes.c_int(mode),
        mask,
        ctypes.c_ulong(MAX_NODES + 1),
        ctypes.c_uint(0),
    )
    if rc != 0:
        _raise("mbind")


def policy_at(address: int) -> tuple[int, list[int]]:
    """(mode, nodes) of the memory policy in force at ``address``."""
    nums = _numbers()
    if nums is None:
        raise OSError(errno.ENOSYS, "get_mempolicy: no syscall number for this architecture")
    mode = ctypes.c_int(0)
    mask = _mask([])
    rc = libc.syscall(
        ctypes.c_long(nums[1]),
        ctypes.byref(mode),
        mask,
        ctypes.c_ulong(MAX_NODES + 1),
        ctypes.c_void_p(address),
        ctypes.c_ulong(MPOL_F_ADDR),
    )
    if rc != 0:
        _raise("get_mempolicy")
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    nodes = [i for i in range(MAX_NODES) if mask[i // bits] >> (i % bits) & 1]
    return mode.value, nodes


def node_of_page(address: int) -> int:
    """The node holding the page mapped at ``address`` (get_mempolicy MPOL_F_NODE|ADDR;
    the page is faulted in if it is not mapped yet)."""
    nums = _numbers()
    if nums is None:
        raise OSError(errno.ENOSYS, "get_mempolicy: no syscall number for this architecture")
    node = ctypes.c_int(-1)
    rc = libc.syscall(
        ctypes.c_long(nums[1]),
        ctypes.byref(node),
        None,
        ctypes.c_ulong(0),
        ctypes.c_void_p(address),
        ctypes.c_ulong(MPOL_F_NODE | MPOL_F_ADDR),
    )
    if rc != 0:
        _raise("get_mempolicy")
    return node.value


def nodes_of_pages(addresses: list[int]) -> list[int]:
    """The node of each page (``move_pages`` asked without moving anything); a
    negative errno where a page is not mapped (``-ENOENT``)."""
    nums = _numbers()
    if nums is None:
        raise OSError(errno.ENOSYS, "move_pages: no syscall number for this architecture")
    n = len(addresses)
    pages = (ctypes.c_void_p * n)(*addresses)
    status = (ctypes.c_int * n)()
    rc = libc.syscall(
        ctypes.c_long(nums[2]),
        ctypes.c_int(0),
        ctypes.c_ulong(n),
        pages,
        None,
        status,
        ctypes.c_int(0),
    )
    if rc != 0:
        _raise("move_pages")
    return list(status)
