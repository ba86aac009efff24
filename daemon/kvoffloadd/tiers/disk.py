"""Disk tier: one file per block under a directory, bounded by a byte budget, LRU.

Rules:
- Layout: ``<path>/<tier id>/<first two hex digits of the key>/<key hex>.kvb``. Each
  namespace directory has a ``NAMESPACE`` file that names it for people.
- A file is the block's seal (blockauth.py: magic, key id, length, keyed MAC over the
  namespace, the key and the bytes) followed by the block. It is written under a
  temporary name and renamed into place, so a crash leaves a whole file or a ``*.tmp``
  file, which the next start deletes. A load checks the seal before reading the block,
  and its MAC over each piece just read into the slot; a file that fails is a miss and
  is deleted (another secret, an older format, a forgery, a torn write).
- Loads run on the tier's promotion threads (``tier_threads``: a job's blocks spread
  over them, each read and hashed by one thread); writes, unlinks and labels on its
  I/O threads (``threads``).
- The view (key -> file bytes, in LRU order) belongs to the loop thread. A thread scans
  the files found at start and the loop merges them as the oldest entries, by mtime, in
  pieces of ``VIEW_CHUNK`` (at most ``MAX_SCAN_FILES`` files); a block read for a
  promotion is touched (its mtime too, so the order survives restarts).
- Space is reserved on the loop thread before a write is queued: the least recently
  used files leave the view and are unlinked by a worker. A file being read is never
  chosen; a key whose unlink is still queued is not written again until it has run.
- The directory is the daemon's alone (``trust.private_dir``: it and the directories
  above it up to one of the daemon's uid are writable by nobody else, or the start is
  refused). Nothing under it is reached by path: every file and subdirectory is opened
  from its parent's descriptor with ``O_NOFOLLOW`` (subdirectories must be the
  daemon's, block files regular), so no link planted there leads outside, and nothing
  outside it is created, written or deleted.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import stat
import threading
from collections import Counter, OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

from kvoffloadd.tiers.base import SecondaryTier, TierError, TierJob, TierNamespace, TierResult
from kvoffloadd.tiers.blockauth import SEAL, BlockMac, SealCheck
from kvoffloadd.tiers.remote import VIEW_CHUNK, VIEW_ENTRIES_PER_TURN
from kvoffloadd.tiers.spread import JobThreads
from kvoffloadd.trust import UntrustedError, private_dir

log = logging.getLogger(__name__)

MAGIC = b"KVOBLK02"  # a blockauth seal, then the block (KVOBLK01: a CRC-32, refused)
_SUFFIX = ".kvb"
MAX_SCAN_FILES = 1 << 22  # files a start-up scan takes at most (4M: 1 TiB of 256 KiB)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

Entry = tuple[str, bytes]  # (tier id, key)


def file_bytes(key: bytes, block_bytes: int) -> int:
    return SEAL.size + block_bytes


class UntrustedEntry(OSError):
    """Something under the tier directory that is not the daemon's: never used."""


class DiskTier(SecondaryTier):
    kind = "disk"

    def __init__(
        self,
        name: str,
        path: str,
        capacity_bytes: int,
        wake: Any,
        *,
        mac: BlockMac,
        threads: int = 4,
        tier_threads: int = 1,
        fsync: bool = False,
    ) -> None:
        path = os.path.abspath(path)
        try:
            dir_fd = private_dir(path)
        except UntrustedError as exc:
            raise TierError(f"tier {name}: {exc}") from None
        except OSError as exc:
            raise TierError(f"tier {name}: cannot create {path}: {exc.strerror}") from exc
        super().__init__(name, capacity_bytes, wake, tier_threads)  # the threads start
        self.path = path
        self._dir_fd = dir_fd
        self.seals = SealCheck(mac, name, MAGIC)
        self._fsync = fsync
        self._lru: OrderedDict[Entry, int] = OrderedDict()
        self.used_bytes = 0  # files in the view plus space reserved for queued writes
        self._writing: dict[Entry, int] = {}  # reserved bytes
        self._reading: Counter[Entry] = Counter()
        self._doomed: set[Entry] = set()  # unlink queued
        self._dropped_while_scanning: set[Entry] = set()  # the scan may have listed them
        self._jobs: dict[int, tuple[bool, list[Entry]]] = {}
        self.scanned = False
        self._found = 0  # blocks the start-up scan found
        self._stopping = False
        self._pool = JobThreads(threads, name)
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

        def read(i: int) -> bool:
            return self._read(job.ns, entries[i], job.buffers[i])

        def done(results: list[bool | None]) -> None:
            ok = [r is True for r in results]
            nbytes = sum(len(b) for b, good in zip(job.buffers, ok) if good)
            self.finished.post("job", job.result(ok, nbytes))

        self.tier_threads.spread(len(entries), job.ns.block_bytes, read, done)

    def get_finished(self) -> list[TierResult]:
        out = []
        budget = VIEW_ENTRIES_PER_TURN
        while budget > 0 and (posted := self.finished.next()) is not None:
            kind, item = posted
            if kind == "scan":
                self._merge_scan(*item)
            elif kind == "unlinked":
                self._doomed.difference_update(item)
            else:
                self._apply(item)
                out.append(item)
            budget -= len(item[0]) if kind == "scan" else len(item) if kind == "unlinked" else 1
        if self.finished.pending():
            self.finished.rewake()  # the rest next turn
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
            if not self.scanned:
                self._dropped_while_scanning.update(gone)
            self._pool.submit(self._unlink, gone)

    def _merge_scan(self, found: list[tuple[Entry, int]], last: bool) -> None:
        """Files from before this start become the oldest entries (``found`` is sorted
        oldest first, and comes before the pieces merged already); beyond the budget,
        the oldest go. A file dropped since the scan began is not taken back: the scan
        may have listed it before its unlink."""
        dropped = self._dropped_while_scanning
        for e, size in reversed(found):
            if e not in self._lru and e not in self._writing and e not in dropped:
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
        self._found += len(found)
        if last:
            self.scanned = True
            dropped.clear()
            log.info("tier %s: %d blocks found under %s", self.name, self._found, self.path)

    def statistics(self) -> dict[str, Any]:
        out = self.base_statistics(len(self._lru), self.used_bytes, healthy=True)
        out.update(path=self.path, scanned=self.scanned, writing_blocks=len(self._writing))
        return out

    def close(self) -> None:
        """Stop; a thread stuck in I/O (a hung filesystem) is left behind, never
        waited for: the daemon's stop must finish."""
        self._stopping = True
        if self.stop_threads(self._pool, [self._scanner]):  # else the descriptor stays
            os.close(self._dir_fd)

    # ------------------------------------------------------------ worker threads

    @staticmethod
    def _name(e: Entry) -> tuple[str, str]:
        """(fan-out subdirectory, file name) of an entry, under its namespace's."""
        h = e[1].hex()
        return h[:2] or "00", h + _SUFFIX

    def _file(self, e: Entry) -> str:
        """The file's path, for people (logs, tests): the tier never opens it by path."""
        sub, name = self._name(e)
        return os.path.join(self.path, e[0], sub, name)

    def _open_dir(self, parent_fd: int, name: str, create: bool) -> int:
        """A subdirectory of the tier, opened without following a link, and only if it
        is the daemon's own (created 0700 with ``create``)."""
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o700, dir_fd=parent_fd)
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            os.close(fd)
            raise UntrustedEntry(f"{name} is not kvoffloadd's own directory; not used")
        return fd

    def _block_dir(self, e: Entry, create: bool) -> int:
        ns_fd = self._open_dir(self._dir_fd, e[0], create)
        try:
            return self._open_dir(ns_fd, self._name(e)[0], create)
        finally:
            os.close(ns_fd)

    def _write(self, job: TierJob, entries: list[Entry], todo: list[int]) -> None:
        ok = [True] * len(entries)
        nbytes = 0
        for i in todo:
            if i < 0:
                ok[-1 - i] = False
                continue
            try:
                seal = self.seals.seal(job.ns, entries[i][1], job.buffers[i])
                self._write_one(entries[i], seal, job.buffers[i])
                nbytes += len(job.buffers[i])
            except OSError as exc:
                log.warning("tier %s: cannot write a block: %s", self.name, exc)
                ok[i] = False
        self.finished.post("job", job.result(ok, nbytes))

    def _write_one(self, e: Entry, seal: bytes, data: memoryview) -> None:
        d = self._block_dir(e, create=True)
        try:
            name = self._name(e)[1]
            tmp = f"{name}.{os.getpid()}-{threading.get_ident()}.tmp"
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=d)  # left by a write of this thread that failed
            fd = os.open(tmp, flags, 0o600, dir_fd=d)
            try:
                written = os.writev(fd, [seal, data])
                if written != len(seal) + len(data):
                    raise OSError(f"short write to {tmp}")
                if self._fsync:
                    os.fsync(fd)
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=d)
                raise
            os.close(fd)
            os.rename(tmp, name, src_dir_fd=d, dst_dir_fd=d)
        finally:
            os.close(d)

    def _read(self, ns: TierNamespace, e: Entry, out: memoryview) -> bool:
        """One block of a load, on a promotion thread."""
        try:
            return self._read_one(ns, e, out)
        except OSError as exc:
            log.warning("tier %s: cannot read a block: %s", self.name, exc)
            return False

    def _read_one(self, ns: TierNamespace, e: Entry, out: memoryview) -> bool:
        # A planted FIFO or device must not block the reader, nor a link lead elsewhere:
        # open without following or waiting, then insist on a regular file.
        what = self._file(e)
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        d = self._block_dir(e, create=False)
        try:
            fd = os.open(self._name(e)[1], flags, dir_fd=d)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return self._bad(what, "a symlink")
            raise
        finally:
            os.close(d)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return self._bad(what, "not a regular file")
            os.set_blocking(fd, True)
            seal = os.pread(fd, SEAL.size, 0)
            if not self.seals.check_head(seal, len(out), what):
                return False  # counted and logged once by the check
            # each piece is hashed just after it landed in the slot, while in the cache
            tag = self.seals.mac.read_and_hash(ns, e[1], out, fd, SEAL.size)
            if tag is None:
                return self._bad(what, "truncated block")
            if not self.seals.check_tag(seal, tag, what):
                return False
            with contextlib.suppress(OSError):
                os.utime(fd)  # recency survives a restart
        finally:
            os.close(fd)
        return True

    def _bad(self, path: str, why: str) -> bool:
        log.warning("tier %s: dropping %s: %s", self.name, path, why)
        return False

    def _unlink(self, entries: list[Entry]) -> None:
        for e in entries:
            with contextlib.suppress(OSError):  # gone already, or not ours: left alone
                d = self._block_dir(e, create=False)
                try:
                    os.unlink(self._name(e)[1], dir_fd=d)
                finally:
                    os.close(d)
        self.finished.post("unlinked", entries)

    def _write_label(self, ns: TierNamespace) -> None:
        """``<tier id>/NAMESPACE``, written beside and renamed over: a link planted at
        that name is replaced, never followed."""
        text = f"name = {ns.name!r}\nfingerprint = {ns.fingerprint!r}\n".encode()
        try:
            d = self._open_dir(self._dir_fd, ns.tier_id, create=True)
        except OSError as exc:
            log.warning("tier %s: cannot label %s: %s", self.name, ns.tier_id, exc)
            return
        tmp = f"NAMESPACE.{os.getpid()}-{threading.get_ident()}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=d)
            fd = os.open(tmp, flags, 0o600, dir_fd=d)
            try:
                os.write(fd, text)
            finally:
                os.close(fd)
            os.rename(tmp, "NAMESPACE", src_dir_fd=d, dst_dir_fd=d)
        except OSError as exc:
            log.warning("tier %s: cannot label %s: %s", self.name, ns.tier_id, exc)
        finally:
            os.close(d)

    def _scan(self) -> None:
        """Every block file under the path, reached through directory descriptors only;
        temporary files of a crash go. Posted in pieces, the newest piece first."""
        found: list[tuple[float, Entry, int]] = []
        try:
            for tid, ns_fd in self._subdirs(self._dir_fd):
                try:
                    self._scan_namespace(tid, ns_fd, found)
                finally:
                    os.close(ns_fd)
                if self._stopping:
                    return
                if len(found) >= MAX_SCAN_FILES:
                    break
        except OSError as exc:
            log.warning("tier %s: scanning %s failed: %s", self.name, self.path, exc)
        if len(found) >= MAX_SCAN_FILES:
            log.warning(
                "tier %s: the scan took the first %d files under %s; any others are not used",
                self.name,
                MAX_SCAN_FILES,
                self.path,
            )
        found.sort(key=lambda t: t[0], reverse=True)  # newest first
        pieces = [found[a : a + VIEW_CHUNK] for a in range(0, len(found), VIEW_CHUNK)] or [[]]
        for i, piece in enumerate(pieces):
            entries = [(e, size) for _, e, size in reversed(piece)]  # oldest first
            self.finished.post("scan", (entries, i == len(pieces) - 1))

    def _scan_namespace(self, tid: str, ns_fd: int, found: list[tuple[float, Entry, int]]) -> None:
        for _, sub_fd in self._subdirs(ns_fd):
            try:
                self._scan_dir(tid, sub_fd, found)
            finally:
                os.close(sub_fd)
            if self._stopping or len(found) >= MAX_SCAN_FILES:
                break

    def _subdirs(self, parent_fd: int) -> Iterator[tuple[str, int]]:
        """(name, descriptor) of the daemon's own subdirectories (at most
        ``MAX_SCAN_FILES``), opened one at a time; links and others' are skipped. The
        caller closes each descriptor."""
        with os.scandir(parent_fd) as it:
            dirs = (de.name for de in it if de.is_dir(follow_symlinks=False))
            names = list(itertools.islice(dirs, MAX_SCAN_FILES))
        for name in names:
            try:
                yield name, self._open_dir(parent_fd, name, create=False)
            except OSError:
                continue  # gone, a link swapped in, or not ours: skipped

    def _scan_dir(self, tid: str, d: int, found: list[tuple[float, Entry, int]]) -> None:
        """The block files of one subdirectory into ``found``, until it holds
        ``MAX_SCAN_FILES``."""
        with os.scandir(d) as it:
            for de in it:
                if len(found) >= MAX_SCAN_FILES or self._stopping:
                    break
                if not de.is_file(follow_symlinks=False):
                    continue
                if de.name.endswith(".tmp"):
                    if f".{os.getpid()}-" in de.name:
                        continue  # a write of this daemon, under way
                    with contextlib.suppress(OSError):
                        os.unlink(de.name, dir_fd=d)
                    continue
                if not de.name.endswith(_SUFFIX):
                    continue
                try:
                    key = bytes.fromhex(de.name[: -len(_SUFFIX)])
                    st = de.stat(follow_symlinks=False)
                except (ValueError, OSError):
                    continue
                if key and len(key) <= 64:
                    found.append((st.st_mtime, (tid, key), st.st_size))
