"""One client connection's state as the service sees it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvoffloadd.access import Peer


@dataclass
class Wait:
    """One WaitJobs request, answered once none of its jobs is left."""

    rid: int
    pending: set[int]  # job ids not finished yet


@dataclass
class Session:
    session_id: int
    pid: int
    uid: int
    gid: int
    name: str = ""
    fds: list[int] = field(default_factory=list)
    # descriptors that go out with the reply of this request id (one entry per reply:
    # two attaches finishing in one drain each take their own)
    out_fds: dict[int, list[int]] = field(default_factory=dict)
    snapshots: dict[int, list[bytes]] = field(default_factory=dict)  # SyncKeys, one at most
    snapshot_bytes: int = 0  # what the snapshot is charged
    namespaces: set[int] = field(default_factory=set)
    writable: set[int] = field(default_factory=set)  # the namespaces it may store into
    leases: dict[int, int] = field(default_factory=dict)  # ns -> this connection's token
    want_leases: dict[int, int] = field(default_factory=dict)  # ns -> slots to keep leased
    push_feeds: set[int] = field(default_factory=set)  # namespaces whose events are pushed
    pushes: list[Any] = field(default_factory=list)  # messages to send unasked
    workers: set[int] = field(default_factory=set)
    # (worker, job id) -> the WaitJobs requests waiting for that job: a finished job
    # ends only the waits on it, however many others the connection keeps
    waits: dict[tuple[int, int], list[Wait]] = field(default_factory=dict)
    bytes_stored: int = 0
    bytes_loaded: int = 0
    connected_s: float = field(default_factory=time.monotonic)
    peer: Peer = field(default_factory=lambda: Peer(0, 0, frozenset()))
    allowed: bool = True
