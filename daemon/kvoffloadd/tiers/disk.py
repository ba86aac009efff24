"""Disk tier: one file per block under a directory, bounded by a byte budget, LRU.

Rules:
- Layout: ``<path>/<tier id>/<first two hex digits of the key>/<key hex>.kvb``. Each
  namespace directory has a ``NAMESPACE`` file that names it for people.
- A file is a header (magic, CRC32 of the payload, key length, payload length), the
  key, then the block. It is written under a temporary name and renamed into place,
  so a crash leaves a whole file or a ``*.tmp`` file, which the next start deletes. A
  load checks magic, key, length and (``verify``) the CRC, and drops a file that fails.
- The view (key -> file bytes, in LRU order) belongs to the loop thread. A thread scans
  the files found at start and the loop merges them as the oldest entries, by mtime; a
  block read for a promotion is touched (its mtime too, so the order survives restarts).
- Space is reserved on the loop thread before a write is queued: the least recently
  used files leave the view and are unlinked by a worker. A file being read is never
  chosen; a key whose unlink is still queued is not written again until it has run.
- The directory is trusted only if it is the daemon's own (``trust.secure_dir``: a
  real directory, not writable by others, under directories nobody else can change);
  block files are opened with ``O_NOFOLLOW`` and read only if regular.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import struct
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..crc import crc32
from ..trust import UntrustedError, secure_dir
from .base import SecondaryTier, TierError, TierJob, TierNamespace, TierResult

log = logging.getLogger(__name__)

MAGIC = b"KVOBLK01"
_HEADER = struct.Struct("<8sIIQ")  # magic, crc32 of payload, key bytes, payload bytes
_SUFFIX = ".kvb"
CLOSE_TIMEOUT_S = 10.0

Entry = tuple[str, bytes]  # (tier id, key)


def file_bytes(key: bytes, block_bytes: int) -> int:
    return _HEADER.size + len(key) + block_bytes


class DiskTier(SecondaryTier):
    kind = "disk"

    def __init__(
        self,
        name: str,
        path: str,
        capacity_bytes: int,
        wake: Any,
        threads: int = 4,
        fsync: bool = False,
        verify: bool = True,
    ) -> None:
        super().__init__(name, capacity_bytes, wake)
        self.path = os.path.abspath(path)
        try:
            secure_dir(self.path, 0o700)
        except UntrustedError as exc:
            raise TierError(f"tier {name}: {exc}") from None
        except OSError as exc:
            raise TierError(f"tier {name}: cannot create {self.path}: {exc.strerror}") from exc
        if not os.access(self.path, os.W_OK | os.X_OK):
            raise TierError(f"tier {name}: {self.path} is not writable by kvoffloadd")
        self._fsync = fsync
        self._verify = verify
        self._lru: OrderedDict[Entry, int] = OrderedDict()
        self.used_bytes = 0  # files in the view plus space reserved for queued writes
        self._writing: dict[Entry, int] = {}  # reserved bytes
        self._reading: Counter[Entry] = Counter()
        self._doomed: set[Entry] = set()  # unlink queued
        self._jobs: dict[int, tuple[bool, list[Entry]]] = {}
        self.scanned = False
        self._stopping = False
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=f"kvoffload-{name}")
        self._scanner = threading.Thread(target=self._scan, name=f"kvoffload-{name}-scan")
        self._scanner.daemon = True
        self._scanner.start()

    # ------------------------------------------------------------ loop thread

    def open_namespace(self, ns: TierNamespace) -> None:
        self._pool.submit(self._write_label, ns)

    def lookup(self, ns: TierNamespace, keys: Sequence[bytes]) -> list[bool]:
        lru = self._lru
        tid = ns.tier_id
        return [(tid, k) in lru for k in keys]

    def submit_store(self, job: TierJob) -> None:
        entries = [(job.ns.tier_id, k) for k in job.keys]
        todo: list[int] = []
        for i, e in enumerate(entries):
            if e in self._lru or e in self._writing:
                continue  # written once
            if e in self._doomed or not self._reserve(file_bytes(e[1], job.ns.block_bytes)):
                todo.append(-1 - i)  # cannot write it now: fails
                continue
            self._writing[e] = file_bytes(e[1], job.ns.block_bytes)
            todo.append(i)
        self._jobs[job.job_id] = (True, entries)
        self._pool.submit(self._write, job, entries, todo)

    def submit_load(self, job: TierJob) -> None:
        entries = [(job.ns.tier_id, k) for k in job.keys]
        self._reading.update(entries)
        self._jobs[job.job_id] = (False, entries)
        self._pool.submit(self._read, job, entries)

    def get_finished(self) -> list[TierResult]:
        out = []
        for kind, item in self.finished.take():
            if kind == "scan":
                self._merge_scan(item)
            elif kind == "unlinked":
                self._doomed.difference_update(item)
            else:
                self._apply(item)
                out.append(item)
        return out

    def _apply(self, r: TierResult) -> None:
        store, entries = self._jobs.pop(r.job_id)
        self.counters.count(store, r)
        for e, ok in zip(entries, r.ok):
            if store:
                reserved = self._writing.pop(e, None)
                if reserved is not None:
                    if ok:
                        self._lru[e] = reserved
                    else:
                        self.used_bytes -= reserved
            else:
                self._reading[e] -= 1
                if not self._reading[e]:
                    del self._reading[e]
                if ok and e in self._lru:
                    self._lru.move_to_end(e)
                elif not ok:
                    self._drop([e])

    def _reserve(self, nbytes: int) -> bool:
        """Make room for ``nbytes`` by dropping least recently used files."""
        if nbytes > self.capacity_bytes:
            return False
        victims: list[Entry] = []
        freed = 0
        over = self.used_bytes + nbytes - self.capacity_bytes
        if over > 0:
            for e, size in self._lru.items():
                if e not in self._reading:
                    victims.append(e)
                    freed += size
                    if freed >= over:
                        break
            if freed < over:
                return False
        self._drop(victims)
        self.counters.evicted_blocks_total += len(victims)
        self.used_bytes += nbytes
        return True

    def _drop(self, entries: list[Entry]) -> None:
        gone = [e for e in entries if e in self._lru]
        for e in gone:
            self.used_bytes -= self._lru.pop(e)
        if gone:
            self._doomed.update(gone)
            self._pool.submit(self._unlink, gone)

    def _merge_scan(self, found: list[tuple[Entry, int]]) -> None:
        """Files from before this start become the oldest entries (``found`` is sorted
        oldest first); beyond the budget, the oldest go."""
        for e, size in reversed(found):
            if e not in self._lru and e not in self._writing:
                self._lru[e] = size
                self._lru.move_to_end(e, last=False)
                self.used_bytes += size
        over = self.used_bytes - self.capacity_bytes
        victims: list[Entry] = []
        for e, size in self._lru.items():
            if over <= 0:
                break
            if e not in self._reading:
                victims.append(e)
                over -= size
        self._drop(victims)
        self.counters.evicted_blocks_total += len(victims)
        self.scanned = True
        log.info(
            "tier %s: %d blocks (%d bytes) found under %s",
            self.name,
            len(found),
            sum(s for _, s in found),
            self.path,
        )

    def statistics(self) -> dict[str, Any]:
        out = self.base_statistics(len(self._lru), self.used_bytes, healthy=True)
        out.update(path=self.path, scanned=self.scanned, writing_blocks=len(self._writing))
        return out

    def close(self) -> None:
        """Stop; a thread stuck in I/O (a hung filesystem) is left behind, never
        waited for: the daemon's stop must finish."""
        self._stopping = True
        self._scanner.join(timeout=CLOSE_TIMEOUT_S)
        self._pool.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        for t in list(getattr(self._pool, "_threads", ())):
            t.join(timeout=max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                log.error("tier %s: an I/O thread is stuck; stopping without it", self.name)

    # ------------------------------------------------------------ worker threads

    def _file(self, e: Entry) -> str:
        h = e[1].hex()
        return os.path.join(self.path, e[0], h[:2] or "00", h + _SUFFIX)

    def _write(self, job: TierJob, entries: list[Entry], todo: list[int]) -> None:
        ok = [True] * len(entries)
        nbytes = 0
        for i in todo:
            if i < 0:
                ok[-1 - i] = False
                continue
            try:
                self._write_one(self._file(entries[i]), entries[i][1], job.buffers[i])
                nbytes += len(job.buffers[i])
            except OSError as exc:
                log.warning("tier %s: cannot write a block: %s", self.name, exc)
                ok[i] = False
        self.finished.post("job", job.result(ok, nbytes))

    def _write_one(self, path: str, key: bytes, data: memoryview) -> None:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        tmp = f"{path}.{os.getpid()}-{threading.get_ident()}.tmp"
        header = _HEADER.pack(MAGIC, crc32(data), len(key), len(data))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            written = os.writev(fd, [header, key, data])
            if written != len(header) + len(key) + len(data):
                raise OSError(f"short write to {tmp}")
            if self._fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        os.close(fd)
        os.rename(tmp, path)

    def _read(self, job: TierJob, entries: list[Entry]) -> None:
        ok = [False] * len(entries)
        nbytes = 0
        for i, e in enumerate(entries):
            try:
                ok[i] = self._read_one(self._file(e), e[1], job.buffers[i])
            except OSError as exc:
                log.warning("tier %s: cannot read a block: %s", self.name, exc)
            nbytes += len(job.buffers[i]) if ok[i] else 0
        self.finished.post("job", job.result(ok, nbytes))

    def _read_one(self, path: str, key: bytes, out: memoryview) -> bool:
        # A planted FIFO or device must not block the reader, nor a link lead elsewhere:
        # open without following or waiting, then insist on a regular file.
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return self._bad(path, "a symlink")
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return self._bad(path, "not a regular file")
        os.set_blocking(fd, True)
        with open(fd, "rb", buffering=0) as f:
            head = f.read(_HEADER.size + len(key))
            if len(head) != _HEADER.size + len(key):
                return self._bad(path, "truncated header")
            magic, crc, key_len, size = _HEADER.unpack_from(head)
            if magic != MAGIC or key_len != len(key) or head[_HEADER.size :] != key:
                return self._bad(path, "not a block of this key")
            if size != len(out):
                return self._bad(path, f"{size} bytes, the namespace has {len(out)}")
            if f.readinto(out) != size:
                return self._bad(path, "truncated block")
        if self._verify and crc32(out) != crc:
            return self._bad(path, "checksum mismatch")
        with contextlib.suppress(OSError):
            os.utime(path)  # recency survives a restart
        return True

    def _bad(self, path: str, why: str) -> bool:
        log.warning("tier %s: dropping %s: %s", self.name, path, why)
        return False

    def _unlink(self, entries: list[Entry]) -> None:
        for e in entries:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._file(e))
        self.finished.post("unlinked", entries)

    def _write_label(self, ns: TierNamespace) -> None:
        d = os.path.join(self.path, ns.tier_id)
        with contextlib.suppress(OSError):
            os.makedirs(d, mode=0o700, exist_ok=True)
            with open(os.path.join(d, "NAMESPACE"), "w") as f:
                f.write(f"name = {ns.name!r}\nfingerprint = {ns.fingerprint!r}\n")

    def _scan(self) -> None:
        """Every whole block file under the path; temporary files of a crash go."""
        found: list[tuple[float, Entry, int]] = []
        try:
            for tid in os.listdir(self.path):
                top = os.path.join(self.path, tid)
                if not os.path.isdir(top):
                    continue
                for sub in os.listdir(top):
                    if self._stopping:
                        return
                    d = os.path.join(top, sub)
                    if os.path.isdir(d):
                        found.extend(self._scan_dir(tid, d))
        except OSError as exc:
            log.warning("tier %s: scanning %s failed: %s", self.name, self.path, exc)
        found.sort(key=lambda t: t[0])
        self.finished.post("scan", [(e, size) for _, e, size in found])

    def _scan_dir(self, tid: str, d: str) -> list[tuple[float, Entry, int]]:
        out = []
        with os.scandir(d) as it:
            for de in it:
                if de.name.endswith(".tmp"):
                    if f".{os.getpid()}-" in de.name:
                        continue  # a write of this daemon, under way
                    with contextlib.suppress(OSError):
                        os.unlink(de.path)
                    continue
                if not de.name.endswith(_SUFFIX):
                    continue
                try:
                    key = bytes.fromhex(de.name[: -len(_SUFFIX)])
                    st = de.stat()
                except (ValueError, OSError):
                    continue
                out.append((st.st_mtime, (tid, key), st.st_size))
        return out
