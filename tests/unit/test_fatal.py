"""A broken internal invariant stops the daemon loudly: full stats in the log, then raise."""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import threading
import uuid

import pytest

from kvoffload.protocol import messages as m
from kvoffload.protocol.connection import encode_frame
from kvoffloadd.config import DaemonConfig
from kvoffloadd.copies.copier import CpuCopier
from kvoffloadd.region.region import Geometry, SharedOffloadRegion
from kvoffloadd.server.listener import bind_listener
from kvoffloadd.server.server import Server
from kvoffloadd.service.service import Service
from kvoffloadd.service.session import Session


class BrokenService(Service):
    """A service whose bookkeeping is found inconsistent on the next ping."""

    def handle(self, s: Session, req: m.Request) -> m.Reply | None:
        if isinstance(req, m.Ping):
            raise AssertionError("pinned key lost its block")
        return super().handle(s, req)


def test_invariant_breach_logs_stats_and_raises(caplog: pytest.LogCaptureFixture) -> None:
    cfg = DaemonConfig(instance=f"f{uuid.uuid4().hex[:8]}", region_size="16MiB")
    region = SharedOffloadRegion(cfg.region_name, Geometry.plan(16 << 20, 2 << 20, 16384))
    copier = CpuCopier(1)
    path = os.path.join(tempfile.mkdtemp(), "s.sock")
    server = Server(BrokenService(cfg, region, copier), bind_listener(path))

    def engine() -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(path)
            s.sendall(encode_frame(m.Hello(1, m.PROTOCOL_VERSION)) + encode_frame(m.Ping(2)))
            s.settimeout(10)
            while s.recv(4096):
                pass

    t = threading.Thread(target=engine)
    t.start()
    with caplog.at_level(logging.CRITICAL), pytest.raises(AssertionError, match="lost its block"):
        server.serve_forever()
    t.join(10)
    record = next(r for r in caplog.records if r.levelno == logging.CRITICAL)
    assert "internal invariant broken" in record.getMessage()
    assert "'region'" in record.getMessage() and "'namespaces'" in record.getMessage()
    server.listener.close()
    copier.close()
    region.close()
