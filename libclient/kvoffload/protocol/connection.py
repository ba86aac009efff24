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
from typing import Generic, NoReturn, TypeVar

import msgspec

from kvoffload.protocol.errors import InvalidArgumentError, ProtocolError, error_for_code
from kvoffload.protocol.messages import (
    CHECKED_ON_SEND,
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
_length_of = _LEN.unpack_from
HEADER_BYTES = _LEN.size


# What a decoder's message may quote of the frame (msgspec quotes an unknown tag
# whole): the error goes to the log and back to the sender, never megabytes of it.
MAX_ERROR_CHARS = 200


_checkers = {t: msgspec.msgpack.Decoder(t) for t in CHECKED_ON_SEND}


def check_bounds(req: Request) -> None:
    """InvalidArgumentError if a field of ``req`` is past its schema bound: the daemon
    would refuse the frame and close the connection, and a client that retried would
    be refused again for ever."""
    try:
        _checkers[type(req)].decode(msgspec.msgpack.encode(req))
    except msgspec.ValidationError as exc:
        raise InvalidArgumentError(f"{type(req).__name__}: {exc}") from None


def undecodable(exc: Exception) -> ProtocolError:
    text = str(exc)
    if len(text) > MAX_ERROR_CHARS:
        text = f"{text[:MAX_ERROR_CHARS]}... ({len(text)} characters)"
    return ProtocolError(f"undecodable frame: {text}")


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
_NO_LENGTH = bytes(HEADER_BYTES)


def encode_frame(msg: msgspec.Struct) -> bytes:
    """One length-prefixed frame (no state checks; the Connection adds those)."""
    buf = bytearray()
    append_frame(msg, buf)
    return bytes(buf)


def append_frame(msg: msgspec.Struct, buf: bytearray) -> int:
    """Append one frame to ``buf`` (encoded in place: no copy of the body); returns the
    body's length."""
    start = len(buf)
    buf += _NO_LENGTH
    _encoder.encode_into(msg, buf, -1)
    length = len(buf) - start - HEADER_BYTES
    _LEN.pack_into(buf, start, length)
    return length


def frame_length(data: bytes | bytearray | memoryview) -> int:
    """The body length a frame starting at ``data[0]`` announces (``data`` holds at
    least ``HEADER_BYTES``)."""
    return int(_LEN.unpack_from(data)[0])


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

    def decode(self, body: bytes | bytearray | memoryview) -> In:
        """One frame's body, whole (read without buffering it here)."""
        try:
            return self._decoder.decode(body)
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            # msgspec reports invalid UTF-8 in a str field as UnicodeDecodeError.
            raise undecodable(exc) from exc

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
        msg = self.decode(memoryview(self._buf)[start:end])
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
        buf = bytearray()
        self.send_into(req, buf)
        return bytes(buf)

    def send_into(self, req: Request, buf: bytearray) -> None:
        """Append ``req``'s frame to ``buf`` (what ``send`` returns, without a copy)."""
        state, rid = self.state, req.rid
        if type(req) in CHECKED_ON_SEND:
            check_bounds(req)
        if state is not State.READY:
            if state in (State.CLOSED, State.ERROR):
                raise ProtocolError(f"cannot send on a connection in state {state.value}")
            if not isinstance(req, Hello) or self._hello_rid is not None:
                raise ProtocolError("the first request must be a single Hello")
            self._hello_rid = rid
        elif rid == 0 and isinstance(req, ONE_WAY):
            self._encode_into(req, buf)
            return
        if rid <= 0:
            raise ProtocolError("request ids start at 1 (0 is reserved for one-way requests)")
        if rid in self._outstanding:
            raise ProtocolError(f"request id {rid} is already outstanding")
        start = len(buf)  # _encode_into, written out: once per request
        buf += _NO_LENGTH
        _encoder.encode_into(req, buf, -1)
        length = len(buf) - start - HEADER_BYTES
        if length > self.max_frame_bytes:
            self._too_large(buf, start, length)
        _LEN.pack_into(buf, start, length)
        self._outstanding.add(rid)

    def _encode_into(self, req: Request, buf: bytearray) -> None:
        start = len(buf)
        length = append_frame(req, buf)
        if length > self.max_frame_bytes:
            self._too_large(buf, start, length)

    def _too_large(self, buf: bytearray, start: int, length: int) -> NoReturn:
        del buf[start:]
        raise ProtocolError(
            f"request of {length} bytes exceeds the frame limit of "
            f"{self.max_frame_bytes}; split the call"
        )

    @property
    def buffered_bytes(self) -> int:
        r = self._reader  # read here, not through its property: checked per message
        return len(r._buf) - r._pos

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        self._reader.feed(data)

    def reply_in(self, data: memoryview, nbytes: int) -> Reply | None:
        """The reply in ``data[:nbytes]`` if those bytes are exactly one whole frame and
        nothing is buffered before them: decoded where it lies, never buffered, and
        checked as ``next_event`` checks what it returns. None: they are not (feed them
        to ``receive_data``)."""
        r, length = self._reader, nbytes - HEADER_BYTES
        if length < 0 or len(r._buf) != r._pos or _length_of(data)[0] != length or length > r._max:
            return None
        if self.state is State.ERROR:
            raise ProtocolError("connection is in the ERROR state")
        try:
            try:  # r.decode, written out: once per message
                msg = r._decoder.decode(data[HEADER_BYTES:nbytes])
            except (msgspec.DecodeError, UnicodeDecodeError) as exc:
                raise undecodable(exc) from exc
            return self._check(msg)
        except ProtocolError:
            self.state = State.ERROR
            raise

    def next_event(self) -> Reply | NeedData:
        if self.state is State.ERROR:
            raise ProtocolError("connection is in the ERROR state")
        try:
            msg = self._reader.next()
            if isinstance(msg, NeedData):
                return msg
            return self._check(msg)
        except ProtocolError:
            self.state = State.ERROR
            raise

    def _check(self, msg: Reply) -> Reply:
        rid = msg.rid
        if rid and self.state is State.READY:  # the common case: a reply to a request
            if rid not in self._outstanding:
                raise ProtocolError(f"reply to unknown request id {rid}")
            self._outstanding.discard(rid)
            return msg
        if rid == 0 and isinstance(msg, ErrorReply):
            # rid 0 is the server's last word before it closes the connection.
            self.state = State.ERROR
            raise error_for_code(msg.code, f"kvoffloadd closed the connection: {msg.message}")
        if rid == 0 and isinstance(msg, PUSHES) and self.state is State.READY:
            return msg
        if rid not in self._outstanding:
            raise ProtocolError(f"reply to unknown request id {rid}")
        self._outstanding.discard(rid)
        if self.state is State.AWAIT_HELLO and rid == self._hello_rid:
            if isinstance(msg, Welcome):
                self.state = State.READY
            elif isinstance(msg, ErrorReply):
                self._hello_rid = None
            else:
                raise ProtocolError(f"expected a Welcome, got {type(msg).__name__}")
        return msg

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
        r = self._reader  # read here, not through its property: checked per message
        return len(r._buf) - r._pos

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        self._reader.feed(data)

    def request_in(self, data: memoryview, nbytes: int) -> Request | None:
        """The request in ``data[:nbytes]`` if those bytes are exactly one whole frame
        and nothing is buffered before them: decoded where it lies, never buffered, and
        checked as ``next_event`` checks what it returns. None: they are not (feed them
        to ``receive_data``)."""
        r, length = self._reader, nbytes - HEADER_BYTES
        if length < 0 or len(r._buf) != r._pos or _length_of(data)[0] != length or length > r._max:
            return None
        state = self.state
        if state is not State.READY and state is not State.AWAIT_HELLO:
            raise ProtocolError(f"connection is in the {state.value} state")
        try:
            try:  # r.decode, written out: once per message
                msg = r._decoder.decode(data[HEADER_BYTES:nbytes])
            except (msgspec.DecodeError, UnicodeDecodeError) as exc:
                raise undecodable(exc) from exc
            rid = msg.rid
            if rid and state is State.READY and type(msg) is not Hello:  # the common case
                if rid in self._pending:
                    raise ProtocolError(f"request id {rid} reused while still pending")
                self._pending.add(rid)
                return msg
            return self._check(msg)
        except ProtocolError:
            self.state = State.ERROR
            raise

    def next_event(self) -> Request | NeedData:
        if self.state in (State.ERROR, State.CLOSED):
            raise ProtocolError(f"connection is in the {self.state.value} state")
        try:
            msg = self._reader.next()
            if isinstance(msg, NeedData):
                return msg
            return self._check(msg)
        except ProtocolError:
            self.state = State.ERROR
            raise

    def _check(self, msg: Request) -> Request:
        rid = msg.rid
        if self.state is State.READY:
            if type(msg) is Hello:
                raise ProtocolError("Hello sent twice")
        elif not isinstance(msg, Hello):
            raise ProtocolError(f"expected Hello first, got {type(msg).__name__}")
        if rid == 0:
            if not isinstance(msg, ONE_WAY):
                raise ProtocolError(f"{type(msg).__name__} needs a request id")
            return msg
        if rid in self._pending:
            raise ProtocolError(f"request id {rid} reused while still pending")
        self._pending.add(rid)
        return msg

    def send(self, reply: Reply) -> bytes:
        buf = bytearray()
        self.send_into(reply, buf)
        return bytes(buf)

    def send_into(self, reply: Reply, buf: bytearray) -> None:
        """Append ``reply``'s frame to ``buf`` (what ``send`` returns, without a copy)."""
        state, rid = self.state, reply.rid
        if state is State.READY and rid in self._pending:  # the common case
            self._pending.discard(rid)
        elif state is not State.READY and state is not State.AWAIT_HELLO:
            raise ProtocolError(f"cannot send on a connection in state {state.value}")
        elif rid == 0 and state is State.READY and isinstance(reply, PUSHES):
            pass
        elif rid not in self._pending:
            raise ProtocolError(f"reply to request id {rid} that is not pending")
        else:
            if state is State.AWAIT_HELLO and isinstance(reply, Welcome):
                self.state = State.READY
            self._pending.discard(rid)
        start = len(buf)  # append_frame, written out: once per reply
        buf += _NO_LENGTH
        _encoder.encode_into(reply, buf, -1)
        _LEN.pack_into(buf, start, len(buf) - start - HEADER_BYTES)

    def close(self) -> None:
        if self.state is not State.ERROR:
            self.state = State.CLOSED
