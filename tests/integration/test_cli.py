"""kvoffloadctl against a live daemon."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
from helpers import ctl, poll, store_blocks

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
    assert r.returncode == 3 and "no namespace" in r.stderr
    c.close()


def test_drop_namespace_and_its_engine_carries_on(daemon: DaemonProcess) -> None:
    """An admin drops a namespace an engine has open: its blocks go, and the engine's
    client, told by a notice, reconnects, opens the namespace again (empty) with its
    worker, and stores into it as before."""
    sock = daemon.socket_path
    c = kvoffload.connect(sock, name="engine-a")
    keys = [b"d%07d" % i for i in range(4)]
    ns, w = store_blocks(c, "dropme", keys)
    epoch = c.epoch
    r = ctl(sock, "drop-namespace", "dropme", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"namespace": "dropme", "dropped_blocks": 4, "connections": 1}

    def reconnected() -> bool:
        c.poll()  # the notice comes at the daemon's next housekeeping turn
        return c.epoch > epoch

    poll(reconnected, "the engine's client to reconnect after the drop")
    assert c.outages_total == 0 and ns.ns_id >= 0
    assert ns.lookup(keys) == 0  # the blocks went with the namespace
    plan = ns.prepare_store(keys)
    assert plan is not None and plan.keys_to_store == keys
    assert w.submit_store(2, np.arange(len(keys)), plan.slots), w.last_error
    w.wait([2])
    assert [r.success for r in w.get_finished()] == [True]
    ns.complete_store(keys)
    assert ns.lookup(keys) == 4
    st = json.loads(ctl(sock, "--json", "stats").stdout)
    assert st["namespaces"]["dropme"]["stored_blocks"] == 4

    r = ctl(sock, "drop-namespace", "dropme")  # human output
    assert r.returncode == 0 and r.stdout.startswith("dropped namespace dropme: 4 blocks; 1 ")
    r = ctl(sock, "drop-namespace", "nope")
    assert r.returncode == 3 and "[NOT_FOUND] no namespace named 'nope'" in r.stderr
    c.close()


def test_unreachable_daemon_is_one_line_and_exit_1(tmp_path: object) -> None:
    r = ctl("/nonexistent/kvoffloadd.sock", "stats")
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and "cannot connect" in r.stderr


def test_global_options_go_before_or_after_the_subcommand(daemon: DaemonProcess) -> None:
    """As with kubectl or systemctl: ``stats --json`` and ``--json stats`` are one."""
    sock = daemon.socket_path
    for args in (
        ("--socket", sock, "--json", "stats"),
        ("--socket", sock, "stats", "--json"),
        ("stats", "--socket", sock, "--json", "--timeout", "3"),
        ("--json", "stats", "--socket", sock),
    ):
        r = subprocess.run(
            [sys.executable, "-m", "kvoffloadctl", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, (args, r.stderr)
        assert "region" in json.loads(r.stdout), args


def test_every_subcommand_speaks_json(daemon: DaemonProcess) -> None:
    c = kvoffload.connect(daemon.socket_path)
    store_blocks(c, "j", [b"j%07d" % i for i in range(2)])
    outputs: dict[str, Callable[[Any], object]] = {
        "stats": lambda o: "region" in o,
        "clients": lambda o: isinstance(o, list) and o,
        "config": lambda o: "region_size" in o,
        "ping": lambda o: o["rtt_s"] > 0,
        "evict": lambda o: o["evicted_blocks"] == 2,
    }
    for command, check in outputs.items():
        r = ctl(daemon.socket_path, command, "--json")
        assert r.returncode == 0, (command, r.stderr)
        assert check(json.loads(r.stdout)), (command, r.stdout)
    r = ctl(daemon.socket_path, "top", "--json", "--interval", "0.05", "--count", "2")
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert r.returncode == 0 and len(rows) == 2 and "hit_rate" in rows[0]
    c.close()


def test_exit_status_says_what_went_wrong(daemon: DaemonProcess) -> None:
    """0 done, 1 daemon unreachable, 2 usage error, 3 refused by the daemon."""
    assert ctl(daemon.socket_path, "ping").returncode == 0
    assert ctl("/nonexistent/kvoffloadd.sock", "ping").returncode == 1
    r = ctl(daemon.socket_path, "no-such-command")
    assert r.returncode == 2 and "invalid choice" in r.stderr
    r = ctl(daemon.socket_path, "evict", "--namespace", "nope", "--json")
    assert r.returncode == 3 and "no namespace" in r.stderr
    assert "exit status: 0 done, 1 daemon unreachable" in ctl(daemon.socket_path, "--help").stdout
