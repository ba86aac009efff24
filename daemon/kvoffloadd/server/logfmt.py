"""One-line structured logs (logfmt) on stderr; journald keeps them as they are.

Rules:
- Until the loop runs (start-up, a refusal to start), a line is written as it is
  logged: a daemon that exits says why before it goes.
- While the loop runs (``written_off_the_loop``), a line is formatted where it is
  logged and written by a thread of its own: under systemd stderr is journald's stream
  socket, and a journald that falls behind (its disk slow, a flush) blocks the writer.
  The loop must never wait on that, and any peer can make the daemon log (a bad
  frame, a cut-off: one line each). At most ``LOG_QUEUE_LINES`` wait to be written;
  past it a line is dropped, and the next line that fits says how many were.
- A line's message and its traceback are at most ``MAX_FIELD_CHARS`` each (the rest
  cut, the cut said): whatever a peer puts into a message (a name, a decoder's quote
  of its frame), the queue holds at most ``LOG_QUEUE_LINES`` lines of a few KiB.
- On leaving the loop, whatever is queued is written before the daemon goes on (an
  internal invariant's stats included); a crash that kills the process outright loses
  what had not been written yet (a few milliseconds of lines).
"""

from __future__ import annotations

import contextlib
import logging
import logging.handlers
import queue
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO

LOG_QUEUE_LINES = 1024  # lines waiting for the writer thread at most
MAX_FIELD_CHARS = 4096  # of a line's message, and of its traceback
WRITE_BATCH_LINES = 256  # lines the writer thread writes at once at most
DRAIN_S = 5.0  # how long leaving the loop waits for the queued lines to be written


def _cut(value: str, keep_end: bool = False) -> str:
    """At most ``MAX_FIELD_CHARS`` of ``value``: its start, or its end (a traceback's
    innermost frames and its exception)."""
    if len(value) <= MAX_FIELD_CHARS:
        return value
    if keep_end:
        return f"({len(value)} characters, cut) ...{value[-MAX_FIELD_CHARS:]}"
    return f"{value[:MAX_FIELD_CHARS]}... ({len(value)} characters, cut)"


def _quote(value: str) -> str:
    if value and not any(c in value for c in ' "=\n\t'):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


class LogfmtFormatter(logging.Formatter):
    """``ts=... level=info logger=kvoffloadd.server.server msg="..."`` (+ ``exc=`` when raised)."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        parts = [
            f"ts={ts}.{int(record.msecs):03d}Z",
            f"level={record.levelname.lower()}",
            f"logger={record.name}",
            f"msg={_quote(_cut(record.getMessage()))}",
        ]
        if record.exc_info:
            trace = _cut(self.formatException(record.exc_info), keep_end=True)
            parts.append(f"exc={_quote(trace)}")
        return " ".join(parts)


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LogfmtFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


class _Handoff(logging.handlers.QueueHandler):
    """Formats a line where it is logged and queues it for the writer, or drops it
    (counted) when the queue is full."""

    def __init__(self, lines: queue.Queue[logging.LogRecord | None]) -> None:
        super().__init__(lines)
        self.lines = lines
        self.setFormatter(LogfmtFormatter())
        self.dropped = 0

    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            if self.dropped:
                told = logging.makeLogRecord(
                    {"name": __name__, "levelno": logging.WARNING, "levelname": "WARNING",
                     "msg": f"{self.dropped} log lines dropped: the log's reader fell behind"}
                )  # fmt: skip
                self.lines.put_nowait(self.prepare(told))
                self.dropped = 0
            self.lines.put_nowait(record)
        except queue.Full:
            self.dropped += 1


def _write(lines: queue.Queue[logging.LogRecord | None], stream: TextIO) -> None:
    """The writer thread: what is queued, a batch per write, until ``None``."""
    while True:
        batch = [lines.get()]
        with contextlib.suppress(queue.Empty):
            while len(batch) < WRITE_BATCH_LINES:
                batch.append(lines.get_nowait())
        text = "".join(f"{r.msg}\n" for r in batch if r is not None)
        with contextlib.suppress(OSError, ValueError):  # nowhere to write: dropped
            stream.write(text)
            stream.flush()
        if batch[-1] is None:
            return


@contextlib.contextmanager
def written_off_the_loop(capacity: int = LOG_QUEUE_LINES) -> Iterator[_Handoff]:
    """While inside, the root logger's lines are formatted where they are logged and
    written to its stream by a thread (at most ``capacity`` waiting); on leaving, the
    rest is written (for ``DRAIN_S`` at most) and the handlers are as they were."""
    root = logging.getLogger()
    before = root.handlers[:]
    stream = next((h.stream for h in before if isinstance(h, logging.StreamHandler)), sys.stderr)
    lines: queue.Queue[logging.LogRecord | None] = queue.Queue(capacity)
    handoff = _Handoff(lines)
    writer = threading.Thread(target=_write, args=(lines, stream), name="log-writer", daemon=True)
    writer.start()
    root.handlers[:] = [handoff]
    try:
        yield handoff
    finally:
        root.handlers[:] = before
        with contextlib.suppress(queue.Full):  # a reader gone for good: not waited for
            lines.put(None, timeout=DRAIN_S)
            writer.join(DRAIN_S)
