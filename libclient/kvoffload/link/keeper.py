"""The keeper: the thread that watches a client's connection and builds the next one.

Rules (DESIGN.md section 4, invariant 7 — an engine never waits because the cache is
down):
- It watches the live connection for the daemon hanging up: a poll on a duplicate of
  its socket that wakes on hang-up only, never on data, so an outage is noticed while
  the engine idles, not at its next request.
- It then builds the next connection in the background (``Kept.handshake``: Hello and
  every registration replayed, on its own socket), retrying every ``RETRY_MIN_S``,
  doubling up to ``RETRY_MAX_S`` (a daemon that comes back is found within a quarter of
  a second, and no call ever sits in a backoff), and offers the finished link
  (``Kept.offer``). While one waits to be adopted it only waits.
- A daemon that refuses the client is asked again every ``RETRY_REFUSED_S``; so is one
  whose handshake failed for a reason nobody foresaw: a bug never ends reconnecting.
- It takes the client's lock for moments only (to look at the connection, to hand one
  over, to leave), never while it waits or connects. Whoever rouses it holds that lock
  and checks that the client is not closed first; the keeper closes its eventfd as it
  leaves, under the lock, so nobody writes to a closed descriptor.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
from typing import Any, Protocol

from kvoffload.link.channel import Registration
from kvoffload.link.transport import Transport
from kvoffload.protocol import messages as m
from kvoffload.protocol.errors import DaemonUnavailableError, KVOffloadError, NotFoundError

log = logging.getLogger(__name__)

_HUNG_UP = select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL
_RETRYABLE = (DaemonUnavailableError, NotFoundError)  # absent daemon, or namespace


class Link:
    """A connection whose handshake is complete, waiting to be adopted."""

    def __init__(self, t: Transport, welcome: m.Welcome) -> None:
        self.transport = t
        self.welcome = welcome
        self.states: list[tuple[Registration, Any]] = []


class Kept(Protocol):
    """What the keeper needs of its client (``kvoffload.client.Client``)."""

    socket_path: str

    @property
    def closed(self) -> bool: ...

    def watched(self) -> tuple[Transport | None, bool]:
        """The live connection (None if none), and whether a link waits for adoption."""
        ...

    def handshake(self) -> Link:
        """A new connection with every registration replayed (raises if it cannot)."""
        ...

    def hung_up(self, t: Transport) -> None:
        """``t`` hung up: count and log the outage, unless already done."""
        ...

    def offer(self, link: Link) -> bool:
        """Hand ``link`` over for adoption; False (the link closed) if the client is."""
        ...


class Keeper:
    """One client's keeper thread, started at the first ``rouse``."""

    RETRY_MIN_S = 0.02
    RETRY_MAX_S = 0.25
    RETRY_REFUSED_S = 5.0  # a daemon that refuses us is asked again, but rarely
    ADOPT_WAIT_S = 1.0  # a look at an offered link not yet adopted

    def __init__(self, client: Kept, lock: threading.RLock) -> None:
        self._client = client
        self._lock = lock
        self._thread: threading.Thread | None = None
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)  # rouses the thread
        self._noted: set[str] = set()  # namespaces we said we wait for

    @property
    def started(self) -> bool:
        return self._thread is not None

    def rouse(self) -> None:
        """Start the thread, or wake it: the connection changed (lock held)."""
        if self._client.closed:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvoffload-keeper", daemon=True)
            self._thread.start()
        os.eventfd_write(self._wake, 1)

    def stop(self) -> threading.Thread | None:
        """The client has closed (lock held): wake the thread to leave, and return it
        for a bounded join; with no thread, the eventfd closes now."""
        thread = self._thread
        if thread is None:
            os.close(self._wake)
        else:
            os.eventfd_write(self._wake, 1)
        return thread

    def note_waiting(self, exc: NotFoundError) -> None:
        """Say once per namespace that the connection waits for it to be created."""
        if str(exc) not in self._noted:
            self._noted.add(str(exc))
            log.info("kvoffload: waiting for the engine's workers: %s", exc)

    def wait(self, timeout_s: float | None, fd: int = -1) -> bool:
        """Sleep until roused or ``timeout_s``; True if ``fd`` (watched for hang-up
        only) hung up meanwhile."""
        poller = select.poll()
        poller.register(self._wake, select.POLLIN)
        if fd >= 0:
            poller.register(fd, select.POLLRDHUP)  # errors and hang-ups always count
        events = poller.poll(None if timeout_s is None else timeout_s * 1000)
        if any(f == self._wake for f, _ in events):
            with contextlib.suppress(BlockingIOError):
                os.eventfd_read(self._wake)
        return any(f == fd and ev & _HUNG_UP for f, ev in events)

    def _run(self) -> None:
        try:
            while not self._client.closed:
                try:
                    self.keep_until_closed()
                except Exception:  # a bug (say, out of descriptors) ends no keeping
                    log.exception("kvoffload: the keeper of %s failed", self._client.socket_path)
                    self.wait(self.RETRY_REFUSED_S)
        finally:
            with self._lock:  # whoever rouses us holds it, and checks closed first
                os.close(self._wake)

    def keep_until_closed(self) -> None:
        """The keeper's loop: watch the live connection, replace a lost one."""
        client = self._client
        delay_s = self.RETRY_MIN_S
        refused = ""
        stale: Transport | None = None  # hung up, not yet noticed by the engine
        while not client.closed:
            with self._lock:
                t, pending = client.watched()
                fd = -1
                if t is not None and t.sock is not None and t is not stale and not pending:
                    fd = os.dup(t.sock.fileno())
            if pending:
                self.wait(self.ADOPT_WAIT_S)  # until the engine adopts it
                continue
            if fd >= 0 and t is not None:
                try:
                    hung_up = self.wait(None, fd)
                finally:
                    os.close(fd)
                if hung_up:
                    client.hung_up(t)
                    stale = t
                continue
            try:
                link = client.handshake()
            except _RETRYABLE as exc:
                if isinstance(exc, NotFoundError):
                    self.note_waiting(exc)
                self.wait(delay_s)
                delay_s = min(delay_s * 2, self.RETRY_MAX_S)
                continue
            except KVOffloadError as exc:
                if str(exc) != refused:
                    refused = str(exc)
                    log.error("kvoffloadd at %s refuses this client: %s", client.socket_path, exc)
                self.wait(self.RETRY_REFUSED_S)
                continue
            except Exception:  # a bug must not end reconnecting for good
                log.exception("kvoffload: connecting to %s failed", client.socket_path)
                self.wait(self.RETRY_REFUSED_S)
                continue
            delay_s, stale = self.RETRY_MIN_S, None
            if not client.offer(link):
                return
