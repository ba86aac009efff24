"""kvoffloadctl against a live daemon."""

from __future__ import annotations

import json

from helpers import ctl, store_blocks

import kvoffload
from kvoffloadbench.launch import DaemonProcess


def test_stats_clients_evict(daemon: DaemonProcess) -> None:
    c = kvoffload.connect(daemon.socket_path, name="engine-a")
    keys = [b"k%07d" % i for i in range(4)]
    ns, _ = store_blocks(c, "llama", keys)
    ns.lookup([*keys, b"missing!"])

    r = ctl(daemon.socket_path, "--json", "stats")
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert set(st) >= {"server", "region", "namespaces", "clients", "copies", "errors"}
    assert st["namespaces"]["llama"]["stored_blocks"] == 4
    assert st["namespaces"]["llama"]["hit_keys_total"] == 4
    assert st["copies"]["stored_bytes_total"] == 4 * 4096

    r = ctl(daemon.socket_path, "stats")
    assert r.returncode == 0 and "# region" in r.stdout and "region_bytes:" in r.stdout

    r = ctl(daemon.socket_path, "--json", "clients")
    rows = json.loads(r.stdout)
    mine = [x for x in rows if x["name"] == "engine-a"]
    assert mine and mine[0]["namespaces"] == ["llama"] and mine[0]["bytes_stored"] == 16384
    assert "ENGINE-A" not in ctl(daemon.socket_path, "clients").stdout.upper().split("NAME")[0]

    r = ctl(daemon.socket_path, "evict", "--namespace", "llama", "--key", keys[0].hex())
    assert r.returncode == 0 and "evicted 1 blocks" in r.stdout
    assert ns.lookup(keys) == 0
    r = ctl(daemon.socket_path, "--json", "evict")
    assert json.loads(r.stdout)["evicted_blocks"] == 3
    r = ctl(daemon.socket_path, "evict", "--namespace", "nope")
    assert r.returncode == 2 and "no namespace" in r.stderr
    c.close()


def test_unreachable_daemon_is_one_line_and_exit_1(tmp_path: object) -> None:
    r = ctl("/nonexistent/kvoffloadd.sock", "stats")
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and "cannot connect" in r.stderr
