"""A service driven in-process, for unit tests and loop benchmarks: requests whose reply
the service defers (a worker's caches imported by a copier thread, waits) are answered
here by draining the copier's completions, as the server's loop would."""

from __future__ import annotations

import select
import time

from kvoffload.protocol import messages as m
from kvoffload.protocol.errors import error_for_code
from kvoffloadd.service.service import Service
from kvoffloadd.service.session import Session


def handle_now(svc: Service, s: Session, req: m.Request, timeout_s: float = 10.0) -> m.Reply:
    """``svc.handle``, waiting for a deferred reply to ``req`` (its rid); a deferred
    refusal is raised, as a refusal in ``handle`` itself is."""
    reply = svc.handle(s, req)
    deadline = time.monotonic() + timeout_s
    while reply is None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no reply to {type(req).__name__} within {timeout_s} s")
        select.select([svc.copier.wake_fd], [], [], left)
        for sid, msg in svc.on_completions(svc.copier.drain()):
            if sid == s.session_id and getattr(msg, "rid", 0) == req.rid:
                reply = msg
    if isinstance(reply, m.ErrorReply):
        raise error_for_code(reply.code, reply.message)
    return reply
