"""Fuzzing a live daemon: 100,000 frames of typed-but-random and mutated requests.

Most frames are well-formed requests of every type with random field values (huge,
negative, empty, unknown ids, wrong lengths; sizes within each field's schema bound,
which the decoder's tests cover past it), which exercise every handler's
validation while the connection stays open; each batch ends with a mutated frame
(bit flips, truncation, random bytes) that exercises the decoder and usually ends the
connection, after the replies to everything before it. Afterwards a client that was
storing before the fuzz, and a new one, must still be served correctly, with identical
bytes.
"""

from __future__ import annotations

import contextlib
import random
import socket
import struct
import threading
import typing
from typing import Any

import msgspec
import numpy as np

import kvoffload
from kvoffload.protocol import messages as m
from kvoffload.protocol.connection import encode_frame
from kvoffloadbench.launch import DaemonProcess

FRAMES = 100_000
BATCH = 1000
INTS = [0, 1, -1, 2, 7, 2**31, 2**63 - 1, -(2**63), 4096, 1 << 20]
REQUESTS = [t for t in typing.get_args(m.Request) if t is not m.Hello]
LAYOUT = kvoffload.KVLayout(tensor_page_bytes=[4096])


def value(tp: Any, rng: random.Random, depth: int = 0) -> Any:
    """A random value of type ``tp`` (the field types the protocol uses)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:  # a bounded field: cut to its bound
        most = [
            x.max_length
            for x in args[1:]
            if isinstance(x, msgspec.Meta) and x.max_length is not None
        ]
        got = value(args[0], rng, depth)
        return got[: min(most)] if most else got
    if args and type(None) in args:
        return None if rng.random() < 0.3 else value(args[0], rng, depth)
    if origin is list:
        return [value(args[0], rng, depth + 1) for _ in range(rng.randrange(0 if depth else 4))]
    if tp is bool:
        return rng.random() < 0.5
    if tp is int:
        return rng.choice(INTS) if rng.random() < 0.5 else rng.randrange(-5, 64)
    if tp is bytes:
        return rng.randbytes(rng.choice([0, 1, 8, 16, 36, 64, 65, 512]))
    if tp is str:
        return rng.choice(["", "fuzz", "x" * 300, "\u2603", f"n-{rng.randrange(4)}"])
    hints = typing.get_type_hints(tp, include_extras=True)
    return tp(**{f.name: value(hints[f.name], rng, depth) for f in msgspec.structs.fields(tp)})


def request(rng: random.Random) -> bytes:
    """A well-formed request. One-way types go out with rid 0 half of the time (no
    reply); everything else gets a request id, so it must be answered."""
    cls = rng.choice(REQUESTS)
    if cls is m.Evict:  # keep fuzz evictions away from the canary's namespace
        return encode_frame(m.Evict(rng.randrange(1, 1 << 20), "fuzz-only"))
    msg = value(cls, rng)
    one_way = issubclass(cls, m.ONE_WAY) and rng.random() < 0.5
    rid = 0 if one_way else rng.randrange(1, 1 << 31)
    return encode_frame(msgspec.structs.replace(msg, rid=rid))


def expects_reply(frame: bytes) -> bool:
    return msgspec.msgpack.decode(frame[4:], type=m.Request).rid != 0


def mutated(rng: random.Random) -> bytes:
    frame = bytearray(request(rng))
    kind = rng.randrange(3)
    if kind == 0:
        for _ in range(rng.randrange(1, 4)):
            frame[rng.randrange(4, len(frame))] ^= 1 << rng.randrange(8)
    elif kind == 1:
        cut = rng.randrange(5, len(frame) + 1)
        frame = bytearray(struct.pack("<I", cut - 4)) + frame[4:cut]
    else:
        body = rng.randbytes(rng.randrange(1, 64))
        frame = bytearray(struct.pack("<I", len(body)) + body)
    return bytes(frame)


def run_batch(path: str, frames: list[bytes]) -> int:
    """Send Hello, the frames and a final Ping; return how many replies came back.

    Replies are read while the frames are sent, as a real client does: a client that
    stops reading is (rightly) dropped by the daemon's output-buffer limit.
    """
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(path)
    payload = b"".join(frames) + encode_frame(m.Ping(987654321))
    hello = encode_frame(m.Hello(1, m.PROTOCOL_VERSION, "fuzz", 0))
    sender = threading.Thread(target=_send_all, args=(s, hello + payload), daemon=True)
    sender.start()
    data = bytearray()
    replies = 0
    dec = msgspec.msgpack.Decoder(m.Reply)
    try:
        while True:
            chunk = s.recv(1 << 20)
            if not chunk:
                break
            data += chunk
            while len(data) >= 4 and len(data) >= 4 + struct.unpack_from("<I", data)[0]:
                (n,) = struct.unpack_from("<I", data)
                reply = dec.decode(bytes(data[4 : 4 + n]))
                del data[: 4 + n]
                replies += reply.rid != 0  # pushes answer nothing
                if isinstance(reply, m.Pong) and reply.rid == 987654321:
                    return replies - 1  # the Welcome counts, the final Pong does not
    except (ConnectionResetError, BrokenPipeError):
        pass
    finally:
        s.close()
        sender.join(30)
    return replies - 1


def _send_all(s: socket.socket, payload: bytes) -> None:
    with contextlib.suppress(OSError):  # the daemon may close on a mutated frame
        s.sendall(payload)


def test_100k_fuzzed_frames_leave_the_daemon_serving_correctly() -> None:
    rng = random.Random(20261122)
    with DaemonProcess("64MiB", "--log-level", "error") as d:
        canary = kvoffload.connect(d.socket_path)
        ns = canary.namespace("canary", LAYOUT)
        src = kvoffload.shared_kv_cache(8, 4096)
        src.copy_(random_int8(8 * 4096).reshape(8, 4096))
        w = ns.attach_worker([src])
        keys = [b"canary-%d" % i for i in range(8)]
        plan = ns.prepare_store(keys)
        assert plan is not None and w.submit_store(1, np.arange(8), plan.slots)
        w.wait([1])
        assert all(r.success for r in w.get_finished())
        ns.complete_store(keys)

        sent = replies = answerable = 0
        while sent < FRAMES:
            good = [request(rng) for _ in range(BATCH - 1)]
            answerable += sum(map(expects_reply, good))
            replies += run_batch(d.socket_path, [*good, mutated(rng)])
            sent += BATCH
            assert d.alive(), f"daemon died after {sent} fuzzed frames"
        # every well-formed request is answered, even in a batch that ends with a bad one
        assert replies >= answerable, f"only {replies} replies to {answerable} requests"

        # The canary, connected all along, still gets exactly its bytes back.
        dst = kvoffload.shared_kv_cache(8, 4096)
        w2 = ns.attach_worker([dst])
        assert ns.lookup(keys) == 8
        lp = ns.prepare_load(keys)
        assert w2.submit_load(2, lp.slots, np.arange(8))
        w2.wait([2])
        assert all(r.success for r in w2.get_finished())
        ns.complete_load(keys)
        assert bool((dst == src).all())
        fresh = kvoffload.connect(d.socket_path)
        fresh.ping()
        assert fresh.namespace("canary", LAYOUT).lookup(keys) == 8
        fresh.close()
        canary.close()
        assert d.stop() == 0


def random_int8(n: int) -> Any:
    import torch

    return torch.randint(-128, 128, (n,), dtype=torch.int8)
