"""``make bench``'s data path runs against a real daemon in both of its submit modes.

The benchmark is not part of the suite (it times things); its data-path function is,
shrunk, so a change to the worker APIs it drives breaks here rather than in the next
``make bench``.
"""

from __future__ import annotations

import pytest

import kvoffload
from kvoffloadbench import bench
from kvoffloadbench.launch import DaemonProcess


@pytest.mark.parametrize("one_way", [True, False], ids=["one-way", "blocking"])
def test_the_data_path_stores_and_loads_every_job(daemon: DaemonProcess, one_way: bool) -> None:
    client = kvoffload.connect(daemon.socket_path)
    try:
        window: list[float] = []
        store_gbps, load_gbps = bench.data_path(
            client, "dp", [64 * 1024] * 2, 16, 4, 2, window, one_way
        )
        # every job of both repeats finished and succeeded (data_path asserts it)
        assert store_gbps > 0 and load_gbps > 0
        assert len(window) == 2  # one memcpy beside each repeat
        ns = client.stats()["namespaces"]["dp"]
        assert ns["stored_blocks_total"] == ns["loads_prepared_total"] == 2 * 16
        assert ns["stored_blocks"] == 0  # each repeat evicted what it stored
    finally:
        client.close()
