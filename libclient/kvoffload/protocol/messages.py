"""Wire messages: msgspec Structs in two tagged unions, one per direction.

Rules (msgspec schema evolution, see research/aesthetics.md section 4):
- Every Struct is ``array_like``: field order is the wire format. Only append fields,
  always with a default; never reorder, retype or remove one.
- Tags are explicit short strings, so renaming a class never changes the wire.
- Every request carries ``rid``, the request id its reply echoes; ids let a client
  pipeline requests and let both sides reject replies nobody asked for.
- One-way requests (``ONE_WAY``) are sent with ``rid`` 0 and get no reply: an engine
  never waits for them. What they produce comes back as pushes (``PUSHES``, ``rid``
  0), which the daemon sends unasked: the namespace's event feed, slot leases, job
  completions, and notices of one-way requests it refused.
- Keys travel packed: all keys of one message have the same length ``key_bytes`` and
  are concatenated into one ``bytes`` field. Block ids and slots travel as packed
  little-endian int64. Decoding a list of Python ints costs ~15 ns per element; a
  packed field costs nothing until it is used (research/stack.md section 4).
  ``kvoffload.protocol.packing`` packs and splits them.
- File descriptors never appear here: a message says how many it expects
  (``AttachWorker.caches[i].fd_index``) and the I/O layer moves them with SCM_RIGHTS.
- Every field of a request whose size the sender chooses (text, bytes, lists) carries
  its bound in its type (``msgspec.Meta(max_length=...)``): the decoder refuses a
  longer one before any handler sees it, so what a request can make the daemon hold or
  walk is bounded by its schema, not by each handler remembering to check.
  ``tests/unit/test_protocol_bounds.py`` walks every request type and fails on a field
  without one.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Any

import msgspec

PROTOCOL_VERSION = 8
DEFAULT_MAX_FRAME_BYTES = 16 * 1024 * 1024
MAX_KEY_BYTES = 64
MAX_KEYS_PER_MESSAGE = 65536  # bounds the loop time one request can take
# keys a request that changes blocks' state names at most (prepare/complete of stores
# and loads cost the daemon microseconds per key: a larger call goes in several)
MAX_STATE_KEYS = 8192
# Bounds of the request fields whose size the sender chooses (see the module's rules).
MAX_TEXT_CHARS = 4096  # a namespace name, a model id (a path), a dtype, a salt
MAX_CLIENT_NAME_CHARS = 256  # kept per connection for as long as it lasts
MAX_IDS_PER_MESSAGE = 1 << 20  # block ids or slots (packed int64) in one field
MAX_TENSORS = 4096  # KV tensors of one rank's layout, caches of one worker
MAX_HANDLE_BYTES = 256  # a CUDA IPC handle (64 bytes), a device UUID (16)
MAX_FRAGMENTS = 1 << 16  # a canonical cache's fragments (packed int64 triples)
MAX_JOB_IDS = 1 << 16  # jobs one WaitJobs names


def _most(n: int) -> msgspec.Meta:
    return msgspec.Meta(max_length=n)


Text = Annotated[str, _most(MAX_TEXT_CHARS)]
Keys = Annotated[bytes, _most(MAX_KEYS_PER_MESSAGE * MAX_KEY_BYTES)]  # packed keys
Ids = Annotated[bytes, _most(MAX_IDS_PER_MESSAGE * 8)]  # packed int64
Handle = Annotated[bytes, _most(MAX_HANDLE_BYTES)]
Indexes = Annotated[list[int], _most(MAX_TENSORS)]  # of a worker's caches
KEY_ABSENT, KEY_READY, KEY_PROMOTING = 0, 1, 2  # ProbeReply states


class _Msg(msgspec.Struct, frozen=True, array_like=True, tag_field="t", omit_defaults=False):
    pass


class KVLayout(msgspec.Struct, frozen=True, array_like=True):
    """How one engine's KV blocks look; the namespace fingerprint is derived from it.

    ``tensor_page_bytes`` lists the bytes one engine block occupies in each canonical
    KV tensor of one rank. One offloaded block holds ``block_size_factor`` engine blocks
    of every tensor of every one of the ``world_size`` ranks.
    """

    tensor_page_bytes: Annotated[list[int], _most(MAX_TENSORS)]
    world_size: int = 1
    block_size_factor: int = 1
    model: Text = ""
    kv_dtype: Text = ""
    salt: Text = ""

    @property
    def rank_bytes(self) -> int:
        """Bytes of one rank's share of one offloaded block."""
        return sum(self.tensor_page_bytes) * self.block_size_factor

    @property
    def block_bytes(self) -> int:
        """Bytes of one offloaded block, all ranks together (before slot alignment)."""
        return self.rank_bytes * self.world_size

    def fingerprint(self) -> str:
        """The namespace fingerprint: a hash of the layout's wire encoding."""
        return hashlib.sha256(msgspec.msgpack.encode(self)).hexdigest()[:32]


# --------------------------------------------------------------------------- requests


class Hello(_Msg, frozen=True, tag="hello"):
    rid: int
    protocol_version: int
    client_name: Annotated[str, _most(MAX_CLIENT_NAME_CHARS)] = ""
    pid: int = 0


class Ping(_Msg, frozen=True, tag="ping"):
    rid: int


class OpenNamespace(_Msg, frozen=True, tag="open_ns"):
    """Open (or create) a namespace. With ``join`` the namespace must exist already
    (NOT_FOUND otherwise) and ``layout`` is not compared: an engine's scheduler, which
    cannot know every rank's pages, joins what its workers created."""

    rid: int
    name: Text
    layout: KVLayout
    subscribe: bool = True  # queue the namespace's events for this connection
    join: bool = False


class Lookup(_Msg, frozen=True, tag="lookup"):
    rid: int
    ns: int
    keys: Keys
    key_bytes: int


class Probe(_Msg, frozen=True, tag="probe"):
    """Where each key is: in the region, being promoted from a secondary tier, or
    nowhere. Keys a tier holds start their promotion."""

    rid: int
    ns: int
    keys: Keys
    key_bytes: int


class PrepareStore(_Msg, frozen=True, tag="prep_store"):
    rid: int
    ns: int
    keys: Keys
    key_bytes: int


class CompleteStore(_Msg, frozen=True, tag="done_store"):
    rid: int
    ns: int
    keys: Keys
    key_bytes: int
    success: bool = True


class PrepareLoad(_Msg, frozen=True, tag="prep_load"):
    rid: int
    ns: int
    keys: Keys
    key_bytes: int


class CompleteLoad(_Msg, frozen=True, tag="done_load"):
    rid: int
    ns: int
    keys: Keys
    key_bytes: int


class Touch(_Msg, frozen=True, tag="touch"):
    rid: int
    ns: int
    keys: Keys
    key_bytes: int


class TakeEvents(_Msg, frozen=True, tag="events"):
    """Store/evict events of the namespace since this connection's last take."""

    rid: int
    ns: int


class SyncKeys(_Msg, frozen=True, tag="sync_keys"):
    """Page through the namespace's ready keys, for a client-side lookup mirror.

    ``offset`` 0 takes a snapshot of the ready keys *and* restarts this connection's
    event feed at that instant, so snapshot + later ``TakeEvents`` is exact. Further
    pages continue the same snapshot from ``KeysPage.next_offset``.
    """

    rid: int
    ns: int
    offset: int = 0
    push: bool = False  # after the snapshot, events are pushed (``FeedPush``), not taken


class StepBatch(_Msg, frozen=True, tag="step"):
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
    frags: Annotated[bytes, _most(MAX_FRAGMENTS * 24)]
    writers: int = 1
    writer: int = 0


class AttachWorker(_Msg, frozen=True, tag="attach"):
    """CUDA workers add their GPU's UUID and the IPC handle of their store event.
    In a canonical namespace (world size 1) each of an engine's ``parts`` ranks
    attaches with ``canonical`` (one per cache) and writes its parts of every slot."""

    rid: int
    ns: int
    rank: int
    caches: Annotated[list[CacheDesc], _most(MAX_TENSORS)]
    device_uuid: Handle = b""
    store_event: Handle = b""
    client_copy: bool = False  # the worker copies itself; the reply brings the region fd
    push: bool = False  # submits may be one-way; results are pushed (``JobsDone``)
    want_region: bool = False  # a daemon-copy worker's fallback mapping, if trusted
    parts: int = 1  # ranks of the engine that write parts of each slot (canonical)
    canonical: Annotated[list[CanonicalDesc], _most(MAX_TENSORS)] = []


class DetachWorker(_Msg, frozen=True, tag="detach"):
    rid: int
    worker: int


class SubmitStore(_Msg, frozen=True, tag="sub_store"):
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


class SubmitLoad(_Msg, frozen=True, tag="sub_load"):
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


class Wrote(_Msg, frozen=True, tag="wrote"):
    """A client-copy worker copied a store into its engine's leased slots itself
    (one-way); the daemon counts this rank's copy as landed."""

    rid: int
    worker: int
    lease: int
    slots: Ids
    success: bool = True


class ClientCopyDone(_Msg, frozen=True, tag="copied"):
    """A client-copy worker finished (or failed) the copy of a submitted job."""

    rid: int
    worker: int
    job_id: int
    success: bool


class GetFinished(_Msg, frozen=True, tag="finished"):
    rid: int
    worker: int


class WaitJobs(_Msg, frozen=True, tag="wait"):
    rid: int
    worker: int
    job_ids: Annotated[list[int], _most(MAX_JOB_IDS)]


class GetStats(_Msg, frozen=True, tag="stats"):
    rid: int


class ListClients(_Msg, frozen=True, tag="clients"):
    rid: int


class Evict(_Msg, frozen=True, tag="evict"):
    """Evict unpinned blocks of one namespace (or all): given keys, a key prefix, or all;
    at most ``MAX_STATE_KEYS`` per request (``EvictReply.evicted`` says how many)."""

    rid: int
    namespace: Text | None = None
    keys: Keys | None = None
    key_bytes: int = 0
    key_prefix: Annotated[bytes, _most(MAX_KEY_BYTES)] | None = None


class GetConfig(_Msg, frozen=True, tag="config"):
    rid: int


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
)

# ---------------------------------------------------------------------------- replies


class Welcome(_Msg, frozen=True, tag="welcome"):
    rid: int
    protocol_version: int
    daemon_version: str
    instance: str
    pid: int
    region_name: str
    region_bytes: int


class Pong(_Msg, frozen=True, tag="pong"):
    rid: int


class OkReply(_Msg, frozen=True, tag="ok"):
    rid: int


class ErrorReply(_Msg, frozen=True, tag="error"):
    rid: int
    code: int
    message: str


class NamespaceOpened(_Msg, frozen=True, tag="ns"):
    rid: int
    ns: int
    slot_bytes: int
    fingerprint: str
    tiers: int = 0  # secondary tiers below the region: lookups may promote
    lease: int = 0  # this connection's lease token in the namespace


class ProbeReply(_Msg, frozen=True, tag="probed"):
    """One state per key (``KEY_ABSENT``, ``KEY_READY``, ``KEY_PROMOTING``), up to and
    including the first absent key."""

    rid: int
    states: bytes


class LookupReply(_Msg, frozen=True, tag="hits"):
    """``hits`` leading keys are stored and ready; ``None`` means ask again later."""

    rid: int
    hits: int | None


class StorePlanReply(_Msg, frozen=True, tag="store_plan"):
    rid: int
    keys: bytes
    key_bytes: int
    slots: bytes
    evicted_keys: bytes
    lease: int = 0  # the token workers name when they copy into these slots


class LoadPlanReply(_Msg, frozen=True, tag="load_plan"):
    rid: int
    slots: bytes


class EventMsg(msgspec.Struct, frozen=True, array_like=True):
    keys: bytes
    key_bytes: int
    removed: bool
    slots: bytes = b""  # stores: the slot of each key (packed int64)


class EventsReply(_Msg, frozen=True, tag="ev"):
    rid: int
    events: list[EventMsg]
    lost: bool = False  # events were dropped (feed overflow): resync with SyncKeys


class KeysPage(_Msg, frozen=True, tag="keys"):
    rid: int
    keys: list[bytes]
    next_offset: int  # -1: the snapshot is complete
    slots: bytes = b""  # the slot of each key (packed int64)
    seq: int = 0  # the feed position the snapshot was taken at


class CopyPlanReply(_Msg, frozen=True, tag="copy_plan"):
    """Runs a client-copy worker must copy: region offset, offset inside cache
    ``cache_index`` (both packed int64) and length, one entry per run."""

    rid: int
    region: bytes
    cache: bytes
    nbytes: bytes
    cache_index: bytes


class WorkerAttached(_Msg, frozen=True, tag="attached"):
    rid: int
    worker: int
    region_bytes: int = 0  # client-copy workers: the region's size (its fd comes along)


class JobResult(msgspec.Struct, frozen=True, array_like=True):
    job_id: int
    success: bool
    nbytes: int
    seconds: float
    error: int = 0  # the ErrorCode of a job the daemon refused or could not run


class FinishedReply(_Msg, frozen=True, tag="results"):
    rid: int
    results: list[JobResult]


class StatsReply(_Msg, frozen=True, tag="stats_r"):
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


class ClientsReply(_Msg, frozen=True, tag="clients_r"):
    rid: int
    clients: list[ClientInfo]


class EvictReply(_Msg, frozen=True, tag="evicted"):
    rid: int
    evicted: int


class ConfigReply(_Msg, frozen=True, tag="config_r"):
    """The daemon's effective configuration (defaults, file and flags merged)."""

    rid: int
    config: dict[str, Any]


# ---------------------------------------------------------------------------- pushes


class FeedPush(_Msg, frozen=True, tag="feed"):
    """Events of a namespace a connection mirrors (``SyncKeys(push=True)``); ``seq``
    is the feed position after them, which the engine acks (``StepBatch.ack_seq``).
    ``lost``: events were dropped (the connection fell behind): resync."""

    rid: int
    ns: int
    seq: int
    events: list[EventMsg]
    lost: bool = False


class LeaseGrant(_Msg, frozen=True, tag="grant"):
    """Empty slots for this connection's stores in a namespace (its lease token)."""

    rid: int
    ns: int
    slots: bytes


class LeaseRevoke(_Msg, frozen=True, tag="revoke"):
    """Leased slots taken back (unused for ``lease_timeout_s``): no longer this
    connection's to claim; a new lease wish gets fresh ones."""

    rid: int
    ns: int
    slots: bytes


class JobsDone(_Msg, frozen=True, tag="done"):
    """Results of a push worker's jobs."""

    rid: int
    worker: int
    results: list[JobResult]


class Notice(_Msg, frozen=True, tag="notice"):
    """A one-way request was refused; nothing else about the connection changes."""

    rid: int
    code: int
    message: str


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
    | FeedPush
    | LeaseGrant
    | LeaseRevoke
    | JobsDone
    | Notice
)

ONE_WAY: tuple[type[_Msg], ...] = (StepBatch, Wrote, SubmitStore, SubmitLoad)
# The requests whose fields come from users' and engines' choices (names, layouts,
# caches, admin input): a client checks their bounds before sending one, so a request
# the daemon would refuse at decode fails at once with a clear error. The others are
# built within their bounds by the library (keys and ids are split before them).
CHECKED_ON_SEND: frozenset[type[_Msg]] = frozenset(
    (Hello, OpenNamespace, AttachWorker, Evict, WaitJobs)
)
PUSHES: tuple[type[_Msg], ...] = (FeedPush, LeaseGrant, LeaseRevoke, JobsDone, Notice)
# The requests whose reply may bring descriptors (SCM_RIGHTS: the region's, with a
# ``WorkerAttached``); the daemon sends none with any other message. A client reads
# other replies with no room for descriptors (the kernel would drop any that came).
BRINGS_FDS: tuple[type[_Msg], ...] = (AttachWorker,)
