"""One client connection's state as the service sees it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .access import Peer


@dataclass
class Session:
    session_id: int
    pid: int
    uid: int
    gid: int
    name: str = ""
    fds: list[int] = field(default_factory=list)
    out_fds: list[int] = field(default_factory=list)  # go out with the next reply
    snapshots: dict[int, list[bytes]] = field(default_factory=dict)  # ns -> SyncKeys pages
    namespaces: set[int] = field(default_factory=set)
    workers: set[int] = field(default_factory=set)
    waits: list[tuple[int, int, set[int]]] = field(default_factory=list)  # rid, worker, jobs
    bytes_stored: int = 0
    bytes_loaded: int = 0
    connected_s: float = field(default_factory=time.monotonic)
    peer: Peer = field(default_factory=lambda: Peer(0, 0, frozenset()))
    allowed: bool = True
