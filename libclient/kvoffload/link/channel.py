"""What namespaces and workers use of their connection, as protocols.

``Client`` (client.py) implements ``Channel``; ``Namespace`` (namespace.py)
implements ``NamespaceHandle``. Namespaces and workers are typed against these, not
against the classes, so the modules import in one direction only: client, then
namespace, then worker, then this module.

Rules a ``Channel`` keeps:
- ``lock`` is held by every request; a caller holding it keeps one connection for a
  sequence of requests (a copy and its report).
- A call that finds the daemon gone raises ``DaemonUnavailableError`` after the
  channel has noted the loss (``exchange`` does that for a caller's own requests); a
  one-way send to a lost daemon is dropped, never raised.
- Registrations are replayed on every new connection (``register``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar

from kvoffload.link.transport import Transport
from kvoffload.protocol import messages as m
from kvoffload.protocol.messages import KVLayout

R = TypeVar("R", bound=m.Reply)
T = TypeVar("T")


class Registration(Protocol):
    """A namespace or worker the client re-establishes on every connection."""

    def _handshake(self, t: Transport, ns_ids: dict[int, int]) -> Any: ...
    def _adopt(self, state: Any) -> None: ...
    def _lost(self) -> None: ...
    def _on_push(self, msg: m.Reply) -> None: ...


class Channel(Protocol):
    epoch: int  # bumped on every (re)connect
    round_trips_total: int

    @property
    def lock(self) -> AbstractContextManager[Any]: ...
    @property
    def connected(self) -> bool: ...
    def next_rid(self) -> int: ...
    def call(
        self,
        make: Callable[[int], m.Request],
        expect: type[R],
        fds: list[int] | None = None,
        timeout_s: float | None = None,
    ) -> R: ...
    def exchange(self, fn: Callable[[Transport], T]) -> T: ...
    def send_nowait(self, make: Callable[[int], m.Request]) -> None: ...
    def post(self, msg: m.Request) -> bool: ...
    def flush(self) -> None: ...
    def poll(self, timeout_s: float = 0.0) -> None: ...
    def adopt(self) -> None: ...
    def route(self, kind: type, ident: int, owner: Registration) -> None: ...
    def route_if_connected(self, kind: type, ident: int, owner: Registration) -> bool: ...
    def register(self, reg: Registration) -> None: ...
    def unregister(self, reg: Registration) -> None: ...
    def ping(self) -> float: ...
    def close(self) -> None: ...


class NamespaceHandle(Protocol):
    """What a worker uses of the namespace it belongs to."""

    client: Channel
    ns_id: int
    name: str
    layout: KVLayout
    slot_bytes: int
