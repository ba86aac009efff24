"""Loopback ports for the throwaway servers of tests and benchmarks
(``kvoffloadbench.server_process``): several ports for one server are distinct."""

from __future__ import annotations

import itertools
import socket
from types import SimpleNamespace

import pytest

from kvoffloadbench import server_process
from kvoffloadbench.server_process import free_ports


def test_ports_chosen_together_are_distinct_even_when_the_draw_repeats(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three separate choices once gave a mooncake_master its metadata and admin ports
    equal (it could not bind the second and exited). The draw below repeats its first
    port twice before moving on: chosen together, the three still differ."""
    with socket.socket() as probe:  # a port free now, drawn three times first
        probe.bind(("127.0.0.1", 0))
        first = probe.getsockname()[1]
    draws = itertools.chain([first, first, first], itertools.count(first + 1))
    draw = SimpleNamespace(randrange=lambda lo, hi: next(draws))
    monkeypatch.setattr(server_process, "random", draw)
    monkeypatch.setattr(server_process, "_PORTS_FROM", 0)
    monkeypatch.setattr(server_process, "_ephemeral_low", lambda: 1 << 16)
    ports = free_ports(3)
    assert len(set(ports)) == 3 and ports[0] == first
    for port in ports:  # all released again for the server to bind
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
