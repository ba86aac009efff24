"""Which segment is the daemon's region: a name nobody can predict, recorded in the
daemon's private state.

/dev/shm is every uid's: a name the daemon could predict, another uid can take
first (a file, a link), and the daemon must refuse to adopt what it did not make; a
fixed name would let any local user keep the service from starting. So:

- A region's name is ``/kvoffload-<instance>@<16 random hex digits>``, drawn when the
  region is created ``O_CREAT|O_EXCL``; a name something already has is passed over
  for another draw. Its file is in /dev/shm, or in the directory of its backing
  (a hugetlbfs mount for huge pages, backing.py).
- The name, its directory and huge pages, and the geometry and format it was made
  with, are recorded in
  ``<state_dir>/kvoffload-<instance>.region``: a file in a directory only the
  daemon's uid (or root) can write (``secure_dir``), opened ``O_NOFOLLOW``, checked on
  its descriptor (regular, ours, 0600) and ``flock``ed for the daemon's life, as the
  lock file is (trust.py). Its home must outlive the region for a warm restart: the
  socket's directory by default (the unit's preserved RuntimeDirectory), a host path
  in Kubernetes (docs/operations.md).
- The record is written before the segment is made, in one write: a crash anywhere
  leaves a record naming nothing (a new region is made) or a segment this uid made.
- A recorded segment is adopted only if it is this uid's, held by no other daemon,
  made with today's geometry and format, and whole (segment.problem). Someone else's
  segment under the name is left alone and a new name drawn: nothing planted ever
  stops the start. A damaged one is dropped with one error line; one made with
  another geometry or format (the configuration changed) is refused unless
  ``discard`` says to drop it.
- Without a record, a segment under the old public name ``/kvoffload-<instance>``
  that this uid made, that no daemon holds and that is of an older format is an
  older kvoffloadd's region: removed, since nothing could recover it.
- A clean stop that removes the region removes its record; one that keeps it (and
  any crash) keeps the record.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from kvoffload.datapath.regionfmt import FORMAT_VERSION, HEADER, MAGIC
from kvoffloadd.region import segment
from kvoffloadd.region.backing import Backing
from kvoffloadd.region.placement import RegionPlan
from kvoffloadd.region.region import SharedOffloadRegion
from kvoffloadd.region.segment import SHM_DIR, Geometry, RegionError, SegmentFile
from kvoffloadd.region.topology import Topology
from kvoffloadd.trust import FileLock, UntrustedError

log = logging.getLogger(__name__)

RECORD_BYTES = 512  # one write, well under a page
MAX_NAME_DRAWS = 16


@dataclass(frozen=True)
class Recorded:
    region: str
    region_bytes: int
    extent_bytes: int
    min_slot_bytes: int
    format: int
    # records of older daemons have neither: a region in /dev/shm without huge pages
    huge_pages: str = "off"
    directory: str = SHM_DIR

    @staticmethod
    def of(name: str, g: Geometry, backing: Backing | None = None) -> Recorded:
        return Recorded(
            name,
            g.region_bytes,
            g.extent_bytes,
            g.min_slot_bytes,
            FORMAT_VERSION,
            backing.huge_pages if backing else "off",
            backing.directory if backing else SHM_DIR,
        )

    def made_like(self, g: Geometry, backing: Backing | None = None) -> bool:
        return self == Recorded.of(self.region, g, backing)


class RegionState:
    """This instance's region record, held for the daemon's life."""

    def __init__(
        self, state_dir: str, instance: str, draw: Callable[[], str] = lambda: secrets.token_hex(8)
    ) -> None:
        self.path = os.path.join(state_dir, f"kvoffload-{instance}.region")
        self.legacy_name = f"/kvoffload-{instance}"
        self._draw = draw
        self._lock = FileLock(self.path, None)
        self.recorded = self._read()

    def _read(self) -> Recorded | None:
        raw = os.pread(self._lock.fd, RECORD_BYTES + 1, 0)
        if not raw.strip():
            return None
        try:
            fields = json.loads(raw)
            rec = Recorded(**fields)
            ints = (rec.region_bytes, rec.extent_bytes, rec.min_slot_bytes, rec.format)
            if not re.fullmatch(rf"{re.escape(self.legacy_name)}@[0-9a-f]{{16}}", rec.region):
                raise ValueError(f"region {rec.region!r} is not a name this instance draws")
            if not isinstance(rec.directory, str) or not os.path.isabs(rec.directory):
                raise ValueError(f"directory {rec.directory!r} is not an absolute path")
            if not isinstance(rec.huge_pages, str):
                raise ValueError("huge_pages is not a string")
            if not all(type(v) is int for v in ints):
                raise ValueError("a size is not an integer")
        except (ValueError, TypeError) as exc:
            log.error("%s is unreadable (%s): ignored, a new region is made", self.path, exc)
            return None
        return rec

    def record(self, rec: Recorded) -> None:
        """Replace the record in one write."""
        text = json.dumps(dataclasses.asdict(rec)).encode()
        os.pwrite(self._lock.fd, text.ljust(RECORD_BYTES - 1) + b"\n", 0)
        os.fsync(self._lock.fd)
        self.recorded = rec

    def new_name(self) -> str:
        return f"{self.legacy_name}@{self._draw()}"

    def release(self, forget: bool) -> None:
        """Let go of the record; ``forget``: the region is gone, and the record with it."""
        self._lock.release(unlink=forget)


# called with the region's file before it is mapped: raises to refuse the start
BeforeMap = Callable[[SegmentFile, bool], None]


def open_region(
    state: RegionState,
    g: Geometry,
    *,
    discard: bool,
    backing: Backing | None = None,
    before_map: BeforeMap | None = None,
    plan: RegionPlan | None = None,
    topology: Topology | None = None,
) -> SharedOffloadRegion:
    """The daemon's region: the recorded one if it can be recovered, else a new one.
    ``before_map(file, recovered)`` may refuse it (limits.py) before a page is taken:
    a new file is removed then, a recovered one kept."""
    rec = state.recorded
    directory = backing.directory if backing else SHM_DIR
    if rec is None:
        _remove_legacy(state.legacy_name)
    else:
        shm = _adopt(rec, g, discard, backing)
        if shm is not None:
            if before_map is not None:
                try:
                    before_map(shm, True)
                except BaseException:
                    shm.close_fd()
                    raise
            return SharedOffloadRegion(
                rec.region, g, found=(shm, True), plan=plan, topology=topology
            )
    for _ in range(MAX_NAME_DRAWS):
        name = state.new_name()
        # recorded before the segment is made: no crash leaves one unnamed
        state.record(Recorded.of(name, g, backing))
        try:
            shm = segment.create(name, g, directory)
        except FileExistsError:
            log.warning("%s exists already (not this daemon's): drawing another name", name)
            continue
        if before_map is not None:
            try:
                before_map(shm, False)
            except BaseException:
                shm.close_fd()
                segment.drop(name, directory)
                raise
        return SharedOffloadRegion(name, g, found=(shm, False), plan=plan, topology=topology)
    raise RegionError(f"{MAX_NAME_DRAWS} random region names were all taken in {directory}")


def _adopt(
    rec: Recorded, g: Geometry, discard: bool, backing: Backing | None
) -> SegmentFile | None:
    """The recorded segment, checked and held, if it can be recovered."""
    name = rec.region
    shm = None
    try:
        shm = segment.find(name, rec.directory)
        if shm is None:
            log.info("region %s is gone (a reboot?): a new one is made", name)
            return None
        segment.check_ours(shm, name, "left alone")
    except UntrustedError as exc:
        if shm is not None:
            shm.close_fd()
        log.error("%s; the region gets a new name", exc)
        return None
    segment.lock(shm, name)  # a live daemon's region is never touched
    if not rec.made_like(g, backing):
        made = f"region_size={rec.region_bytes}, extent_size={rec.extent_bytes}, "
        made += f"min_slot_size={rec.min_slot_bytes}, format {rec.format}, "
        made += f"huge_pages={rec.huge_pages} in {rec.directory}"
        huge, where = (backing.huge_pages, backing.directory) if backing else ("off", SHM_DIR)
        if not discard:
            shm.close_fd()
            raise RegionError(
                f"region {name} was made with {made}; this daemon has "
                f"region_size={g.region_bytes}, extent_size={g.extent_bytes}, "
                f"min_slot_size={g.min_slot_bytes}, format {FORMAT_VERSION}, "
                f"huge_pages={huge} in {where}: start with the old settings to keep "
                "its blocks, or with --discard-region to drop it"
            )
        log.warning("discarding region %s, made with %s", name, made)
    elif (why := segment.problem(shm, g)) is not None:
        log.error("region %s %s: damaged, dropped; a new one is made", name, why)
    else:
        return shm
    shm.close_fd()
    segment.drop(name, rec.directory)
    return None


def _remove_legacy(name: str) -> None:
    """An older kvoffloadd's region under the old public name, if this uid made it and
    nobody holds it; anything else there is left alone (and harmless now)."""
    shm = None
    try:
        shm = segment.find(name)
        if shm is None:
            return
        segment.check_ours(shm, name)
    except UntrustedError:
        if shm is not None:
            shm.close_fd()
        return
    try:
        segment.lock(shm, name)  # closes it if a daemon holds it
    except RegionError:
        return
    head = os.pread(shm.fd, HEADER.size, 0)
    shm.close_fd()
    if len(head) == HEADER.size:
        magic, version = HEADER.unpack(head)[:2]
        if magic == MAGIC and version < FORMAT_VERSION:
            log.warning("removed %s, an older kvoffloadd's region (format %d)", name, version)
            segment.drop(name)
