"""Invariants 4 and 6: bad input gets a clear error for that client only."""

from __future__ import annotations

import socket
import struct

import msgspec
import pytest
from canary import Canary

import kvoffload
from kvoffload.protocol import messages as m
from kvoffload.protocol.connection import encode_frame
from kvoffload.protocol.errors import ErrorCode
from kvoffloadbench.launch import DaemonProcess

LAYOUT = kvoffload.KVLayout(tensor_page_bytes=[4096], block_size_factor=2)


def raw_exchange(path: str, payload: bytes) -> tuple[m.ErrorReply | None, bool]:
    """Send raw bytes; return the daemon's final error reply and whether it closed."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    s.sendall(payload)
    data = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    s.close()
    replies = []
    dec = msgspec.msgpack.Decoder(m.Reply)
    while len(data) >= 4:
        (n,) = struct.unpack_from("<I", data)
        replies.append(dec.decode(data[4 : 4 + n]))
        data = data[4 + n :]
    last = replies[-1] if replies else None
    return (last if isinstance(last, m.ErrorReply) else None), True


HELLO = encode_frame(m.Hello(1, m.PROTOCOL_VERSION, "raw", 0))


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        (struct.pack("<I", 5) + b"\xc1\xc1\xc1\xc1\xc1", "undecodable"),  # malformed msgpack
        (struct.pack("<I", 1 << 30), "exceeds the limit"),  # oversized frame
        (HELLO + encode_frame(m.Pong(2)), "undecodable"),  # a reply tag where a request goes
        (HELLO + struct.pack("<I", 3) + msgspec.msgpack.encode(["nope", 1]), "undecodable"),
        (encode_frame(m.Ping(1)), "expected Hello"),  # out of order
        (HELLO + HELLO.replace(b"\x01", b"\x02", 1), "Hello sent twice"),
    ],
    ids=["malformed", "oversized", "reply-tag", "unknown-tag", "before-hello", "hello-twice"],
)
def test_protocol_errors_close_only_that_connection(
    daemon: DaemonProcess, payload: bytes, needle: str
) -> None:
    good = kvoffload.connect(daemon.socket_path)
    ns = good.namespace("ok", LAYOUT)
    err, closed = raw_exchange(daemon.socket_path, payload)
    assert closed
    assert err is not None and err.code == ErrorCode.PROTOCOL_ERROR and err.rid == 0
    assert needle in err.message
    # everyone else keeps being served
    assert good.ping() < 5
    assert ns.lookup([b"x" * 8]) == 0
    assert good.stats()["errors"]["PROTOCOL_ERROR"] >= 1
    good.close()


def test_truncated_frame_then_disconnect_is_harmless(daemon: DaemonProcess) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(daemon.socket_path)
    s.sendall(HELLO[:-2])
    s.close()
    c = kvoffload.connect(daemon.socket_path)
    c.ping()  # the connection is still served
    c.close()


def test_bad_block_ids_and_unleased_slots_are_refused(daemon: DaemonProcess) -> None:
    c = kvoffload.connect(daemon.socket_path)
    ns = c.namespace("a", LAYOUT)
    other = c.namespace(
        "b", LAYOUT.__class__(tensor_page_bytes=[4096], block_size_factor=2, salt="b")
    )
    cache = kvoffload.shared_kv_cache(8, 4096)
    w = ns.attach_worker([cache])
    wb = other.attach_worker([kvoffload.shared_kv_cache(8, 4096)])
    keys = [b"key00001", b"key00002"]
    plan = ns.prepare_store(keys)
    assert plan is not None

    def refused(ok: bool, exc_type: type[Exception], needle: str) -> None:
        assert ok is False
        assert isinstance(w.last_error if w.last_error else wb.last_error, exc_type)
        err = w.last_error or wb.last_error
        assert needle in str(err), str(err)
        w.last_error = wb.last_error = None

    refused(w.submit_store(1, [0, 1, 2, 8], plan.slots), kvoffload.InvalidArgumentError, "id 8")
    refused(w.submit_store(1, [0, 1, -1, 2], plan.slots), kvoffload.InvalidArgumentError, "id -1")
    refused(w.submit_store(1, [0, 1], plan.slots), kvoffload.InvalidArgumentError, "slots whole")
    refused(w.submit_store(1, [0, 1, 2, 3], [7, 8]), kvoffload.NotLeasedError, "not leased")
    refused(w.submit_store(1, [0, 1, 2, 3], [10**12, 0]), kvoffload.NotLeasedError, "not leased")
    # slots leased to namespace "a" mean nothing in namespace "b"
    refused(wb.submit_store(1, [0, 1, 2, 3], plan.slots), kvoffload.NotLeasedError, "not leased")
    # a slot leased for a store is not pinned for a load
    refused(w.submit_load(1, plan.slots, [0, 1, 2, 3]), kvoffload.NotLeasedError, "pinned")
    # completing before the copy ran is refused (nothing becomes visible over garbage)
    with pytest.raises(kvoffload.InvalidArgumentError):
        ns.complete_store(keys)
    assert ns.lookup(keys) == 0
    # the valid request still works afterwards, on the same connection
    assert w.submit_store(1, [0, 1, 2, 3], plan.slots)
    w.wait([1])
    assert [r.success for r in w.get_finished()] == [True]
    ns.complete_store(keys)
    assert ns.lookup(keys) == 2
    lp = ns.prepare_load(keys)
    refused(w.submit_load(2, lp.slots[:1], [0], skip=2), kvoffload.InvalidArgumentError, "skip")
    refused(w.submit_load(2, lp.slots * 2, [0] * 8), kvoffload.InvalidArgumentError, "twice")
    ns.complete_load(keys)
    with pytest.raises(kvoffload.NotFoundError):
        ns.prepare_load([b"missing!"])
    with pytest.raises(kvoffload.InvalidArgumentError):
        ns.prepare_load([b"a" * 8, b"b" * 9])  # keys of one call must share a length
    c.close()


def test_unsealed_or_foreign_cache_is_refused(daemon: DaemonProcess) -> None:
    import torch

    c = kvoffload.connect(daemon.socket_path)
    ns = c.namespace("a", LAYOUT)
    with pytest.raises(kvoffload.InvalidArgumentError, match="shared_kv_cache"):
        ns.attach_worker([torch.zeros(8, 4096, dtype=torch.int8)], copy_mode="daemon")
    with pytest.raises(kvoffload.InvalidArgumentError, match="copy_mode"):
        ns.attach_worker([torch.zeros(8, 4096, dtype=torch.int8)], copy_mode="magic")
    with pytest.raises(kvoffload.InvalidArgumentError, match="layout"):
        ns.attach_worker([kvoffload.shared_kv_cache(8, 2048)])
    with pytest.raises(kvoffload.InvalidArgumentError, match="rank"):
        ns.attach_worker([kvoffload.shared_kv_cache(8, 4096)], rank=1)
    c.ping()  # the connection is still served
    c.close()


def test_slow_reader_does_not_stall_others(daemon: DaemonProcess) -> None:
    """A client that pipelines requests and never reads does not block another client
    (invariant 15, measured by the canary)."""
    canary = Canary(daemon.socket_path, daemon.pid)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(daemon.socket_path)
    s.sendall(HELLO + b"".join(encode_frame(m.GetStats(i)) for i in range(2, 2000)))
    c = kvoffload.connect(daemon.socket_path)
    for _ in range(500):  # while the daemon serves the reader's 2,000 requests, then pauses it
        c.ping()
    canary.stop()
    print(f"\nslow reader: {canary.line()}")
    canary.check("slow reader")
    s.close()
    c.close()


def test_no_space_when_everything_is_pinned_then_recovers() -> None:
    with DaemonProcess("16MiB", "--log-level", "warning", "--extent-size", "2MiB") as d:
        c = kvoffload.connect(d.socket_path)
        layout = kvoffload.KVLayout(tensor_page_bytes=[1 << 20])
        ns = c.namespace("big", layout)
        w = ns.attach_worker([kvoffload.shared_kv_cache(64, 1 << 20)])
        keys = [i.to_bytes(8, "big") for i in range(64)]
        stored: list[bytes] = []
        for k in keys:  # store and pin one block at a time until nothing is evictable
            plan = ns.prepare_store([k])
            if plan is None:
                break
            assert plan.evicted_keys == []
            job = len(stored) + 1
            assert w.submit_store(job, [len(stored)], plan.slots)
            w.wait([job])
            ns.complete_store([k])
            ns.prepare_load([k])
            stored.append(k)
        w.get_finished()
        assert 0 < len(stored) < 64
        assert ns.prepare_store([b"overflow"]) is None  # NO_SPACE: all pinned
        assert isinstance(ns.last_error, kvoffload.NoSpaceError)
        assert c.stats()["errors"]["NO_SPACE"] >= 1
        ns.complete_load(stored)
        plan = ns.prepare_store([b"overflow"])
        assert plan is not None and plan.evicted_keys == stored[:1]
        c.close()


def test_protocol_version_mismatch_is_refused_clearly(daemon: DaemonProcess) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(daemon.socket_path)
    s.sendall(encode_frame(m.Hello(1, 99, "future", 0)))
    data = s.recv(4096)
    s.close()
    reply = msgspec.msgpack.decode(data[4:], type=m.Reply)
    assert isinstance(reply, m.ErrorReply)
    assert reply.code == ErrorCode.VERSION_MISMATCH and "protocol 99" in reply.message


def test_another_client_cannot_write_through_a_lease_of_the_same_namespace(
    daemon: DaemonProcess,
) -> None:
    """Invariant 9: a lease is checked per client, not per namespace. B, in A's
    namespace, names A's prepared slots: refused, and A's key loads A's bytes."""
    a, b = kvoffload.connect(daemon.socket_path), kvoffload.connect(daemon.socket_path)
    ns_a, ns_b = a.namespace("shared", LAYOUT), b.namespace("shared", LAYOUT)
    cache_a, cache_b = kvoffload.shared_kv_cache(8, 4096), kvoffload.shared_kv_cache(8, 4096)
    cache_a.fill_(0x11)
    cache_b.fill_(0x66)
    wa, wb = ns_a.attach_worker([cache_a]), ns_b.attach_worker([cache_b])
    keys = [b"mine0001"]
    plan = ns_a.prepare_store(keys)
    assert plan is not None
    assert not wb.submit_store(1, [0, 1], plan.slots)
    assert isinstance(wb.last_error, kvoffload.NotLeasedError), wb.last_error
    assert "not leased" in str(wb.last_error)
    with pytest.raises(kvoffload.NotLeasedError):  # nor may B complete A's store
        ns_b.complete_store(keys)
    assert wa.submit_store(1, [0, 1], plan.slots), wa.last_error
    wa.wait([1])
    assert [r.success for r in wa.get_finished()] == [True]
    ns_a.complete_store(keys)
    out = kvoffload.shared_kv_cache(8, 4096)
    wo = ns_b.attach_worker([out])
    lp = ns_b.prepare_load(keys)
    assert wo.submit_load(2, lp.slots, [4, 5]), wo.last_error
    wo.wait([2])
    assert [r.success for r in wo.get_finished()] == [True]
    ns_b.complete_load(keys)
    assert bool((out[4:6] == 0x11).all()) and not out[:4].any()
    a.close()
    b.close()
