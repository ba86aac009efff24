"""The cron's heartbeat against a fake service manager: its period follows systemd's
watchdog, STATUS= goes out when the progress line changes, WATCHDOG=1 every beat, and
start-up's timeout is extended while the region is pinned."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest

from kvoffloadd.server.heartbeat import CRON_PERIOD_S, Heartbeat
from kvoffloadd.server.systemd import Notifier


@dataclass
class _Geometry:
    num_extents: int = 4
    extent_bytes: int = 1 << 20


@dataclass
class _Region:
    geometry: _Geometry = field(default_factory=_Geometry)
    prefaulted_bytes: int = 0
    prefaulting: bool = True


@dataclass
class _Pinner:
    running: bool = True
    total_bytes: int = 4 << 20
    pinned_bytes: int = 1 << 20


@dataclass
class _Gpu:
    pinner: _Pinner | None = None


@dataclass
class _Service:
    """What a beat reads of the service."""

    region: _Region = field(default_factory=_Region)
    gpu: _Gpu | None = None


def _beats(tmp_path: Path, service: _Service, clients: list[int]) -> list[dict[str, str]]:
    mgr = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    mgr.bind(str(tmp_path / "notify"))
    mgr.setblocking(False)
    notifier = Notifier(str(tmp_path / "notify"))
    try:
        hb = Heartbeat(cast(Any, service), notifier, None)
        got = []
        for n in clients:
            hb.beat(n)
            try:
                msg = mgr.recv(4096).decode()
            except BlockingIOError:
                msg = ""
            got.append(dict(kv.split("=", 1) for kv in msg.split("\n") if kv))
        return got
    finally:
        notifier.close()
        mgr.close()


def _period_s(notify_socket: str) -> float:
    notifier = Notifier(notify_socket)
    try:
        return Heartbeat(cast(Any, _Service()), notifier, None).period_s
    finally:
        notifier.close()


def test_the_period_is_half_the_watchdog_when_that_is_shorter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    monkeypatch.setenv("WATCHDOG_USEC", "600000")
    assert _period_s(str(tmp_path / "notify")) == 0.3
    assert _period_s("") == CRON_PERIOD_S  # not supervised: no watchdog to feed
    monkeypatch.setenv("WATCHDOG_USEC", "60000000")
    assert _period_s(str(tmp_path / "notify")) == CRON_PERIOD_S


def test_status_goes_out_when_it_changes_and_the_watchdog_every_beat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    monkeypatch.setenv("WATCHDOG_USEC", "10000000")
    region = _Region(prefaulted_bytes=1 << 20)
    service = _Service(region=region)
    got = _beats(tmp_path, service, [0, 0])
    assert got[0] == {"STATUS": "serving; pre-faulting region 25%", "WATCHDOG": "1"}
    assert got[1] == {"WATCHDOG": "1"}  # the same line is not sent again
    region.prefaulting = False
    (tmp_path / "notify").unlink()
    got = _beats(tmp_path, service, [3, 3, 5])
    assert [g.get("STATUS") for g in got] == ["serving 3 clients", None, "serving 5 clients"]


def test_pinning_extends_the_start_up_timeout_past_the_next_beat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    pinner = _Pinner()
    service = _Service(gpu=_Gpu(pinner))
    first, second = _beats(tmp_path, service, [0, 0])
    assert first == {"STATUS": "serving; pinning region 25%", "EXTEND_TIMEOUT_USEC": "4000000"}
    assert second == {"EXTEND_TIMEOUT_USEC": "4000000"}  # no watchdog: no WATCHDOG=1
    pinner.running = False
    service.region.prefaulting = False
    (tmp_path / "notify").unlink()
    assert _beats(tmp_path, service, [1]) == [{"STATUS": "serving 1 clients"}]


def test_without_systemd_a_beat_sends_nothing() -> None:
    notifier = Notifier("")
    hb = Heartbeat(cast(Any, _Service()), notifier, None)
    hb.beat(2)  # no socket, no metrics: nothing to tell and nothing raised
    assert hb.status(2) == ("serving; pre-faulting region 0%", False)
    notifier.close()
