"""Requests, client to daemon: one tagged union (``Request``), and the sets of them
that travel one way, that a client checks before sending, and that bring descriptors.

Rules: those of ``schema``; every field whose size the sender chooses carries its
bound in its type.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from kvoffload.protocol.schema import (
    MAX_CLIENT_NAME_CHARS,
    MAX_FRAGMENTS,
    MAX_JOB_IDS,
    MAX_KEY_BYTES,
    MAX_TENSORS,
    Handle,
    Ids,
    Indexes,
    Keys,
    KVLayout,
    Message,
    Text,
    at_most,
)


class Hello(Message, frozen=True, tag="hello"):
    rid: int
    protocol_version: int
    client_name: Annotated[str, at_most(MAX_CLIENT_NAME_CHARS)] = ""
    pid: int = 0


class Ping(Message, frozen=True, tag="ping"):
    rid: int


class OpenNamespace(Message, frozen=True, tag="open_ns"):
    """Open (or create) a namespace. With ``join`` the namespace must exist already
    (NOT_FOUND otherwise) and ``layout`` is not compared: an engine's scheduler, which
    cannot know every rank's pages, joins what its workers created."""

    rid: int
    name: Text
    layout: KVLayout
    subscribe: bool = True  # queue the namespace's events for this connection
    join: bool = False


class Lookup(Message, frozen=True, tag="lookup"):
    rid: int
    ns: int
    keys: Keys
    key_bytes: int


class Probe(Message, frozen=True, tag="probe"):
    """Where each key is: in the region, being promoted from a secondary tier, or
    nowhere. Keys a tier holds start their promotion."""

    rid: int
    ns: int
    keys: Keys
    key_bytes: int


class PrepareStore(Message, frozen=True, tag="prep_store"):
    rid: int
    ns: int
    keys: Keys
    key_bytes: int


class CompleteStore(Message, frozen=True, tag="done_store"):
    rid: int
    ns: int
    keys: Keys
    key_bytes: int
    success: bool = True


class PrepareLoad(Message, frozen=True, tag="prep_load"):
    rid: int
    ns: int
    keys: Keys
    key_bytes: int


class CompleteLoad(Message, frozen=True, tag="done_load"):
    rid: int
    ns: int
    keys: Keys
    key_bytes: int


class Touch(Message, frozen=True, tag="touch"):
    rid: int
    ns: int
    keys: Keys
    key_bytes: int


class TakeEvents(Message, frozen=True, tag="events"):
    """Store/evict events of the namespace since this connection's last take."""

    rid: int
    ns: int


class SyncKeys(Message, frozen=True, tag="sync_keys"):
    """Page through the namespace's ready keys, for a client-side lookup mirror.

    ``offset`` 0 takes a snapshot of the ready keys *and* restarts this connection's
    event feed at that instant, so snapshot + later ``TakeEvents`` is exact. Further
    pages continue the same snapshot from ``KeysPage.next_offset``.
    """

    rid: int
    ns: int
    offset: int = 0
    push: bool = False  # after the snapshot, events are pushed (``FeedPush``), not taken


class StepBatch(Message, frozen=True, tag="step"):
    """One engine scheduler step's changes to a namespace, sent one-way (``rid`` 0).

    Applied in field order: ``claim_keys`` are stored into the engine's leased
    ``claim_slots``; ``pin_keys`` are loads the engine planned (pinned wherever the
    key's block is); ``unpin_keys`` loads that finished; ``commit_keys`` and
    ``fail_keys`` stores that finished (committed once every rank's copy landed) or
    were given up; ``touch_keys`` recency. Then ``ack_seq``: the engine's mirror has
    applied the feed up to there (-1: no change); ``want_leases``: how many empty
    slots the engine wants to hold (-1: no change). All keys are ``key_bytes`` long.
    """

    rid: int
    ns: int
    key_bytes: int
    claim_keys: Keys = b""
    claim_slots: Ids = b""
    pin_keys: Keys = b""
    unpin_keys: Keys = b""
    commit_keys: Keys = b""
    fail_keys: Keys = b""
    touch_keys: Keys = b""
    ack_seq: int = -1
    want_leases: int = -1


class CacheDesc(msgspec.Struct, frozen=True, array_like=True):
    """One canonical KV tensor of a worker: ``num_blocks`` rows of ``page_bytes``.

    ``kind`` is ``"memfd"`` (the descriptor at ``fd_index`` of the message's
    SCM_RIGHTS payload is mapped by the daemon) or ``"cuda"`` (``ipc_handle`` is the
    64-byte CUDA IPC handle of the allocation's base, on the worker's GPU). Rows start
    at ``offset_bytes`` (into the memfd or the allocation) and are ``row_stride_bytes``
    apart (0 means ``page_bytes``).
    """

    kind: Text
    num_blocks: int
    page_bytes: int
    fd_index: int = -1
    offset_bytes: int = 0
    row_stride_bytes: int = 0
    ipc_handle: Handle = b""


class CanonicalDesc(msgspec.Struct, frozen=True, array_like=True):
    """How a worker's page of one cache scatters into the cache's canonical page
    (``kvoffload.datapath.canonical``): ``frags`` packs int64 triples (local offset, canonical
    offset, bytes); ranks holding the same bytes take turns (``writer`` of ``writers``)."""

    page_bytes: int
    frags: Annotated[bytes, at_most(MAX_FRAGMENTS * 24)]
    writers: int = 1
    writer: int = 0


class AttachWorker(Message, frozen=True, tag="attach"):
    """CUDA workers add their GPU's UUID and the IPC handle of their store event.
    In a canonical namespace (world size 1) each of an engine's ``parts`` ranks
    attaches with ``canonical`` (one per cache) and writes its parts of every slot."""

    rid: int
    ns: int
    rank: int
    caches: Annotated[list[CacheDesc], at_most(MAX_TENSORS)]
    device_uuid: Handle = b""
    store_event: Handle = b""
    client_copy: bool = False  # the worker copies itself; the reply brings the region fd
    push: bool = False  # submits may be one-way; results are pushed (``JobsDone``)
    want_region: bool = False  # a daemon-copy worker's fallback mapping, if trusted
    parts: int = 1  # ranks of the engine that write parts of each slot (canonical)
    canonical: Annotated[list[CanonicalDesc], at_most(MAX_TENSORS)] = []


class DetachWorker(Message, frozen=True, tag="detach"):
    rid: int
    worker: int


class SubmitStore(Message, frozen=True, tag="sub_store"):
    """Copy engine blocks into slots. ``lease``: the engine's lease token the slots
    belong to (0: slots this connection prepared). ``deadline_ns``: CLOCK_MONOTONIC
    time after which the engine may reuse its blocks; a copy not finished by then is
    dropped (never committed). With ``rid`` 0 it is one-way (push workers)."""

    rid: int
    worker: int
    job_id: int
    block_ids: Ids
    slots: Ids
    caches: Indexes = []  # indices of the registered caches to copy; empty: all
    lease: int = 0
    deadline_ns: int = 0


class SubmitLoad(Message, frozen=True, tag="sub_load"):
    """Copy slots into engine blocks. With ``keys`` (one per slot) the daemon reads
    each key wherever its block is now, so the load needs no pin of its own and reads
    exactly those keys' bytes; without, every slot must be pinned by a prepare_load of
    this connection. A copy not started by ``deadline_ns`` is not started at all."""

    rid: int
    worker: int
    job_id: int
    slots: Ids
    block_ids: Ids
    skip: int = 0
    caches: Indexes = []
    keys: Keys = b""
    key_bytes: int = 0
    deadline_ns: int = 0


class Wrote(Message, frozen=True, tag="wrote"):
    """A client-copy worker copied a store into its engine's leased slots itself
    (one-way); the daemon counts this rank's copy as landed."""

    rid: int
    worker: int
    lease: int
    slots: Ids
    success: bool = True


class ClientCopyDone(Message, frozen=True, tag="copied"):
    """A client-copy worker finished (or failed) the copy of a submitted job."""

    rid: int
    worker: int
    job_id: int
    success: bool


class GetFinished(Message, frozen=True, tag="finished"):
    rid: int
    worker: int


class WaitJobs(Message, frozen=True, tag="wait"):
    rid: int
    worker: int
    job_ids: Annotated[list[int], at_most(MAX_JOB_IDS)]


class GetStats(Message, frozen=True, tag="stats"):
    rid: int


class ListClients(Message, frozen=True, tag="clients"):
    rid: int


class Evict(Message, frozen=True, tag="evict"):
    """Evict unpinned blocks of one namespace (or all): given keys, a key prefix, or all;
    at most ``MAX_STATE_KEYS`` per request (``EvictReply.evicted`` says how many)."""

    rid: int
    namespace: Text | None = None
    keys: Keys | None = None
    key_bytes: int = 0
    key_prefix: Annotated[bytes, at_most(MAX_KEY_BYTES)] | None = None


class GetConfig(Message, frozen=True, tag="config"):
    rid: int


class DropNamespace(Message, frozen=True, tag="drop_ns"):
    """Take one namespace away from every connection that has it open (each is told
    by a ``Notice`` naming it), then drop it: its blocks, extents, table entry and
    region record. Admins only; refused (``NO_SPACE``, nothing changed) while copies
    run in its slots. ``NamespaceDropped`` says what went."""

    rid: int
    namespace: Text


Request = (
    Hello
    | Ping
    | OpenNamespace
    | Lookup
    | Probe
    | PrepareStore
    | CompleteStore
    | PrepareLoad
    | CompleteLoad
    | Touch
    | TakeEvents
    | SyncKeys
    | StepBatch
    | Wrote
    | ClientCopyDone
    | AttachWorker
    | DetachWorker
    | SubmitStore
    | SubmitLoad
    | GetFinished
    | WaitJobs
    | GetStats
    | ListClients
    | Evict
    | GetConfig
    | DropNamespace
)

ONE_WAY: tuple[type[Message], ...] = (StepBatch, Wrote, SubmitStore, SubmitLoad)
# The requests whose fields come from users' and engines' choices (names, layouts,
# caches, admin input): a client checks their bounds before sending one, so a request
# the daemon would refuse at decode fails at once with a clear error. The others are
# built within their bounds by the library (keys and ids are split before them).
CHECKED_ON_SEND: frozenset[type[Message]] = frozenset(
    (Hello, OpenNamespace, AttachWorker, Evict, WaitJobs, DropNamespace)
)
# The requests whose reply may bring descriptors (SCM_RIGHTS: the region's, with a
# ``WorkerAttached``); the daemon sends none with any other message. A client reads
# other replies with no room for descriptors (the kernel would drop any that came).
BRINGS_FDS: tuple[type[Message], ...] = (AttachWorker,)
