"""The client: one connection per engine process, kept alive by its keeper.

Rules (DESIGN.md section 4, invariant 7 — an engine never crashes, hangs or waits
because the cache is down):
- Every blocking call has a timeout (``timeout_s``). A lost daemon turns into misses
  (see ``namespace.Namespace``); nothing here ever blocks on a daemon that is away.
- A keeper thread (``link.keeper.Keeper``) notices an outage while the engine idles and
  builds the next connection in the background: the whole handshake — Hello, every
  namespace re-opened, every worker re-attached, every engine mirror's snapshot and
  first lease grant — on its own socket (``handshake``), then hands it over.
- The engine's thread adopts it at its next call at the latest (``adopt``, which an
  engine step makes first): one pointer swap and local updates. A connection it had
  not yet noticed was dead is dropped then, as if noticed (its jobs and leases void).
- A namespace joined by name (``join``: an engine's scheduler) that does not exist
  yet holds the connection back: it is retried like an absent daemon until the
  engine's workers have created it.
- Registrations (namespaces, workers) take effect now if connected and are replayed
  on every reconnect. Leases, pins and in-flight jobs of an older connection are void:
  the daemon dropped them when it closed (``epoch`` counts connections).
- Pushes (feed, leases, job results, notices) are read only when the engine's thread
  asks (``poll``), without blocking, and routed to the namespace or worker they are
  for. One-way requests are queued (``post``) and written by ``flush``.
- A namespace the daemon takes from the connection (the table's take-back, an
  admin's drop; a ``Notice`` naming it) voids what the client holds of it, as an
  outage does: the connection is replaced, and the new one opens it again.
- One warning per outage, one note on recovery.
- One lock serialises calls, so a client may be shared between threads.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, TypeVar

from kvoffload.link.channel import Registration
from kvoffload.link.keeper import Keeper, Link
from kvoffload.link.transport import Transport
from kvoffload.namespace import Namespace, pack_checked
from kvoffload.paths import default_socket_path
from kvoffload.protocol import messages as m
from kvoffload.protocol.errors import DaemonUnavailableError, KVOffloadError, NotFoundError
from kvoffload.protocol.messages import KVLayout

log = logging.getLogger(__name__)

R = TypeVar("R", bound=m.Reply)
T = TypeVar("T")


class Client:
    """A connection to kvoffloadd. Build it with ``kvoffload.connect()``."""

    KEEPER_LEAVE_S = 1.0  # how long close() waits for the keeper to let the connection go

    def __init__(self, socket_path: str, timeout_s: float = 5.0, name: str = "") -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self.name = (name or f"pid{os.getpid()}")[: m.MAX_CLIENT_NAME_CHARS]  # for humans
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._rids = itertools.count(1)
        self._transport: Transport | None = None
        self._pending: Link | None = None
        self._registrations: list[Registration] = []
        self._routes: dict[tuple[type, int], Registration] = {}  # (push kind, id) -> owner
        self._keeper = Keeper(self, self._lock)
        self.epoch = 0  # bumped on every (re)connect; leases of older epochs are void
        self.welcome: m.Welcome | None = None
        self.outages_total = 0
        self.round_trips_total = 0  # blocking requests made on the caller's thread
        self.posts_total = 0  # one-way requests
        self.writes_total = 0  # writes of queued one-way requests (``flush``, ``poll``)
        self.reads_total = 0  # reads of the pushes (``poll``)
        self.notices_total = 0  # one-way requests the daemon refused
        self._closed = False

    # ------------------------------------------------------------ connection

    @property
    def connected(self) -> bool:
        return self._transport is not None or self._pending is not None

    def next_rid(self) -> int:
        return next(self._rids)

    @property
    def lock(self) -> AbstractContextManager[Any]:
        return self._lock

    @property
    def closed(self) -> bool:
        return self._closed

    def handshake(self) -> Link:
        """Connect and replay every registration on a new socket (any thread)."""
        t = Transport(self.socket_path, self.timeout_s)
        try:
            welcome = t.request(
                m.Hello(self.next_rid(), m.PROTOCOL_VERSION, self.name, os.getpid())
            )
            assert isinstance(welcome, m.Welcome)
            link = Link(t, welcome)
            with self._lock:
                registrations = list(self._registrations)
            ns_ids: dict[int, int] = {}  # id(Namespace) -> namespace id on this connection
            for reg in registrations:
                state = reg._handshake(t, ns_ids)
                link.states.append((reg, state))
            return link
        except BaseException:
            t.close()
            raise

    def _adopt(self, link: Link) -> None:
        """Take over a finished handshake (the engine's thread, the lock held)."""
        if [reg for reg, _ in link.states] != self._registrations:
            for reg, state in link.states:  # registrations changed meanwhile: again
                discard = getattr(reg, "_discard", None)
                if discard is not None:
                    discard(state)
            link.transport.close()
            self._keeper.rouse()
            return
        if self._transport is not None:  # dead, but nobody had noticed: drop it now
            self._drop(self._transport, "replaced by a new connection")
        self._transport, self.welcome = link.transport, link.welcome
        self.epoch += 1
        self._routes.clear()
        for reg, state in link.states:
            reg._adopt(state)
        self._route(link.transport.take_pushed())  # the first lease grants came along
        if self.epoch > 1:
            log.warning("kvoffloadd at %s is back; offloading resumes", self.socket_path)
        self._keeper.rouse()  # watch the new connection

    def adopt(self) -> None:
        """Take over a connection the keeper has ready (an engine step's first call)."""
        if self._pending is not None:
            with self._lock:
                if self._pending is not None and not self._closed:
                    link, self._pending = self._pending, None
                    self._adopt(link)

    def _ensure(self) -> Transport:
        if self._closed:
            raise DaemonUnavailableError("client is closed")
        if self._pending is not None:
            link, self._pending = self._pending, None
            self._adopt(link)
        if self._transport is None:
            if not self._keeper.started:
                self._keeper.rouse()
            raise DaemonUnavailableError(f"kvoffloadd at {self.socket_path} is unavailable")
        return self._transport

    def _lost(self, exc: KVOffloadError) -> None:
        if self._transport is not None:
            self._drop(self._transport, str(exc))
            self._keeper.rouse()

    def _drop(self, t: Transport, why: str, outage: bool = True) -> None:
        """Forget a connection: its leases, pins and jobs died with it (lock held)."""
        if outage and not t.lost_noted:
            self._note_lost(t, why)
        t.close()
        if t is self._transport:
            self._transport = None
        for reg in self._registrations:
            reg._lost()

    def _note_lost(self, t: Transport, why: str) -> None:
        """Count and log an outage once per connection (either thread may see it first)."""
        t.lost_noted = True
        self.outages_total += 1
        log.warning(
            "lost kvoffloadd at %s (%s); engines run without offloading until it is back",
            self.socket_path,
            why,
        )

    # ------------------------------------------------------------ for the keeper

    def watched(self) -> tuple[Transport | None, bool]:
        return self._transport, self._pending is not None

    def hung_up(self, t: Transport) -> None:
        with self._lock:
            if t is self._transport and not t.lost_noted:
                self._note_lost(t, "it hung up")

    def offer(self, link: Link) -> bool:
        with self._lock:
            if self._closed:
                link.transport.close()
                return False
            self._pending = link
            self._changed.notify_all()
        return True

    def connect_now(self) -> None:
        """Connect on the calling thread; raises DaemonUnavailableError if it cannot."""
        with self._lock:
            if self._transport is None:
                self._adopt(self.handshake())

    def wait_connected(self, timeout_s: float) -> bool:
        """Block until a connection is up (or adopted), at most ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while not self._closed:
                try:
                    self._ensure()
                    return True
                except DaemonUnavailableError:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._changed.wait(min(left, 0.05))
        return False

    # ------------------------------------------------------------ requests

    def call(
        self,
        make: Callable[[int], m.Request],
        expect: type[R],
        fds: list[int] | None = None,
        timeout_s: float | None = None,
    ) -> R:
        """Send one request and return its reply (typed); raises KVOffloadError."""
        with self._lock:
            t = self._transport
            if t is None or self._pending is not None or self._closed:
                t = self._ensure()
            self.round_trips_total += 1
            try:
                reply = t.request(make(next(self._rids)), fds, timeout_s)
            except DaemonUnavailableError as exc:
                self._lost(exc)
                raise
            if not isinstance(reply, expect):
                lost = DaemonUnavailableError(f"unexpected reply {type(reply).__name__}")
                self._lost(lost)
                raise lost
            if t.pushed:
                self._route(t.poll())
            return reply

    def send_nowait(self, make: Callable[[int], m.Request]) -> None:
        """Send a request whose reply nobody waits for; a fault loses the connection
        (the caller carries on: what it asked for is no longer needed or is retried)."""
        with self._lock:
            try:
                self._ensure().send_nowait(make(self.next_rid()))
            except KVOffloadError as exc:  # a daemon's last word (a refusal) included
                self._lost(exc)

    def post(self, msg: m.Request) -> bool:
        """Queue a one-way request for the next ``flush``; False when disconnected."""
        with self._lock:
            try:
                self._ensure().post(msg)
            except DaemonUnavailableError as exc:
                self._lost(exc)
                return False
            self.posts_total += 1
            return True

    def flush(self) -> None:
        with self._lock:
            if self._transport is not None:
                try:
                    self._write(self._transport)
                except DaemonUnavailableError as exc:
                    self._lost(exc)

    def _write(self, t: Transport) -> None:
        if t.unsent_bytes:
            self.writes_total += 1
            t.flush()

    def poll(self, timeout_s: float = 0.0) -> None:
        """Adopt a new connection if one is ready, write queued requests, and deliver
        the pushes that arrived (waiting up to ``timeout_s`` for some)."""
        with self._lock:
            try:
                t = self._ensure()
                self._write(t)
                self.reads_total += 1
                pushes = t.poll(timeout_s)
            except DaemonUnavailableError as exc:
                self._lost(exc)
                return
            self._route(pushes)

    def _route(self, pushes: Sequence[m.Reply]) -> None:
        lost = ""
        for msg in pushes:
            if isinstance(msg, (m.FeedPush, m.LeaseGrant, m.LeaseRevoke)):
                owner = self._routes.get((Namespace, msg.ns))
            elif isinstance(msg, m.JobsDone):
                owner = self._routes.get((m.JobsDone, msg.worker))
            else:  # a refused one-way request (counted, never raised), or a lost namespace
                self.notices_total += 1
                log.debug("kvoffloadd refused a request: %s", getattr(msg, "message", msg))
                if isinstance(msg, m.Notice) and msg.ns >= 0 and self._opened(msg.ns):
                    lost = msg.message
                continue
            if owner is not None:
                owner._on_push(msg)
        if lost and self._transport is not None:
            # what the client holds of it (its id, leases, workers) is void, as after an
            # outage: a new connection opens it again, if the table's rules allow
            log.warning("%s; kvoffload reconnects to open it again", lost)
            self._drop(self._transport, lost, outage=False)
            self._keeper.rouse()

    def _opened(self, ns_id: int) -> bool:
        return any(isinstance(r, Namespace) and r.ns_id == ns_id for r in self._registrations)

    def route(self, kind: type, ident: int, owner: Registration) -> None:
        """Deliver pushes of ``kind`` for ``ident`` (namespace or worker id) to owner."""
        self._routes[(kind, ident)] = owner

    def route_if_connected(self, kind: type, ident: int, owner: Registration) -> bool:
        """``route`` now if connected with ``ident`` known (>= 0); False otherwise."""
        with self._lock:
            if self._transport is None or ident < 0:
                return False
            self.route(kind, ident, owner)
            return True

    def exchange(self, fn: Callable[[Transport], T]) -> T:
        """Run the caller's own requests on the connection (one round trip counted);
        a lost daemon is noted, then raised as DaemonUnavailableError."""
        with self._lock:
            self.round_trips_total += 1
            try:
                return fn(self._ensure())
            except DaemonUnavailableError as exc:
                self._lost(exc)
                raise

    # ------------------------------------------------------------ registrations

    def register(self, reg: Registration) -> None:
        """Set a registration up now (if connected) and replay it on reconnects.

        A daemon that is down, or lost during the registration, is no error: it runs
        again when the client reconnects. Other errors (a layout mismatch, a refused
        cache) propagate and nothing is kept.
        """
        with self._lock:
            try:
                t = self._ensure()
                ns_ids = {id(r): r.ns_id for r in self._registrations if isinstance(r, Namespace)}
                state = reg._handshake(t, ns_ids)
            except DaemonUnavailableError as exc:
                self._lost(exc)
                self._registrations.append(reg)
                return
            except NotFoundError as exc:  # a joined namespace not created yet
                self._registrations.append(reg)
                self._keeper.note_waiting(exc)
                self._drop(t, str(exc), outage=False)  # the keeper retries all of it
                self._keeper.rouse()
                return
            self._registrations.append(reg)
            reg._adopt(state)

    def unregister(self, reg: Registration) -> None:
        with self._lock:
            if reg in self._registrations:
                self._registrations.remove(reg)
            for key in [k for k, v in self._routes.items() if v is reg]:
                del self._routes[key]

    # ------------------------------------------------------------ public API

    def namespace(
        self, name: str, layout: KVLayout, subscribe: bool = True, join: bool = False
    ) -> Namespace:
        """Open (or create) a namespace; LayoutMismatchError if it exists with another
        layout. ``subscribe=False``: this connection takes no events of it. ``join``:
        open an existing one whatever its layout, waiting (in the background) until it
        exists."""
        ns = Namespace(self, name, layout, subscribe, join)
        self.register(ns)
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
        starting with ``prefix``, or all of them. Returns how many were evicted (the
        daemon evicts ``MAX_STATE_KEYS`` per request: this asks until it is done)."""
        packed, kb = pack_checked(keys) if keys is not None else (None, 0)
        total = 0
        while True:
            reply = self.call(lambda rid: m.Evict(rid, namespace, packed, kb, prefix), m.EvictReply)
            total += reply.evicted
            if reply.evicted < m.MAX_STATE_KEYS:
                return total

    def drop_namespace(self, name: str) -> m.NamespaceDropped:
        """Drop a namespace (admin uids only): the connections that have it open lose
        it (and reconnect to open it again), then its blocks and table entry go.
        NotFoundError if there is none; NoSpaceError while copies run in it."""
        return self.call(lambda rid: m.DropNamespace(rid, name), m.NamespaceDropped)

    def config(self) -> dict[str, Any]:
        """The daemon's effective configuration (admin uids only)."""
        return self.call(m.GetConfig, m.ConfigReply).config

    def close(self) -> None:
        from kvoffload.worker import Worker

        with self._lock:
            if self._closed:
                return
            for reg in list(self._registrations):
                if isinstance(reg, Worker):
                    reg.close()
            self._closed = True
            self._changed.notify_all()
            if self._transport is not None:
                self._transport.close()
                self._transport = None
            if self._pending is not None:
                self._pending.transport.close()
                self._pending = None
            keeper = self._keeper.stop()
        # The keeper watches the connection through a duplicate of its descriptor: wait
        # (bounded) until it has let go, so that a process forked after close() does not
        # hold the connection open for as long as it lives.
        if keeper is not None and keeper is not threading.current_thread():
            keeper.join(self.KEEPER_LEAVE_S)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(
    socket_path: str | None = None, *, timeout_s: float = 5.0, name: str = "", lazy: bool = False
) -> Client:
    """Connect to kvoffloadd.

    ``socket_path`` defaults to ``$KVOFFLOAD_SOCKET``, then the default path. With
    ``lazy=False`` an unreachable daemon raises DaemonUnavailableError now; with
    ``lazy=True`` the client starts disconnected and connects in the background.
    """
    path = socket_path or os.environ.get("KVOFFLOAD_SOCKET") or default_socket_path()
    client = Client(path, timeout_s, name)
    if lazy:
        with client._lock:
            client._keeper.rouse()
    else:
        client.connect_now()
    return client
