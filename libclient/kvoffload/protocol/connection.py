"""Sans-IO protocol core: framing plus the per-connection state machine.

A ``Connection`` turns bytes into typed messages and messages into bytes; it never
touches a socket, so both roles are tested by wiring two of them together.

Frame: ``u32 little-endian body length`` then a msgpack body (one tagged Struct).

State table (both roles):

    AWAIT_HELLO --Hello/Welcome--> READY --close()--> CLOSED
         |                            |
         +---- any protocol error ----+--> ERROR (terminal)

Rules:
- The client's first message must be ``Hello``; the server's first reply must answer
  it (``Welcome``, or ``ErrorReply`` which leaves the connection in AWAIT_HELLO).
- A client may only receive replies to request ids it sent and has not yet seen
  answered; a server may only send replies to request ids it received.
- One-way requests (``messages.ONE_WAY``) travel with rid 0 and are never answered;
  pushes (``messages.PUSHES``) travel with rid 0 and answer nothing. Any other rid 0
  is a protocol error (a server's rid-0 ``ErrorReply`` is its last word).
- Frames larger than ``max_frame_bytes`` are refused in both directions.
- Errors are raised as ``ProtocolError`` and move the connection to ERROR; the I/O
  layer then drops that one connection.
"""

from __future__ import annotations

import enum
import struct
from typing import Generic, TypeVar

import msgspec

from kvoffload.protocol.errors import ProtocolError, error_for_code
from kvoffload.protocol.messages import (
    DEFAULT_MAX_FRAME_BYTES,
    ONE_WAY,
    PUSHES,
    ErrorReply,
    Hello,
    Reply,
    Request,
    Welcome,
)

_LEN = struct.Struct("<I")
HEADER_BYTES = _LEN.size


class Role(enum.Enum):
    CLIENT = "client"
    SERVER = "server"


class State(enum.Enum):
    AWAIT_HELLO = "await_hello"
    READY = "ready"
    CLOSED = "closed"
    ERROR = "error"


class NeedData:
    """Sentinel: no complete frame is buffered yet."""

    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA = NeedData()

_encoder = msgspec.msgpack.Encoder()


def encode_frame(msg: msgspec.Struct) -> bytes:
    """One length-prefixed frame (no state checks; the Connection adds those)."""
    buf = bytearray(HEADER_BYTES)
    _encoder.encode_into(msg, buf, HEADER_BYTES)
    _LEN.pack_into(buf, 0, len(buf) - HEADER_BYTES)
    return bytes(buf)


In = TypeVar("In")


class _FrameReader(Generic[In]):
    """Buffers bytes and yields decoded messages of one union type."""

    def __init__(self, decoder: msgspec.msgpack.Decoder[In], max_frame_bytes: int) -> None:
        self._decoder = decoder
        self._buf = bytearray()
        self._pos = 0
        self._max = max_frame_bytes

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self._pos and self._pos == len(self._buf):
            self._buf.clear()
            self._pos = 0
        self._buf += data

    @property
    def buffered_bytes(self) -> int:
        return len(self._buf) - self._pos

    def next(self) -> In | NeedData:
        avail = len(self._buf) - self._pos
        if avail < HEADER_BYTES:
            return NEED_DATA
        (length,) = _LEN.unpack_from(self._buf, self._pos)
        if length > self._max:
            raise ProtocolError(f"frame of {length} bytes exceeds the limit of {self._max}")
        if avail < HEADER_BYTES + length:
            return NEED_DATA
        start = self._pos + HEADER_BYTES
        end = start + length
        try:
            msg = self._decoder.decode(memoryview(self._buf)[start:end])
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            # msgspec reports invalid UTF-8 in a str field as UnicodeDecodeError.
            raise ProtocolError(f"undecodable frame: {exc}") from exc
        self._pos = end
        if self._pos > 65536 and self._pos * 2 > len(self._buf):
            del self._buf[: self._pos]
            self._pos = 0
        return msg


class ClientConnection:
    """Client side: sends requests, receives their replies."""

    role = Role.CLIENT

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.state = State.AWAIT_HELLO
        self.max_frame_bytes = max_frame_bytes
        self._reader: _FrameReader[Reply] = _FrameReader(
            msgspec.msgpack.Decoder(Reply), max_frame_bytes
        )
        self._outstanding: set[int] = set()
        self._hello_rid: int | None = None

    @property
    def outstanding(self) -> frozenset[int]:
        return frozenset(self._outstanding)

    def send(self, req: Request) -> bytes:
        if self.state in (State.CLOSED, State.ERROR):
            raise ProtocolError(f"cannot send on a connection in state {self.state.value}")
        if self.state is State.AWAIT_HELLO:
            if not isinstance(req, Hello) or self._hello_rid is not None:
                raise ProtocolError("the first request must be a single Hello")
            self._hello_rid = req.rid
        if req.rid == 0 and isinstance(req, ONE_WAY) and self.state is State.READY:
            return self._encode(req)
        if req.rid <= 0:
            raise ProtocolError("request ids start at 1 (0 is reserved for one-way requests)")
        if req.rid in self._outstanding:
            raise ProtocolError(f"request id {req.rid} is already outstanding")
        frame = self._encode(req)
        self._outstanding.add(req.rid)
        return frame

    def _encode(self, req: Request) -> bytes:
        frame = encode_frame(req)
        if len(frame) - HEADER_BYTES > self.max_frame_bytes:
            raise ProtocolError(
                f"request of {len(frame) - HEADER_BYTES} bytes exceeds the frame limit of "
                f"{self.max_frame_bytes}; split the call"
            )
        return frame

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        self._reader.feed(data)

    def next_event(self) -> Reply | NeedData:
        if self.state is State.ERROR:
            raise ProtocolError("connection is in the ERROR state")
        try:
            msg = self._reader.next()
            if isinstance(msg, NeedData):
                return msg
            if msg.rid == 0 and isinstance(msg, ErrorReply):
                # rid 0 is the server's last word before it closes the connection.
                self.state = State.ERROR
                raise error_for_code(msg.code, f"kvoffloadd closed the connection: {msg.message}")
            if msg.rid == 0 and isinstance(msg, PUSHES) and self.state is State.READY:
                return msg
            if msg.rid not in self._outstanding:
                raise ProtocolError(f"reply to unknown request id {msg.rid}")
            self._outstanding.discard(msg.rid)
            if self.state is State.AWAIT_HELLO and msg.rid == self._hello_rid:
                if isinstance(msg, Welcome):
                    self.state = State.READY
                elif isinstance(msg, ErrorReply):
                    self._hello_rid = None
                else:
                    raise ProtocolError(f"expected a Welcome, got {type(msg).__name__}")
            return msg
        except ProtocolError:
            self.state = State.ERROR
            raise

    def close(self) -> None:
        if self.state is not State.ERROR:
            self.state = State.CLOSED


class ServerConnection:
    """Server side: receives requests, sends one reply per request id."""

    role = Role.SERVER

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.state = State.AWAIT_HELLO
        self.max_frame_bytes = max_frame_bytes
        self._reader: _FrameReader[Request] = _FrameReader(
            msgspec.msgpack.Decoder(Request), max_frame_bytes
        )
        self._pending: set[int] = set()

    @property
    def pending(self) -> frozenset[int]:
        return frozenset(self._pending)

    @property
    def buffered_bytes(self) -> int:
        return self._reader.buffered_bytes

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        self._reader.feed(data)

    def next_event(self) -> Request | NeedData:
        if self.state in (State.ERROR, State.CLOSED):
            raise ProtocolError(f"connection is in the {self.state.value} state")
        try:
            msg = self._reader.next()
            if isinstance(msg, NeedData):
                return msg
            if self.state is State.AWAIT_HELLO and not isinstance(msg, Hello):
                raise ProtocolError(f"expected Hello first, got {type(msg).__name__}")
            if self.state is State.READY and isinstance(msg, Hello):
                raise ProtocolError("Hello sent twice")
            if msg.rid == 0:
                if not isinstance(msg, ONE_WAY):
                    raise ProtocolError(f"{type(msg).__name__} needs a request id")
                return msg
            if msg.rid in self._pending:
                raise ProtocolError(f"request id {msg.rid} reused while still pending")
            self._pending.add(msg.rid)
            return msg
        except ProtocolError:
            self.state = State.ERROR
            raise

    def send(self, reply: Reply) -> bytes:
        if self.state in (State.CLOSED, State.ERROR):
            raise ProtocolError(f"cannot send on a connection in state {self.state.value}")
        if reply.rid == 0 and isinstance(reply, PUSHES) and self.state is State.READY:
            return encode_frame(reply)
        if reply.rid not in self._pending:
            raise ProtocolError(f"reply to request id {reply.rid} that is not pending")
        if self.state is State.AWAIT_HELLO and isinstance(reply, Welcome):
            self.state = State.READY
        self._pending.discard(reply.rid)
        return encode_frame(reply)

    def close(self) -> None:
        if self.state is not State.ERROR:
            self.state = State.CLOSED
