"""The benchmarks' own machinery, shrunk: ``make bench``'s data path against a real
daemon in both of its submit modes, and the in-process loop that ``bench_control``
times.

The benchmarks are not part of the suite (they time things); these functions are, so
a change to the APIs they drive breaks here rather than in the next ``make bench``, and
a benchmark that fails part-way leaves nothing behind.
"""

from __future__ import annotations

import os
import tempfile

import pytest

import kvoffload
from kvoffload.protocol import encode_frame
from kvoffload.protocol import messages as m
from kvoffloadbench import bench, bench_control, echo_floor
from kvoffloadbench.launch import SHM, DaemonProcess


@pytest.mark.parametrize("one_way", [True, False], ids=["one-way", "blocking"])
def test_the_data_path_stores_and_loads_every_job(daemon: DaemonProcess, one_way: bool) -> None:
    client = kvoffload.connect(daemon.socket_path)
    try:
        window: list[float] = []
        store_gbps, load_gbps = bench.data_path(
            client, "dp", [64 * 1024] * 2, 16, 4, 2, window, one_way=one_way
        )
        # every job of both repeats finished and succeeded (data_path asserts it)
        assert store_gbps > 0 and load_gbps > 0
        assert len(window) == 2  # one memcpy beside each repeat
        ns = client.stats()["namespaces"]["dp"]
        assert ns["stored_blocks_total"] == ns["loads_prepared_total"] == 2 * 16
        assert ns["stored_blocks"] == 0  # each repeat evicted what it stored
    finally:
        client.close()


def _left_by_this_process() -> list[str]:
    """The loop's temporary directories and this process's region still there."""
    tmp = [x for x in os.listdir(tempfile.gettempdir()) if x.startswith("kvoffload-loop-")]
    region = SHM + bench_control.loop_config().region_name
    return tmp + ([region] if os.path.exists(region) else [])


def test_the_in_process_loop_measures_and_releases_what_it_made() -> None:
    before = _left_by_this_process()
    costs = bench_control.loop_costs(40)
    assert set(costs) >= {"echo", "ping", "lookup1000", "store_round16"}
    assert all(us > 0 for us in costs.values())
    assert _left_by_this_process() == before


def test_an_in_process_loop_that_fails_to_start_releases_what_it_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = _left_by_this_process()

    def refused(self: bench_control.InProcess, req: object) -> object:
        raise RuntimeError("the daemon refused the set-up")

    monkeypatch.setattr(bench_control.InProcess, "call", refused)
    with pytest.raises(RuntimeError, match="refused the set-up"):
        bench_control.InProcess()
    assert _left_by_this_process() == before


def test_the_bare_loop_answers_a_ping_as_the_daemon_does() -> None:
    """``echo_floor``'s floor for any Python daemon: the daemon's frames in and out."""
    wire = echo_floor.wire_peer()
    wire.sock.settimeout(10.0)  # a server that does not answer fails, not hangs
    try:
        wire.round_trip()
        assert bytes(wire._buf[: echo_floor.PONG_BYTES]) == encode_frame(m.Pong(2))
    finally:
        wire.close()
    assert wire.proc.returncode == 0  # it saw the connection close and stopped
