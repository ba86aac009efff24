"""systemd helpers against fake service-manager sockets, logfmt, metrics collector."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

import pytest

from kvoffloadd.server.logfmt import LogfmtFormatter
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
