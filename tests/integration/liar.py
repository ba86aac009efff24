"""A client that speaks the wire protocol itself and sends whatever it likes.

The client library never sends a claim of one key into a hundred slots, a million
pins of one block, or jobs of one-byte fragments; an allowed peer can. ``Liar``
frames any request, reads replies and pushes with a deadline, and keeps what the
daemon pushed (lease grants, notices), so a test can act as that peer. It imports
nothing the forked child of ``hostile.as_uid`` could not (everything is loaded
already).
"""

from __future__ import annotations

import socket
import time
from typing import Any

import msgspec
import numpy as np

from kvoffload.protocol import messages as m
from kvoffload.protocol.connection import encode_frame
from kvoffload.protocol.packing import pack_ids

_DECODER = msgspec.msgpack.Decoder(m.Reply)


def _decode(frame: bytes) -> m.Reply:
    reply: m.Reply = _DECODER.decode(frame)
    return reply


class Liar:
    def __init__(self, path: str, timeout_s: float = 10.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.timeout_s = timeout_s
        self._buf = b""
        self._rid = 1
        self.pushes: list[m.Reply] = []
        self.granted: dict[int, list[int]] = {}  # namespace -> slots leased to us
        self.call(m.Hello(0, m.PROTOCOL_VERSION, "liar", 0))

    def rid(self) -> int:
        self._rid += 1
        return self._rid

    def send(self, msg: m.Request) -> None:
        self.sock.sendall(encode_frame(msg))

    def call(self, msg: m.Request) -> m.Reply:
        """Send with a fresh rid and return its reply (pushes on the way are kept)."""
        rid = self.rid()
        self.send(msgspec.structs.replace(msg, rid=rid))
        deadline = time.monotonic() + self.timeout_s
        while True:
            reply = self.next(deadline)
            if getattr(reply, "rid", 0) == rid:
                return reply
            self._keep(reply)

    def drain(self, wait_s: float = 0.2) -> None:
        """Read what the daemon pushed within ``wait_s``."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                reply = self.next(deadline)
            except TimeoutError:
                return
            self._keep(reply)

    def next(self, deadline: float) -> m.Reply:
        while len(self._buf) < 4 or len(self._buf) < 4 + int.from_bytes(self._buf[:4], "little"):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no reply from kvoffloadd")
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(1 << 20)
            except TimeoutError:
                raise TimeoutError("no reply from kvoffloadd") from None
            if not chunk:
                raise ConnectionResetError("kvoffloadd closed the connection")
            self._buf += chunk
        n = int.from_bytes(self._buf[:4], "little")
        frame, self._buf = self._buf[4 : 4 + n], self._buf[4 + n :]
        return _decode(frame)

    def _keep(self, reply: m.Reply) -> None:
        if isinstance(reply, m.LeaseGrant):
            slots = np.frombuffer(reply.slots, dtype="<i8").tolist()
            self.granted.setdefault(reply.ns, []).extend(slots)
        self.pushes.append(reply)

    def open(self, name: str, layout: m.KVLayout) -> m.NamespaceOpened:
        r = self.call(m.OpenNamespace(0, name, layout))
        assert isinstance(r, m.NamespaceOpened), r
        return r

    def want_leases(self, ns: int, n: int) -> list[int]:
        """Ask for ``n`` leased slots (one-way step batch) and collect the grants."""
        self.send(m.StepBatch(0, ns, 8, want_leases=n))
        self.drain()
        return self.granted.get(ns, [])

    def step(self, ns: int, key_bytes: int, **fields: Any) -> None:
        """One one-way step batch (keys packed by the caller)."""
        self.send(m.StepBatch(0, ns, key_bytes, **fields))

    def close(self) -> None:
        self.sock.close()


def packed(slots: list[int]) -> bytes:
    return pack_ids(slots)
