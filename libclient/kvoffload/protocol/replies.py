"""Replies and pushes, daemon to client: one tagged union (``Reply``).

Rules: those of ``schema``. A reply echoes its request's ``rid``; a push (``PUSHES``)
has ``rid`` 0 and comes unasked. The daemon builds these, so their fields carry no
bounds of their own: a client's frame limit bounds what it reads.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvoffload.protocol.schema import (
    Message,
)


class Welcome(Message, frozen=True, tag="welcome"):
    rid: int
    protocol_version: int
    daemon_version: str
    instance: str
    pid: int
    region_name: str
    region_bytes: int


class Pong(Message, frozen=True, tag="pong"):
    rid: int


class OkReply(Message, frozen=True, tag="ok"):
    rid: int


class ErrorReply(Message, frozen=True, tag="error"):
    rid: int
    code: int
    message: str


class NamespaceOpened(Message, frozen=True, tag="ns"):
    rid: int
    ns: int
    slot_bytes: int
    fingerprint: str
    tiers: int = 0  # secondary tiers below the region: lookups may promote
    lease: int = 0  # this connection's lease token in the namespace


class ProbeReply(Message, frozen=True, tag="probed"):
    """One state per key (``KEY_ABSENT``, ``KEY_READY``, ``KEY_PROMOTING``), up to and
    including the first absent key."""

    rid: int
    states: bytes


class LookupReply(Message, frozen=True, tag="hits"):
    """``hits`` leading keys are stored and ready; ``None`` means ask again later."""

    rid: int
    hits: int | None


class StorePlanReply(Message, frozen=True, tag="store_plan"):
    rid: int
    keys: bytes
    key_bytes: int
    slots: bytes
    evicted_keys: bytes
    lease: int = 0  # the token workers name when they copy into these slots


class LoadPlanReply(Message, frozen=True, tag="load_plan"):
    rid: int
    slots: bytes


class EventMsg(msgspec.Struct, frozen=True, array_like=True):
    keys: bytes
    key_bytes: int
    removed: bool
    slots: bytes = b""  # stores: the slot of each key (packed int64)


class EventsReply(Message, frozen=True, tag="ev"):
    rid: int
    events: list[EventMsg]
    lost: bool = False  # events were dropped (feed overflow): resync with SyncKeys


class KeysPage(Message, frozen=True, tag="keys"):
    rid: int
    keys: list[bytes]
    next_offset: int  # -1: the snapshot is complete
    slots: bytes = b""  # the slot of each key (packed int64)
    seq: int = 0  # the feed position the snapshot was taken at


class CopyPlanReply(Message, frozen=True, tag="copy_plan"):
    """Runs a client-copy worker must copy: region offset, offset inside cache
    ``cache_index`` (both packed int64) and length, one entry per run."""

    rid: int
    region: bytes
    cache: bytes
    nbytes: bytes
    cache_index: bytes


class WorkerAttached(Message, frozen=True, tag="attached"):
    rid: int
    worker: int
    region_bytes: int = 0  # client-copy workers: the region's size (its fd comes along)


class JobResult(msgspec.Struct, frozen=True, array_like=True):
    job_id: int
    success: bool
    nbytes: int
    seconds: float
    error: int = 0  # the ErrorCode of a job the daemon refused or could not run


class FinishedReply(Message, frozen=True, tag="results"):
    rid: int
    results: list[JobResult]


class StatsReply(Message, frozen=True, tag="stats_r"):
    """Named sections of snake_case fields with units (see kvoffloadd.service.stats)."""

    rid: int
    sections: dict[str, Any]


class ClientInfo(msgspec.Struct, frozen=True, array_like=True):
    client_id: int
    pid: int
    uid: int
    name: str
    namespaces: list[str]
    workers: int
    pinned_blocks: int
    writing_blocks: int
    inflight_jobs: int
    bytes_stored: int
    bytes_loaded: int


class ClientsReply(Message, frozen=True, tag="clients_r"):
    rid: int
    clients: list[ClientInfo]


class EvictReply(Message, frozen=True, tag="evicted"):
    rid: int
    evicted: int


class NamespaceDropped(Message, frozen=True, tag="dropped_ns"):
    """What an admin's ``DropNamespace`` dropped: the stored blocks it held, and the
    connections that had it open (each told by a ``Notice``)."""

    rid: int
    blocks: int
    connections: int


class ConfigReply(Message, frozen=True, tag="config_r"):
    """The daemon's effective configuration (defaults, file and flags merged)."""

    rid: int
    config: dict[str, Any]


# ---------------------------------------------------------------------------- pushes


class FeedPush(Message, frozen=True, tag="feed"):
    """Events of a namespace a connection mirrors (``SyncKeys(push=True)``); ``seq``
    is the feed position after them, which the engine acks (``StepBatch.ack_seq``).
    ``lost``: events were dropped (the connection fell behind): resync."""

    rid: int
    ns: int
    seq: int
    events: list[EventMsg]
    lost: bool = False


class LeaseGrant(Message, frozen=True, tag="grant"):
    """Empty slots for this connection's stores in a namespace (its lease token)."""

    rid: int
    ns: int
    slots: bytes


class LeaseRevoke(Message, frozen=True, tag="revoke"):
    """Leased slots taken back (unused for ``lease_timeout_s``): no longer this
    connection's to claim; a new lease wish gets fresh ones."""

    rid: int
    ns: int
    slots: bytes


class JobsDone(Message, frozen=True, tag="done"):
    """Results of a push worker's jobs."""

    rid: int
    worker: int
    results: list[JobResult]


class Notice(Message, frozen=True, tag="notice"):
    """A one-way request was refused (``ns`` -1): nothing else about the connection
    changes. Or the connection lost namespace ``ns`` (the table took it back, or an
    admin dropped it): its leases, pins, stores and workers there are gone."""

    rid: int
    code: int
    message: str
    ns: int = -1


Reply = (
    Welcome
    | Pong
    | OkReply
    | ErrorReply
    | NamespaceOpened
    | LookupReply
    | ProbeReply
    | StorePlanReply
    | LoadPlanReply
    | EventsReply
    | KeysPage
    | CopyPlanReply
    | WorkerAttached
    | FinishedReply
    | StatsReply
    | ClientsReply
    | EvictReply
    | ConfigReply
    | NamespaceDropped
    | FeedPush
    | LeaseGrant
    | LeaseRevoke
    | JobsDone
    | Notice
)

PUSHES: tuple[type[Message], ...] = (FeedPush, LeaseGrant, LeaseRevoke, JobsDone, Notice)
