"""Every request field whose size its sender chooses is bounded by the schema: the
decoder refuses a longer one before any handler sees it, and the refusal quotes at
most a few hundred characters of what it refused."""

from __future__ import annotations

import struct
from typing import Annotated, Any

import msgspec
import msgspec.inspect as mi
import pytest

import kvoffload
from kvoffload.protocol import messages as m
from kvoffload.protocol.connection import (
    MAX_ERROR_CHARS,
    ClientConnection,
    ServerConnection,
    encode_frame,
)
from kvoffload.protocol.errors import InvalidArgumentError, ProtocolError

SIZED = (
    mi.StrType,
    mi.BytesType,
    mi.ByteArrayType,
    mi.MemoryViewType,
    mi.ListType,
    mi.SetType,
    mi.FrozenSetType,
    mi.VarTupleType,
    mi.DictType,
)


def unbounded(t: mi.Type, path: str, seen: set[type]) -> list[str]:
    """The paths of every field under ``t`` whose size is not bounded by its type."""
    out = []
    if isinstance(t, SIZED) and t.max_length is None:
        out.append(path)
    if isinstance(t, mi.AnyType):
        out.append(f"{path} (Any)")
    elif isinstance(t, mi.StructType):
        if t.cls not in seen:
            seen.add(t.cls)
            for f in t.fields:
                out += unbounded(f.type, f"{t.cls.__name__}.{f.name}", seen)
    elif isinstance(t, mi.UnionType):
        for u in t.types:
            out += unbounded(u, path, seen)
    elif isinstance(t, (mi.ListType, mi.SetType, mi.FrozenSetType, mi.VarTupleType)):
        out += unbounded(t.item_type, f"{path}[]", seen)
    elif isinstance(t, mi.DictType):
        out += unbounded(t.key_type, f"{path}{{key}}", seen)
        out += unbounded(t.value_type, f"{path}{{value}}", seen)
    elif isinstance(t, mi.TupleType):
        for i, item in enumerate(t.item_types):
            out += unbounded(item, f"{path}[{i}]", seen)
    return out


def test_every_request_field_whose_size_the_sender_chooses_is_bounded() -> None:
    assert unbounded(mi.type_info(m.Request), "Request", set()) == []


class Inner(msgspec.Struct):
    text: str
    ok: m.Text = ""


class Outer(msgspec.Struct):
    inners: Annotated[list[Inner], msgspec.Meta(max_length=4)]
    maybe: bytes | None = None
    table: dict[m.Text, m.Text] = {}
    anything: Any = None


def test_the_walk_finds_an_unbounded_field_wherever_it_hides() -> None:
    """The check above can fail: a field without a bound, in a nested struct, a list
    or an optional, is named."""
    found = unbounded(mi.type_info(Outer), "Outer", set())
    assert found == ["Inner.text", "Outer.maybe", "Outer.table", "Outer.anything (Any)"]


def refused(msg: Any) -> str:
    """The protocol error a server connection answers ``msg`` with, after a Hello."""
    server = ServerConnection()
    server.receive_data(encode_frame(m.Hello(1, m.PROTOCOL_VERSION)) + encode_frame(msg))
    assert isinstance(server.next_event(), m.Hello)
    with pytest.raises(ProtocolError) as info:
        server.next_event()
    return str(info.value)


LAYOUT = m.KVLayout([4096])


@pytest.mark.parametrize(
    "msg",
    [
        m.Hello(2, m.PROTOCOL_VERSION, "n" * (m.MAX_CLIENT_NAME_CHARS + 1)),
        m.OpenNamespace(2, "x" * (m.MAX_TEXT_CHARS + 1), LAYOUT),
        m.OpenNamespace(2, "x", m.KVLayout([1] * (m.MAX_TENSORS + 1))),
        m.OpenNamespace(2, "x", m.KVLayout([1], model="m" * (m.MAX_TEXT_CHARS + 1))),
        m.Lookup(2, 0, b"k" * (m.MAX_KEYS_PER_MESSAGE * m.MAX_KEY_BYTES + 1), 1),
        m.AttachWorker(2, 0, 0, [m.CacheDesc("memfd", 1, 1)] * (m.MAX_TENSORS + 1)),
        m.AttachWorker(2, 0, 0, [m.CacheDesc("memfd", 1, 1, ipc_handle=b"h" * 257)]),
        m.SubmitStore(2, 0, 1, b"i" * (m.MAX_IDS_PER_MESSAGE * 8 + 8), b""),
        m.WaitJobs(2, 0, list(range(m.MAX_JOB_IDS + 1))),
        m.Evict(2, key_prefix=b"p" * (m.MAX_KEY_BYTES + 1)),
        m.DropNamespace(2, "x" * (m.MAX_TEXT_CHARS + 1)),
    ],
    ids=lambda msg: type(msg).__name__,
)
def test_a_field_past_its_bound_is_refused_at_decode(msg: Any) -> None:
    assert "length <=" in refused(msg)


def test_at_the_bound_a_field_decodes() -> None:
    server = ServerConnection()
    name = "n" * m.MAX_CLIENT_NAME_CHARS
    server.receive_data(encode_frame(m.Hello(1, m.PROTOCOL_VERSION, name)))
    assert server.next_event() == m.Hello(1, m.PROTOCOL_VERSION, name)


def test_a_refusal_quotes_little_of_what_it_refused() -> None:
    """An unknown tag of 4 MiB of backslashes (msgspec quotes a tag whole, and a log
    line escapes every backslash): the error is a few hundred characters."""
    body = msgspec.msgpack.encode(["\\" * (4 << 20), 2])
    server = ServerConnection()
    server.receive_data(encode_frame(m.Hello(1, m.PROTOCOL_VERSION)))
    server.receive_data(struct.pack("<I", len(body)) + body)
    assert isinstance(server.next_event(), m.Hello)
    with pytest.raises(ProtocolError) as info:
        server.next_event()
    assert len(str(info.value)) < MAX_ERROR_CHARS + 100


def test_a_client_refuses_a_request_past_its_bounds_before_sending() -> None:
    """A name, layout or cache list a user or engine chose past its bound fails at once
    with a clear error on the client, which the daemon would otherwise refuse by closing
    the connection (and a client that reconnects would be refused again, for ever); the
    connection stays usable. A client name is cut to its bound instead: it is only for
    people reading ``kvoffloadctl clients``."""
    client = ClientConnection()
    client.send(m.Hello(1, m.PROTOCOL_VERSION))
    client.receive_data(encode_frame(m.Welcome(1, m.PROTOCOL_VERSION, "0", "i", 1, "/r", 1)))
    assert isinstance(client.next_event(), m.Welcome)
    too_long = m.OpenNamespace(2, "x" * (m.MAX_TEXT_CHARS + 1), LAYOUT)
    with pytest.raises(
        InvalidArgumentError, match=r"OpenNamespace: Expected `str` of length <= 4096"
    ):
        client.send(too_long)
    assert client.send(m.OpenNamespace(2, "x", LAYOUT))  # rid 2 was not taken
    with pytest.raises(InvalidArgumentError, match=r"DropNamespace: Expected `str` of length"):
        client.send(m.DropNamespace(3, "x" * (m.MAX_TEXT_CHARS + 1)))  # admin input, checked too
    with kvoffload.Client("/nonexistent", name="n" * 1000) as c:
        assert c.name == "n" * m.MAX_CLIENT_NAME_CHARS
