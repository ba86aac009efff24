"""Fire-and-forget requests against a scripted daemon on a real unix socket: the
transport reads their replies once ``MAX_UNANSWERED`` are out, within its deadline
however the replies trickle in, and keeps the pushes that came along for ``poll``."""

from __future__ import annotations

import os
import pathlib
import socket
import threading
import time

import pytest

from kvoffload.link.transport import MAX_UNANSWERED, Transport
from kvoffload.protocol import messages as m
from kvoffload.protocol.connection import NeedData, ServerConnection, State, encode_frame
from kvoffload.protocol.errors import DaemonUnavailableError

BATCH = MAX_UNANSWERED + 1  # the request that makes the transport read replies


class ScriptedDaemon:
    """Answers Hello, then, once ``BATCH`` requests are in, answers them as
    ``scenario`` says: "together" (all replies and a push in one write) or
    "trickle" (one reply every ``gap_s``)."""

    def __init__(self, path: str, scenario: str, gap_s: float = 0.0) -> None:
        self.path, self.scenario, self.gap_s = path, scenario, gap_s
        self.answered = 0
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        self._listener.listen(1)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        conn, _ = self._listener.accept()
        conn.settimeout(10.0)
        server = ServerConnection()
        asked: list[int] = []
        with conn:
            while data := conn.recv(65536):
                server.receive_data(data)
                while not isinstance(event := server.next_event(), NeedData):
                    if isinstance(event, m.Hello):
                        welcome = m.Welcome(event.rid, m.PROTOCOL_VERSION, "x", "i", 1, "r", 0)
                        conn.sendall(encode_frame(welcome))
                        server.state = State.READY
                    else:
                        asked.append(event.rid)
                if len(asked) < BATCH:
                    continue
                if self.scenario == "together":
                    frames = [encode_frame(m.OkReply(rid)) for rid in asked]
                    conn.sendall(b"".join(frames) + encode_frame(m.JobsDone(0, 7, [])))
                    self.answered += len(asked)
                else:
                    for rid in asked:
                        time.sleep(self.gap_s)
                        try:
                            conn.sendall(encode_frame(m.OkReply(rid)))
                        except OSError:
                            return  # the client gave up
                        self.answered += 1
                asked = []

    def close(self) -> None:
        self._thread.join(10.0)
        self._listener.close()


@pytest.fixture
def sock_path(tmp_path: pathlib.Path) -> str:
    return str(tmp_path / "d.sock")


def connected(path: str, timeout_s: float) -> Transport:
    t = Transport(path, timeout_s)
    assert isinstance(t.request(m.Hello(1, m.PROTOCOL_VERSION, "c", os.getpid())), m.Welcome)
    return t


def test_pushes_that_come_with_the_replies_wait_for_the_next_poll(sock_path: str) -> None:
    daemon = ScriptedDaemon(sock_path, "together")
    t = connected(sock_path, 5.0)
    try:
        for rid in range(2, 2 + BATCH):
            t.send_nowait(m.Touch(rid, 1, b"", 0))
        assert t.unanswered == 0  # every reply that came is read, not just enough
        # The push came in the same read as the replies: poll finds it at once
        # (before, it waited out its timeout on the socket and returned nothing).
        assert t.poll(5.0) == [m.JobsDone(0, 7, [])]
    finally:
        t.close()
        daemon.close()


def test_replies_that_trickle_in_end_at_the_deadline_as_a_lost_daemon(sock_path: str) -> None:
    """Each reply comes just within a read's timeout; the batch as a whole does not:
    the transport gives the daemon up instead of waiting for every reply in turn."""
    daemon = ScriptedDaemon(sock_path, "trickle", gap_s=0.2)
    t = connected(sock_path, 0.3)
    try:
        for rid in range(2, 1 + BATCH):
            t.send_nowait(m.Touch(rid, 1, b"", 0))  # within the bound: nothing read yet
        with pytest.raises(DaemonUnavailableError):
            t.send_nowait(m.Touch(1 + BATCH, 1, b"", 0))
        assert t.sock is None  # closed: the stream cannot be trusted any more
        assert daemon.answered < BATCH - MAX_UNANSWERED // 2  # it did not wait them all out
    finally:
        t.close()
        daemon.close()
