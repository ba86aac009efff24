"""Shared by the tier tests: an engine process's view of a daemon with tiers below it.

Each namespace here may hold 4 blocks of the region (a quota), so storing 4 more
evicts the first 4; those must come back from a tier, byte-identical.
"""

from __future__ import annotations

import pathlib
import urllib.request
from functools import partial
from typing import Any

import numpy as np
import torch
from helpers import poll

import kvoffload
from kvoffloadbench.launch import DaemonProcess
from kvoffloadbench.mooncake_master import MooncakeMaster

PAGE = 4096
LAYOUT = kvoffload.KVLayout(tensor_page_bytes=[PAGE])
# 4 x 16 KiB slots for the test models; "big" namespaces are not limited
QUOTA = '[[namespace_quotas]]\npattern = "[!b]*"\nmax_region_size = "64KiB"\n'


def keys(tag: bytes, n: int) -> list[bytes]:
    return [tag + i.to_bytes(4, "big") + bytes(11) for i in range(n)]


class Engine:
    """One engine process's view: a scheduler namespace and a worker over 16 blocks."""

    def __init__(self, d: DaemonProcess, ns_name: str = "llama") -> None:
        self.client = kvoffload.connect(d.socket_path)
        self.ns = self.client.namespace(ns_name, LAYOUT)
        self.cache = kvoffload.shared_kv_cache(16, PAGE)
        self.w = self.ns.attach_worker([self.cache])
        self.job = 0

    def _run(self, store: bool, slots: list[int], blocks: list[int]) -> None:
        self.job += 1
        if store:
            assert self.w.submit_store(self.job, blocks, slots), self.w.last_error
        else:
            assert self.w.submit_load(self.job, slots, blocks), self.w.last_error
        self.w.wait([self.job])
        assert [r.success for r in self.w.get_finished()] == [True]

    def store(self, ks: list[bytes], seed: int) -> bytes:
        data = np.random.default_rng(seed).integers(-128, 128, (len(ks), PAGE), dtype=np.int8)
        self.cache[: len(ks)] = torch.from_numpy(data)
        plan = self.ns.prepare_store(ks)
        assert plan is not None and plan.keys_to_store == ks
        self._run(True, plan.slots, list(range(len(ks))))
        self.ns.complete_store(ks)
        return data.tobytes()

    def load(self, ks: list[bytes]) -> bytes:
        self.cache[8:] = 0
        slots = self.ns.prepare_load(ks).slots
        self._run(False, slots, list(range(8, 8 + len(ks))))
        self.ns.complete_load(ks)
        data: bytes = self.cache[8 : 8 + len(ks)].numpy().tobytes()
        return data

    def tier(self, name: str) -> dict[str, Any]:
        stats: dict[str, Any] = self.client.stats()["tiers"][name]
        return stats

    def wait_healthy(self, name: str, deadline_s: float = 30.0) -> None:
        """Until the tier is connected; on time out, say what the tier last said."""
        try:
            poll(lambda: self.tier(name)["healthy"], f"tier {name} to connect", deadline_s)
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {self.tier(name).get('last_error', '')}") from None

    def close(self) -> None:
        self.w.close()
        self.client.close()


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return str(r.read().decode())


def tier_daemon(
    tmp: pathlib.Path,
    tiers_toml: str,
    name: str = "d",
    *extra: str,
    top: str = "",
    secret: pathlib.Path | None = None,
) -> DaemonProcess:
    """A daemon with the test quota and these tiers; ``top``: more top-level settings.
    Daemons of one test share one tier secret (``tmp/tier-secret``) unless ``secret``
    names another file."""
    cfg = tmp / f"{name}.toml"
    secret_line = f'tier_secret_file = "{secret or tmp / "tier-secret"}"\n'
    cfg.write_text(secret_line + top + QUOTA + tiers_toml)
    return DaemonProcess("64MiB", "--config", str(cfg), "--log-level", "warning", *extra)


def disk_toml(path: pathlib.Path, capacity: str = "1MiB") -> str:
    return f'[[tiers]]\ntype = "disk"\npath = "{path}"\ncapacity = "{capacity}"\n'


def redis_toml(url: str) -> str:
    return (
        f'[[tiers]]\ntype = "redis"\nurl = "{url}"\nrefresh_s = 0.05\n'
        "timeout_s = 0.5\nfull_sync_s = 1.0\n"
    )


def shared_by_two(
    da: DaemonProcess, db: DaemonProcess, tier: str, seed: int
) -> tuple[Engine, Engine, list[bytes], bytes]:
    """An engine on each daemon; a's stores 4 blocks, they cascade to ``tier``, and b's
    daemon promotes them from it byte-identical. The engines, the keys and the bytes."""
    ea, eb = Engine(da), Engine(db)

    def healthy(e: Engine) -> object:
        return e.tier(tier)["healthy"]

    for e in (ea, eb):
        poll(partial(healthy, e), "the tiers to connect")
    a = keys(b"a", 4)
    data = ea.store(a, seed=seed)
    poll(lambda: ea.tier(tier)["stores_total"] == 4, "the cascade")
    poll(lambda: eb.ns.lookup(a) == 4, "the other daemon to promote the blocks")
    assert eb.load(a) == data
    assert eb.tier(tier)["promoted_blocks_total"] == 4
    return ea, eb, a, data


def evict_by_storing_more(e: Engine, cascaded: str) -> bytes:
    """Store 4 other blocks: the quota evicts the first 4 from the region."""
    poll(lambda: e.tier(cascaded)["stores_total"] >= 4, "the first blocks to cascade")
    other = e.store(keys(b"x", 4), seed=99)
    poll(lambda: e.tier(cascaded)["stores_total"] >= 8, "the other blocks to cascade")
    return other


def mooncake_toml(
    m: MooncakeMaster, admin: bool = True, full_sync_s: float = 0.5, segment: str = "32MiB"
) -> str:
    out = (
        f'[[tiers]]\ntype = "mooncake"\nmaster = "{m.master}"\n'
        f'metadata_server = "{m.metadata_url}"\nsegment_size = "{segment}"\n'
        f"refresh_s = 0.05\nfull_sync_s = {full_sync_s}\ntimeout_s = 1.0\n"
    )
    return out + (f'admin_url = "{m.admin_url}"\n' if admin else "")
