"""The client: one connection per engine process, namespaces on the scheduler side.

Rules (DESIGN.md section 4, invariant 7 — an engine never crashes or hangs because
the cache is down):
- Every call has a timeout (``timeout_s``). A lost daemon turns into misses:
  ``lookup`` -> 0, ``prepare_store`` -> None, completions and ``touch`` -> no-ops,
  ``take_events`` -> []. Only ``prepare_load`` raises, because a load cannot be
  planned without the daemon; callers treat that as a failed load.
- After a failure the client retries the connection with exponential backoff (0.2 s
  to 5 s) on later calls; on reconnect it re-opens its namespaces and re-attaches its
  workers. Leases do not survive a reconnect: the daemon failed them when the old
  connection closed.
- One lock serialises calls, so a client may be shared between threads.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from .paths import default_socket_path
from .plans import LoadPlan, OffloadEvent, StorePlan
from .protocol import messages as m
from .protocol.errors import (
    DaemonUnavailableError,
    InvalidArgumentError,
    KVOffloadError,
    NoSpaceError,
    QuotaExceededError,
)
from .protocol.messages import KVLayout, pack_keys, unpack_ids, unpack_keys
from .transport import Transport

if TYPE_CHECKING:
    from .worker import Worker

log = logging.getLogger(__name__)

R = TypeVar("R", bound=m.Reply)


class Client:
    """A connection to kvoffloadd. Build it with ``kvoffload.connect()``."""

    BACKOFF_MIN_S = 0.2
    BACKOFF_MAX_S = 5.0

    def __init__(self, socket_path: str, timeout_s: float = 5.0, name: str = "") -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self.name = name or f"pid{os.getpid()}"
        self._lock = threading.RLock()
        self._rids = itertools.count(1)
        self._transport: Transport | None = None
        self._namespaces: list[Namespace] = []
        self._workers: list[Worker] = []
        self._retry_at = 0.0
        self._backoff_s = self.BACKOFF_MIN_S
        self.epoch = 0  # bumped on every (re)connect; leases of older epochs are void
        self.welcome: m.Welcome | None = None
        self._closed = False

    # ------------------------------------------------------------ connection

    @property
    def connected(self) -> bool:
        return self._transport is not None

    def _rid(self) -> int:
        return next(self._rids)

    def _connect(self) -> Transport:
        t = Transport(self.socket_path, self.timeout_s)
        try:
            welcome = t.request(m.Hello(self._rid(), m.PROTOCOL_VERSION, self.name, os.getpid()))
            assert isinstance(welcome, m.Welcome)
            self._transport = t
            self.welcome = welcome
            self.epoch += 1
            for ns in self._namespaces:
                ns._reopen(t)
            for w in self._workers:
                w._reattach(t)
        except BaseException:
            t.close()
            self._transport = None
            raise
        self._backoff_s = self.BACKOFF_MIN_S
        if self.epoch > 1:
            log.info("reconnected to kvoffloadd at %s", self.socket_path)
        return t

    def _ensure(self) -> Transport:
        if self._closed:
            raise DaemonUnavailableError("client is closed")
        if self._transport is not None:
            return self._transport
        now = time.monotonic()
        if now < self._retry_at:
            raise DaemonUnavailableError(f"kvoffloadd at {self.socket_path} is unavailable")
        try:
            return self._connect()
        except DaemonUnavailableError:
            self._retry_at = time.monotonic() + self._backoff_s
            self._backoff_s = min(self._backoff_s * 2, self.BACKOFF_MAX_S)
            raise

    def _lost(self, exc: DaemonUnavailableError) -> None:
        if self._transport is not None:
            log.warning("lost kvoffloadd: %s", exc)
            self._transport.close()
            self._transport = None
            self._retry_at = time.monotonic() + self._backoff_s
            for w in self._workers:
                w._fail_inflight()

    def call(
        self,
        make: Callable[[int], m.Request],
        expect: type[R],
        fds: list[int] | None = None,
        timeout_s: float | None = None,
    ) -> R:
        """Send one request and return its reply (typed); raises KVOffloadError."""
        with self._lock:
            t = self._ensure()
            try:
                reply = t.request(make(self._rid()), fds, timeout_s)
            except DaemonUnavailableError as exc:
                self._lost(exc)
                raise
            if not isinstance(reply, expect):
                lost = DaemonUnavailableError(f"unexpected reply {type(reply).__name__}")
                self._lost(lost)
                raise lost
            return reply

    def send_nowait(self, make: Callable[[int], m.Request]) -> None:
        with self._lock:
            try:
                self._ensure().send_nowait(make(self._rid()))
            except DaemonUnavailableError as exc:
                self._lost(exc)

    # ------------------------------------------------------------ public API

    def _register(self, setup: Callable[[Transport], None], keep: Callable[[], None]) -> None:
        """Run a registration now and ``keep`` it for reconnects (the lock held).

        A daemon that is down, or lost during the registration, is no error: like
        every registration, it runs again when the client reconnects. Other errors
        (a layout mismatch, a refused cache) propagate and nothing is kept.
        """
        try:
            setup(self._ensure())
        except DaemonUnavailableError as exc:
            self._lost(exc)
        keep()

    def namespace(self, name: str, layout: KVLayout) -> Namespace:
        """Open (or join) a namespace; LayoutMismatchError if it exists with another layout."""
        with self._lock:
            ns = Namespace(self, name, layout)
            self._register(ns._reopen, lambda: self._namespaces.append(ns))
            return ns

    def ping(self) -> float:
        """Round trip to the daemon in seconds."""
        t0 = time.perf_counter()
        self.call(m.Ping, m.Pong)
        return time.perf_counter() - t0

    def stats(self) -> dict[str, Any]:
        return self.call(m.GetStats, m.StatsReply).sections

    def clients(self) -> list[m.ClientInfo]:
        return self.call(m.ListClients, m.ClientsReply).clients

    def evict(
        self,
        namespace: str | None = None,
        keys: Sequence[bytes] | None = None,
        prefix: bytes | None = None,
    ) -> int:
        """Evict unpinned blocks of one namespace (or all): only ``keys``, only keys
        starting with ``prefix``, or all of them. Returns how many were evicted."""
        packed, kb = _pack(keys) if keys is not None else (None, 0)
        reply = self.call(lambda rid: m.Evict(rid, namespace, packed, kb, prefix), m.EvictReply)
        return reply.evicted

    def config(self) -> dict[str, Any]:
        """The daemon's effective configuration (admin uids only)."""
        return self.call(m.GetConfig, m.ConfigReply).config

    def close(self) -> None:
        with self._lock:
            for w in list(self._workers):
                w.close()
            self._closed = True
            if self._transport is not None:
                self._transport.close()
                self._transport = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _register_worker(self, w: Worker) -> None:
        self._workers.append(w)

    def _unregister_worker(self, w: Worker) -> None:
        if w in self._workers:
            self._workers.remove(w)


class Namespace:
    """Scheduler-side view of one namespace: vLLM's OffloadingManager contract."""

    def __init__(self, client: Client, name: str, layout: KVLayout) -> None:
        self.client = client
        self.name = name
        self.layout = layout
        self.ns_id = -1
        self.slot_bytes = 0
        self.fingerprint = ""
        self.tiers = 0  # secondary tiers below the daemon's region
        self.last_error: KVOffloadError | None = None  # why prepare_store gave None

    def _reopen(self, t: Transport) -> None:
        reply = t.request(m.OpenNamespace(self.client._rid(), self.name, self.layout))
        assert isinstance(reply, m.NamespaceOpened)
        self.ns_id, self.slot_bytes, self.fingerprint, self.tiers = (
            reply.ns,
            reply.slot_bytes,
            reply.fingerprint,
            reply.tiers,
        )

    def _keys_call(
        self, cls: Callable[..., m.Request], keys: Sequence[bytes], expect: type[R], *extra: Any
    ) -> R:
        packed, kb = _pack(keys)
        return self.client.call(lambda rid: cls(rid, self.ns_id, packed, kb, *extra), expect)

    def lookup(self, keys: Sequence[bytes]) -> int | None:
        """Number of leading keys stored and ready; 0 when the daemon is unavailable."""
        if not keys:
            return 0
        try:
            return self._keys_call(m.Lookup, keys, m.LookupReply).hits
        except DaemonUnavailableError:
            return 0

    def probe(self, keys: Sequence[bytes]) -> list[int]:
        """Per key ``KEY_READY``, ``KEY_PROMOTING`` or ``KEY_ABSENT``, up to and including
        the first absent key; keys a secondary tier holds start their promotion. Empty
        when the daemon is unavailable."""
        if not keys:
            return []
        try:
            return list(self._keys_call(m.Probe, keys, m.ProbeReply).states)
        except DaemonUnavailableError:
            return []

    def prepare_store(self, keys: Sequence[bytes]) -> StorePlan | None:
        """Lease slots for the keys not stored yet; None when there is no space.

        None also when the namespace's quota is full and nothing of its own can be
        evicted (``QUOTA_EXCEEDED``); the reason stays in ``last_error``.
        """
        try:
            r = self._keys_call(m.PrepareStore, keys, m.StorePlanReply)
        except (NoSpaceError, QuotaExceededError, DaemonUnavailableError) as exc:
            self.last_error = exc
            return None
        return StorePlan(
            unpack_keys(r.keys, r.key_bytes),
            unpack_ids(r.slots).tolist(),
            unpack_keys(r.evicted_keys, r.key_bytes),
        )

    def complete_store(self, keys: Sequence[bytes], success: bool = True) -> None:
        if keys:
            # Without the daemon there is nothing to complete: it failed these stores
            # when the connection dropped.
            with contextlib.suppress(DaemonUnavailableError):
                self._keys_call(m.CompleteStore, keys, m.OkReply, success)

    def prepare_load(self, keys: Sequence[bytes]) -> LoadPlan:
        """Pin the blocks and return their slots in key order (raises if not all ready)."""
        r = self._keys_call(m.PrepareLoad, keys, m.LoadPlanReply)
        return LoadPlan(unpack_ids(r.slots).tolist())

    def complete_load(self, keys: Sequence[bytes]) -> None:
        if keys:
            with contextlib.suppress(DaemonUnavailableError):  # pins died with the connection
                self._keys_call(m.CompleteLoad, keys, m.OkReply)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Refresh recency; sent without waiting for the reply."""
        if keys:
            packed, kb = _pack(keys)
            self.client.send_nowait(lambda rid: m.Touch(rid, self.ns_id, packed, kb))

    def take_events(self) -> list[OffloadEvent]:
        """Events of this namespace since the last take on this connection: stores that
        completed (by any engine) and evictions. [] when the daemon is unavailable."""
        try:
            return self.read_feed()[0]
        except DaemonUnavailableError:
            return []

    def read_feed(self) -> tuple[list[OffloadEvent], bool]:
        """(events, lost): like ``take_events``; ``lost`` says the daemon dropped some
        (its per-connection queue overflowed), so a mirror must ``sync_keys`` again.
        Raises DaemonUnavailableError."""
        r = self.client.call(lambda rid: m.TakeEvents(rid, self.ns_id), m.EventsReply)
        events = [OffloadEvent(unpack_keys(e.keys, e.key_bytes), e.removed) for e in r.events]
        return events, r.lost

    def sync_keys(self) -> list[bytes]:
        """Every key ready in the namespace now, and the event feed restarted at that
        instant: keys + later ``read_feed`` events are exact. Raises
        DaemonUnavailableError."""
        keys: list[bytes] = []
        offset = 0
        while offset >= 0:
            page = self.client.call(
                functools.partial(m.SyncKeys, ns=self.ns_id, offset=offset), m.KeysPage
            )
            keys.extend(page.keys)
            offset = page.next_offset
        return keys

    def attach_worker(
        self,
        caches: Sequence[Any],
        rank: int = 0,
        stream: int | None = None,
        copy_mode: str = "auto",
    ) -> Worker:
        """Register this rank's KV caches.

        ``caches`` are ``shared_kv_cache`` CPU tensors or CUDA tensors (one GPU per
        worker, exported by IPC handle), which the daemon copies; or, with
        ``copy_mode`` "client" (or "auto" when the caches cannot be exported), plain CPU
        tensors that the worker copies itself through a mapping of the region, which
        the daemon allows only for trusted uids. For CUDA, stores wait on work queued on
        ``stream`` (a raw ``cudaStream_t``; default: PyTorch's current stream).
        """
        from .worker import Worker

        return Worker(self, caches, rank, stream, copy_mode)


def _pack(keys: Sequence[bytes]) -> tuple[bytes, int]:
    try:
        return pack_keys(list(keys))
    except ValueError as exc:
        raise InvalidArgumentError(str(exc)) from None


def connect(
    socket_path: str | None = None, *, timeout_s: float = 5.0, name: str = "", lazy: bool = False
) -> Client:
    """Connect to kvoffloadd.

    ``socket_path`` defaults to ``$KVOFFLOAD_SOCKET``, then the default path. With
    ``lazy=False`` an unreachable daemon raises DaemonUnavailableError now; with
    ``lazy=True`` the client starts disconnected and connects on first use.
    """
    path = socket_path or os.environ.get("KVOFFLOAD_SOCKET") or default_socket_path()
    client = Client(path, timeout_s, name)
    if not lazy:
        with client._lock:
            client._ensure()
    return client
