"""systemd helpers against fake service-manager sockets, logfmt, metrics collector."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from kvoffloadd.server.logfmt import (
    MAX_FIELD_CHARS,
    WRITE_BATCH_LINES,
    LogfmtFormatter,
    written_off_the_loop,
)
from kvoffloadd.server.systemd import Notifier, listen_fds, watchdog_interval_s


def fake_manager(tmp_path: Path) -> tuple[socket.socket, str]:
    path = str(tmp_path / "notify")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.settimeout(5)
    return s, path


def test_notifier_sends_states(tmp_path: Path) -> None:
    mgr, path = fake_manager(tmp_path)
    n = Notifier(path)
    assert n.enabled
    assert n.notify(READY=1, STATUS="serving", MAINPID=42)
    assert mgr.recv(4096) == b"READY=1\nSTATUS=serving\nMAINPID=42"
    n.close()
    mgr.close()


def test_notifier_abstract_namespace() -> None:
    name = f"kvoffload-test-{os.getpid()}"
    mgr = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    mgr.bind("\0" + name)
    mgr.settimeout(5)
    n = Notifier("@" + name)
    assert n.notify(WATCHDOG=1)
    assert mgr.recv(64) == b"WATCHDOG=1"
    n.close()
    mgr.close()


def test_without_systemd_everything_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.delenv("LISTEN_PID", raising=False)
    assert not Notifier().enabled
    assert Notifier().notify(READY=1) is False
    assert watchdog_interval_s() is None
    assert listen_fds() == []


def test_watchdog_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert watchdog_interval_s() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", "1")
    assert watchdog_interval_s() is None


def test_listen_fds_for_another_pid_are_ignored_and_cleared(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LISTEN_PID", "1")
    monkeypatch.setenv("LISTEN_FDS", "1")
    assert listen_fds() == []
    assert "LISTEN_FDS" not in os.environ


def test_logfmt_is_one_line() -> None:
    rec = logging.LogRecord(
        "kvoffloadd.x", logging.WARNING, "f", 1, 'bad "frame"\nnext', None, None
    )
    line = LogfmtFormatter().format(rec)
    assert "\n" not in line
    assert 'level=warning logger=kvoffloadd.x msg="bad \\"frame\\"\\nnext"' in line
    assert line.startswith("ts=")


def test_a_line_is_a_few_kib_whatever_its_message_and_traceback() -> None:
    """A peer's megabytes in a message (a name, a quote of its frame), backslashes that
    escaping would double: the line keeps ``MAX_FIELD_CHARS`` of each and says so."""
    try:
        raise ValueError("\\" * (1 << 20))
    except ValueError:
        args = ("\\" * (1 << 20),)
        record = logging.LogRecord(
            "kvoffloadd", logging.WARNING, __file__, 1, "bad %s", args, sys.exc_info()
        )
    line = LogfmtFormatter().format(record)
    assert len(line) < 4 * MAX_FIELD_CHARS + 400  # escaped: at most doubled
    assert line.count("characters, cut") == 2 and "\n" not in line.split("exc=")[0]


def test_a_log_reader_that_stops_reading_never_holds_the_thread_that_logs() -> None:
    """stderr's reader (journald) stops reading: the writer thread blocks on a full pipe
    with what it took (one batch at most), and the loop's lines go on being logged at
    once, past ``capacity`` waiting dropped and counted. Once the reader reads again,
    every line comes out in order or is counted in a line saying how many were
    dropped, and the next line comes after them; each is a logfmt line."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    with contextlib.suppress(BlockingIOError):
        while True:
            os.write(w, b"\n" * 65536)  # the pipe is full: its reader has stopped
    os.set_blocking(w, True)
    stream = os.fdopen(w, "w")
    root = logging.getLogger()
    before, level = root.handlers[:], root.level
    handler = logging.StreamHandler(stream)
    handler.setFormatter(LogfmtFormatter())
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    out: list[bytes] = []
    reader = threading.Thread(target=lambda: out.extend(iter(lambda: os.read(r, 65536), b"")))
    n, capacity = 4 * WRITE_BATCH_LINES, 8
    try:
        with written_off_the_loop(capacity) as handoff:
            logger = logging.getLogger("kvoffloadd.test")

            def log_lines() -> None:
                for i in range(n):
                    logger.warning("line %d", i)

            loop = threading.Thread(target=log_lines)
            loop.start()
            loop.join(30)
            assert not loop.is_alive(), "logging waited on the log's reader"
            reader.start()  # it reads again
            deadline = time.monotonic() + 30
            while not handoff.lines.empty():
                assert time.monotonic() < deadline, "the writer never caught up"
                time.sleep(0.001)
            logger.warning("after")
        stream.close()
        reader.join(30)
    finally:
        root.handlers[:] = before
        root.setLevel(level)
        if not stream.closed:
            stream.close()
        os.close(r)
    lines = [x for x in b"".join(out).decode().split("\n") if x]
    assert all(x.startswith("ts=") and " level=warning " in x for x in lines)
    assert lines[-1].endswith("msg=after")
    told_re = re.compile(r'"(\d+) log lines dropped: the log\'s reader fell behind"')
    shown: list[int] = []
    told = 0
    for x in lines[:-1]:
        msg = x.rsplit("msg=", 1)[1]
        if dropped := told_re.fullmatch(msg):
            told += int(dropped[1])
        else:
            shown.append(int(re.fullmatch(r'"line (\d+)"', msg)[1]))  # type: ignore[index]
    assert shown == sorted(set(shown))  # in order, none twice
    assert len(shown) + told == n  # each written, or counted as dropped
    assert told >= n - WRITE_BATCH_LINES - capacity  # what the blocked writer could not take
