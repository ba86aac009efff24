"""Sans-IO protocol: a client and a server Connection wired together, no sockets."""

from __future__ import annotations

import struct

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.protocol import (
    NEED_DATA,
    ClientConnection,
    ProtocolError,
    ServerConnection,
    State,
    encode_frame,
    pack_ids,
    pack_keys,
    packing,
    unpack_ids,
    unpack_keys,
)
from kvoffload.protocol import messages as m
from kvoffload.protocol.errors import ErrorCode, NoSpaceError, error_for_code


def state_of(conn: ClientConnection | ServerConnection) -> State:
    """``conn.state`` read again: mypy keeps an asserted state across the calls that
    change it."""
    return conn.state


class ConnectionPair:
    """A client and a server joined by a perfect in-memory link."""

    def __init__(self, max_frame_bytes: int = m.DEFAULT_MAX_FRAME_BYTES) -> None:
        self.client = ClientConnection(max_frame_bytes)
        self.server = ServerConnection(max_frame_bytes)

    def request(self, req: m.Request) -> m.Request:
        self.server.receive_data(self.client.send(req))
        got = self.server.next_event()
        assert got is not NEED_DATA
        return got  # type: ignore[return-value]

    def reply(self, rep: m.Reply) -> m.Reply:
        self.client.receive_data(self.server.send(rep))
        got = self.client.next_event()
        assert got is not NEED_DATA
        return got  # type: ignore[return-value]

    def handshake(self) -> None:
        assert self.request(m.Hello(1, m.PROTOCOL_VERSION, "t", 1)) == m.Hello(
            1, m.PROTOCOL_VERSION, "t", 1
        )
        self.reply(m.Welcome(1, m.PROTOCOL_VERSION, "0", "i", 1, "/r", 1))
        assert self.client.state is State.READY and self.server.state is State.READY


def test_handshake_and_request_reply() -> None:
    p = ConnectionPair()
    p.handshake()
    keys, kb = pack_keys([b"a" * 36, b"b" * 36])
    req = m.Lookup(2, 0, keys, kb)
    assert p.request(req) == req
    assert p.reply(m.LookupReply(2, 1)) == m.LookupReply(2, 1)
    assert p.client.outstanding == frozenset() and p.server.pending == frozenset()


def test_pipelined_requests_and_out_of_order_replies() -> None:
    p = ConnectionPair()
    p.handshake()
    frames = b"".join(p.client.send(m.Ping(i)) for i in range(2, 6))
    p.server.receive_data(frames)
    got = []
    while (ev := p.server.next_event()) is not NEED_DATA:
        got.append(ev)
    assert got == [m.Ping(i) for i in range(2, 6)]
    for i in (5, 3, 2, 4):
        assert p.reply(m.Pong(i)) == m.Pong(i)


def test_byte_at_a_time_delivery() -> None:
    p = ConnectionPair()
    frame = p.client.send(m.Hello(1, 1, "slow", 3))
    for b in frame[:-1]:
        p.server.receive_data(bytes([b]))
        assert p.server.next_event() is NEED_DATA
    p.server.receive_data(frame[-1:])
    assert p.server.next_event() == m.Hello(1, 1, "slow", 3)


def test_request_before_hello_is_a_protocol_error() -> None:
    server = ServerConnection()
    server.receive_data(encode_frame(m.Ping(1)))
    with pytest.raises(ProtocolError, match="Hello first"):
        server.next_event()
    assert server.state is State.ERROR
    with pytest.raises(ProtocolError):
        server.next_event()


def test_client_refuses_to_skip_hello_and_reuse_ids() -> None:
    c = ClientConnection()
    with pytest.raises(ProtocolError):
        c.send(m.Ping(1))
    c.send(m.Hello(1, 1))
    with pytest.raises(ProtocolError):
        c.send(m.Hello(2, 1))


def test_unknown_reply_id_and_reply_to_nothing() -> None:
    p = ConnectionPair()
    p.handshake()
    with pytest.raises(ProtocolError, match="not pending"):
        p.server.send(m.Pong(99))
    p.client.receive_data(encode_frame(m.Pong(42)))
    with pytest.raises(ProtocolError, match="unknown request id"):
        p.client.next_event()
    assert p.client.state is State.ERROR


def test_connection_level_error_reply() -> None:
    p = ConnectionPair()
    p.handshake()
    p.client.receive_data(encode_frame(m.ErrorReply(0, ErrorCode.PROTOCOL_ERROR, "bye")))
    with pytest.raises(ProtocolError, match="bye"):
        p.client.next_event()


def test_error_reply_to_hello_allows_another_hello() -> None:
    p = ConnectionPair()
    p.request(m.Hello(1, 99))
    p.reply(m.ErrorReply(1, ErrorCode.VERSION_MISMATCH, "too new"))
    assert p.client.state is State.AWAIT_HELLO
    p.request(m.Hello(2, 1))


def test_frame_limits_both_directions() -> None:
    p = ConnectionPair(max_frame_bytes=4096)
    p.handshake()
    with pytest.raises(ProtocolError, match="split the call"):
        p.client.send(m.Lookup(2, 0, b"x" * 8000, 8))
    p.server.receive_data(struct.pack("<I", 4097))
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        p.server.next_event()


def test_one_way_requests_and_pushes_carry_rid_zero_and_no_answer() -> None:
    p = ConnectionPair()
    step = m.StepBatch(0, 1, 4, b"abcd", pack_ids([7]))
    with pytest.raises(ProtocolError, match="must be a single Hello"):
        p.client.send(step)  # not before the handshake
    p = ConnectionPair()
    p.handshake()
    assert p.request(step) == step
    assert p.server.pending == frozenset() and p.client.outstanding == frozenset()
    grant = m.LeaseGrant(0, 1, pack_ids([3, 4]))
    assert p.reply(grant) == grant  # a push answers nothing and needs no outstanding id
    # between a request and its reply, pushes pass and the reply still matches
    p.request(m.Ping(2))
    p.client.receive_data(p.server.send(m.Notice(0, ErrorCode.NOT_LEASED, "x")))
    p.client.receive_data(p.server.send(m.Pong(2)))
    assert isinstance(p.client.next_event(), m.Notice)
    assert p.client.next_event() == m.Pong(2)


def test_rid_zero_is_refused_for_anything_else() -> None:
    p = ConnectionPair()
    p.handshake()
    with pytest.raises(ProtocolError, match="start at 1"):
        p.client.send(m.Ping(0))
    p.server.receive_data(encode_frame(m.Ping(0)))
    with pytest.raises(ProtocolError, match="needs a request id"):
        p.server.next_event()
    q = ConnectionPair()
    q.handshake()
    q.client.receive_data(encode_frame(m.Pong(0)))
    with pytest.raises(ProtocolError, match="unknown request id 0"):
        q.client.next_event()
    with pytest.raises(ProtocolError, match="not pending"):
        q.server.send(m.Pong(0))


def test_garbage_and_unknown_tags_are_protocol_errors() -> None:
    for body in (b"\xc1", msgspec.msgpack.encode(["no_such_tag", 1]), msgspec.msgpack.encode(5)):
        s = ServerConnection()
        s.receive_data(struct.pack("<I", len(body)) + body)
        with pytest.raises(ProtocolError, match="undecodable"):
            s.next_event()


def test_a_whole_request_is_read_where_it_lies_and_anything_else_is_left_to_the_buffer() -> None:
    """``request_in`` decodes exactly one whole frame with nothing buffered before it; a
    partial frame, two frames or bytes already buffered are not its (None: the caller
    feeds them), and what it returns is checked as ``next_event``'s."""
    p = ConnectionPair()
    hello = p.client.send(m.Hello(1, m.PROTOCOL_VERSION, "t", 1))
    assert p.server.request_in(memoryview(hello + b"junk"), len(hello)) == m.Hello(
        1, m.PROTOCOL_VERSION, "t", 1
    )
    p.reply(m.Welcome(1, m.PROTOCOL_VERSION, "0", "i", 1, "/r", 1))
    assert p.client.state is State.READY and p.server.state is State.READY
    ping, pings = p.client.send(m.Ping(2)), p.client.send(m.Ping(3))
    for data in (ping[:3], ping[:-1], ping + pings, b""):
        assert p.server.request_in(memoryview(data), len(data)) is None
    p.server.receive_data(ping[:2])  # something buffered: a whole frame after it is not
    assert p.server.request_in(memoryview(pings), len(pings)) is None
    p.server.receive_data(ping[2:])
    assert p.server.next_event() == m.Ping(2)  # drained: whole frames are read again
    assert p.server.request_in(memoryview(pings), len(pings)) == m.Ping(3)
    assert p.server.pending == frozenset({2, 3})
    with pytest.raises(ProtocolError, match="reused while still pending"):
        p.server.request_in(memoryview(pings), len(pings))
    assert state_of(p.server) is State.ERROR


def test_whole_requests_are_refused_as_buffered_ones_are() -> None:
    hello = encode_frame(m.Hello(1, 1))
    ping = encode_frame(m.Ping(2))
    assert ServerConnection().request_in(memoryview(hello), len(hello)) is not None
    with pytest.raises(ProtocolError, match="Hello first"):
        ServerConnection().request_in(memoryview(ping), len(ping))
    body = b"\xc1"
    junk = struct.pack("<I", len(body)) + body
    s = ServerConnection()
    with pytest.raises(ProtocolError, match="undecodable"):
        s.request_in(memoryview(junk), len(junk))
    assert s.state is State.ERROR
    with pytest.raises(ProtocolError, match="error state"):
        s.request_in(memoryview(hello), len(hello))
    q = ConnectionPair(max_frame_bytes=64)
    q.handshake()
    big = encode_frame(m.Lookup(2, 0, b"x" * 100, 4))  # over the limit: left to the buffer
    assert q.server.request_in(memoryview(big), len(big)) is None
    q.server.receive_data(big)
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        q.server.next_event()


def test_a_whole_reply_is_read_where_it_lies_and_checked_as_buffered_ones_are() -> None:
    p = ConnectionPair()
    p.request(m.Hello(1, m.PROTOCOL_VERSION, "t", 1))
    welcome = p.server.send(m.Welcome(1, m.PROTOCOL_VERSION, "0", "i", 1, "/r", 1))
    assert isinstance(p.client.reply_in(memoryview(bytearray(welcome)), len(welcome)), m.Welcome)
    assert p.client.state is State.READY
    p.request(m.Ping(2))
    p.request(m.Ping(3))
    pong, pongs = encode_frame(m.Pong(2)), encode_frame(m.Pong(3))
    for data in (pong[:3], pong[:-1], pong + pongs, b""):
        assert p.client.reply_in(memoryview(data), len(data)) is None
    p.client.receive_data(pong[:2])  # something buffered: a whole frame after it is not
    assert p.client.reply_in(memoryview(pongs), len(pongs)) is None
    p.client.receive_data(pong[2:])
    assert p.client.next_event() == m.Pong(2)
    push = encode_frame(m.Notice(0, ErrorCode.NOT_LEASED, "x"))
    assert isinstance(p.client.reply_in(memoryview(push), len(push)), m.Notice)
    assert p.client.reply_in(memoryview(pongs), len(pongs)) == m.Pong(3)
    assert p.client.outstanding == frozenset()
    with pytest.raises(ProtocolError, match="unknown request id 3"):
        p.client.reply_in(memoryview(pongs), len(pongs))
    assert state_of(p.client) is State.ERROR
    q = ConnectionPair(max_frame_bytes=64)
    q.handshake()
    big = encode_frame(m.ErrorReply(2, ErrorCode.NO_SPACE, "x" * 100))
    assert q.client.reply_in(memoryview(big), len(big)) is None  # over the limit
    bye = encode_frame(m.ErrorReply(0, ErrorCode.PROTOCOL_ERROR, "bye"))
    with pytest.raises(ProtocolError, match="bye"):  # the daemon's last word
        q.client.reply_in(memoryview(bye), len(bye))
    assert q.client.state is State.ERROR


def test_replies_go_out_for_pending_requests_only_and_the_welcome_opens_the_connection() -> None:
    s = ServerConnection()
    with pytest.raises(ProtocolError, match="not pending"):
        s.send(m.Pong(1))
    s.receive_data(encode_frame(m.Hello(1, 1)))
    assert s.next_event() == m.Hello(1, 1)
    with pytest.raises(ProtocolError, match="not pending"):
        s.send(m.Notice(0, ErrorCode.NOT_LEASED, "x"))  # no pushes before the Welcome
    assert s.send(m.ErrorReply(1, ErrorCode.VERSION_MISMATCH, "old")) == encode_frame(
        m.ErrorReply(1, ErrorCode.VERSION_MISMATCH, "old")
    )
    assert s.state is State.AWAIT_HELLO
    s.receive_data(encode_frame(m.Hello(2, 1)))
    s.next_event()
    s.send(m.Welcome(2, 1, "0", "i", 1, "/r", 1))
    assert state_of(s) is State.READY
    s.receive_data(encode_frame(m.Ping(3)))
    s.next_event()
    assert s.send(m.Pong(3)) == encode_frame(m.Pong(3))
    with pytest.raises(ProtocolError, match="not pending"):
        s.send(m.Pong(3))
    assert s.send(m.Notice(0, ErrorCode.NOT_LEASED, "x")) == encode_frame(
        m.Notice(0, ErrorCode.NOT_LEASED, "x")
    )
    s.close()
    with pytest.raises(ProtocolError, match="state closed"):
        s.send(m.Pong(3))


# Golden bytes: any change here is a wire-format change (bump PROTOCOL_VERSION).
GOLDEN = [
    (m.Hello(1, 2, "e", 7), "0c000000 95 a568656c6c6f 01 02 a165 07"),
    (m.Ping(3), "07000000 92 a470696e67 03"),
    (m.Lookup(2, 0, b"\x01\x02", 1), "0f000000 95 a66c6f6f6b7570 02 00 c4020102 01"),
    (m.LookupReply(9, None), "08000000 93 a468697473 09 c0"),
    (m.ErrorReply(4, ErrorCode.NO_SPACE, "full"), "0e000000 94 a56572726f72 04 01 a466756c6c"),
    (
        m.OpenNamespace(5, "n", m.KVLayout([16], 1, 2, "m", "bf16", "")),
        "1b000000 96 a76f70656e5f6e73 05 a16e 96 9110 01 02 a16d a462663136 a0 c3 c2",
    ),
    (
        m.AttachWorker(6, 0, 1, [m.CacheDesc("cuda", 2, 16, -1, 8, 32, b"\x01")], b"\x02", b""),
        "24000000 9c a6617474616368 06 00 01 91 97 a463756461 02 10 ff 08 20 c40101 c40102 c400"
        " c2 c2 c2 01 90",
    ),
    (
        m.AttachWorker(
            6,
            0,
            1,
            [m.CacheDesc("memfd", 2, 16)],
            parts=2,
            canonical=[m.CanonicalDesc(64, b"", 2, 1)],
        ),
        "29000000 9c a6617474616368 06 00 01 91 97 a56d656d6664 02 10 ff 00 00 c400 c400 c400"
        " c2 c2 c2 02 91 94 40 c400 02 01",
    ),
    (
        m.StepBatch(0, 1, 2, b"ab", packing.pack_ids([3]), ack_seq=7, want_leases=8),
        "23000000 9d a473746570 00 01 02 c4026162 c408 0300000000000000 c400 c400 c400 c400 c400"
        " 07 08",
    ),
    (
        m.FeedPush(0, 1, 9, [m.EventMsg(b"ab", 2, False, packing.pack_ids([3]))]),
        "1c000000 96 a466656564 00 01 09 91 94 c4026162 02 c2 c408 0300000000000000 c2",
    ),
]


@pytest.mark.parametrize(("msg", "wire"), GOLDEN, ids=[type(g[0]).__name__ for g in GOLDEN])
def test_golden_bytes(msg: msgspec.Struct, wire: str) -> None:
    assert encode_frame(msg).hex() == wire.replace(" ", "")


def test_key_and_id_packing() -> None:
    keys = [b"\x00" * 36, b"abc\x00" * 9, b"\xff" * 36]  # trailing NULs must survive
    packed, kb = pack_keys(keys)
    assert kb == 36 and unpack_keys(packed, kb) == keys
    assert unpack_keys(b"", 0) == [] and pack_keys([]) == (b"", 0)
    with pytest.raises(ValueError, match="same length"):
        pack_keys([b"a", b"bb"])
    with pytest.raises(ValueError, match=r"1\.\.64 bytes"):
        pack_keys([b"x" * 65])
    with pytest.raises(ValueError, match="do not split"):
        unpack_keys(b"abc", 2)
    ids = np.array([0, 5, 2**40, -1])
    assert unpack_ids(pack_ids(ids)).tolist() == ids.tolist()
    # lists are packed without numpy: what numpy would make of them, or its refusal
    for odd in ([np.int64(5), True, -(2**63)], [1.0, 2.7], [np.int32(3)]):
        assert pack_ids(odd) == np.asarray(odd).astype("<i8").tobytes()
    with pytest.raises(OverflowError):
        pack_ids([2**64])
    with pytest.raises(ValueError, match="multiple of 8"):
        unpack_ids(b"1234567")


# (keys, key bytes): a struct splitter (up to SPLIT_MAX_KEYS keys), slices (more keys
# in at most SMALL_UNPACK_BYTES), numpy (longer fields)
@pytest.mark.parametrize(
    ("n", "kb"), [(2, 36), (3, 36), (128, 36), (129, 8), (256, 8), (57, 36), (2000, 36)]
)
def test_small_and_large_fields_unpack_alike(n: int, kb: int) -> None:
    """A step's few keys and slots are split without numpy, long fields with it: the
    three ways give the same keys (trailing NULs kept) and the same ids."""
    keys = [bytes([i % 256]) * (kb - 1) + b"\x00" for i in range(n)]
    packed, kb = pack_keys(keys)
    assert unpack_keys(packed, kb) == keys
    ids = [i * 2**33 - 7 for i in range(n)]
    assert packing.id_list(pack_ids(ids)) == ids == unpack_ids(pack_ids(ids)).tolist()
    assert pack_ids(ids) == pack_ids(np.array(ids, dtype=np.int64))  # a list packs alike
    with pytest.raises(ValueError, match="multiple of 8"):
        packing.id_list(b"1234567")


def test_key_splitters_stay_bounded() -> None:
    """Whoever sends keys chooses their length and count: the splitters kept for them
    never pass SPLITTERS, and a field splits the same after the memo was cleared."""
    for kb in range(1, m.MAX_KEY_BYTES + 1):
        for n in (2, 3, packing.SPLIT_MAX_KEYS):
            keys = [bytes([i % 256]) * kb for i in range(n)]
            assert unpack_keys(b"".join(keys), kb) == keys
            assert len(packing._splitters) <= packing.SPLITTERS
    assert unpack_keys(b"abcdef", 3) == [b"abc", b"def"]


def test_error_codes_map_to_typed_exceptions() -> None:
    assert isinstance(error_for_code(ErrorCode.NO_SPACE, "x"), NoSpaceError)
    assert error_for_code(999, "x").code is ErrorCode.INTERNAL
    assert str(error_for_code(1, "full")) == "[NO_SPACE] full"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_never_crash_the_server_side(data: bytes) -> None:
    """Anything a peer sends yields requests, NEED_DATA or ProtocolError; nothing else."""
    s = ServerConnection(max_frame_bytes=1024)
    s.receive_data(data)
    try:
        for _ in range(100):
            if s.next_event() is NEED_DATA:
                break
    except ProtocolError:
        assert s.state is State.ERROR


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 100), st.binary(min_size=1, max_size=64))
def test_mutated_valid_frames(pos: int, junk: bytes) -> None:
    frame = bytearray(encode_frame(m.Hello(1, 1, "x", 1)) + encode_frame(m.Ping(2)))
    pos %= len(frame)
    frame[pos : pos + len(junk)] = junk
    s = ServerConnection(max_frame_bytes=1024)
    s.receive_data(bytes(frame))
    try:
        while s.next_event() is not NEED_DATA:
            pass
    except ProtocolError:
        pass
