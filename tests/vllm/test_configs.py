"""Every parallel configuration vLLM 0.33 runs shares through kvoffload, or falls back
to a per-rank layout that works, and says which and why.

Each engine is vLLM's real Scheduler and OffloadingConnector with every worker rank of
its parallel shape, planned by vLLM itself from a tiny local model (``vllm_plan``), in
a process of its own against a real daemon. Engine A computes a prompt; engine B, of
the same shape (or, with the canonical layout, of another TP size), must find every
block A stored, plan one load of all of them, and hold exactly A's bytes afterwards:
every KV head of every layer of every rank (``bad_blocks``). The scheduler's log line
names the layout and why.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import pytest
from engine_proc import EngineProc

import kvoffload
from kvoffloadbench.launch import DaemonProcess

pytestmark = pytest.mark.integration

PROMPT_BLOCKS = 8  # full blocks of 16 tokens; 5 more tokens follow
_rng = random.Random(20261124)

PER_RANK = "per-rank layout"
CANONICAL = "canonical layout"
# (engine shape, the layout its scheduler reports, words of the reason)
CONFIGS: dict[str, tuple[dict[str, Any], str, str]] = {
    "tp2": ({"model": "llama", "tp": 2}, PER_RANK, "set canonical_layout"),
    "pp2": ({"model": "llama", "pp": 2}, PER_RANK, "set canonical_layout"),
    # vLLM certifies PP as parallelism-agnostic under its V1 runner; it has no
    # canonical mapping for it: per-rank pages, one namespace per stage.
    "pp2-canonical": (
        {"model": "llama", "pp": 2, "extra": {"canonical_layout": True}},
        PER_RANK,
        "no pipeline parallelism",
    ),
    "pp3-unequal": ({"model": "llama", "pp": 3}, PER_RANK, "pp=3"),  # 1/2/1 layers
    "tp2xpp2": ({"model": "llama", "tp": 2, "pp": 2, "memfd": True}, PER_RANK, "tp=2, pp=2"),
    "dcp": (
        {"model": "mqa", "tp": 2, "dcp": 2, "extra": {"canonical_layout": True}},
        PER_RANK,
        "does not certify",
    ),
    "mla-tp2": ({"model": "mla", "tp": 2, "memfd": True}, PER_RANK, "set canonical_layout"),
    # two groups (sliding window, full) over the same tensors; chunks of 4 blocks
    # and a 24-token window: prefill in 40-token steps leaves null blocks at the head
    # of sliding window chunks, which are stored whole with the null block in place
    "hybrid-swa": (
        {
            "model": "gptoss",
            "memfd": True,
            "max_batched_tokens": 40,
            "extra": {"blocks_per_chunk": 4},
        },
        PER_RANK,
        "2 KV cache groups",
    ),
    # three sliding window groups and a full one; one group uses one of two tensors
    "hybrid-subset": ({"model": "gemma3", "memfd": True}, PER_RANK, "4 KV cache groups"),
    # ... and under PP, stages that hold no layer of a group
    "hybrid-pp2": ({"model": "gemma3", "pp": 2}, PER_RANK, "pp=2"),
}


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with DaemonProcess("256MiB", "--log-level", "warning") as d:
        yield d


def engine(d: DaemonProcess, engine_id: str, shape: dict[str, Any]) -> EngineProc:
    shape = dict(shape)
    extra = {"offload_prompt_only": False, **shape.pop("extra", {})}
    return EngineProc(
        spec="kvoffload",
        socket_path=d.socket_path,
        engine_id=engine_id,
        num_blocks=512,
        max_num_seqs=8,
        extra=extra,
        **shape,
    )


def prompt() -> list[int]:
    return [_rng.randrange(1, 999) for _ in range(PROMPT_BLOCKS * 16 + 5)]


def stored(d: DaemonProcess, names: list[str]) -> int:
    """Blocks stored in these namespaces."""
    with kvoffload.connect(d.socket_path) as admin:
        sections = admin.stats()["namespaces"]
    return sum(int(sections[n]["stored_blocks"]) for n in names if n in sections)


def run(e: EngineProc) -> dict[str, Any]:
    e.run()
    st = e.stats()
    assert st["unfinished"] == 0 and st["bad_blocks"] == 0, st
    assert st["stores_dropped"] == 0, st["logs"]
    return st


def share(storer: EngineProc, loader: EngineProc, d: DaemonProcess, tag: str) -> dict[str, Any]:
    """``storer`` computes a prompt; ``loader`` loads all of it in one job and holds
    exactly its bytes. Returns the loader's stats."""
    p = prompt()
    names = loader.call("namespaces")
    before = stored(d, names)
    storer.add((f"{tag}-s", p, 4))
    run(storer)
    after = stored(d, names)
    assert after > before, "nothing was offloaded"
    loader.sees(after)
    loader.add((f"{tag}-l", p, 4))
    first = loader.schedule()
    assert first["loads"] == 1, first
    loader.execute()
    deadline = time.monotonic() + 20
    while True:  # the load lands; the request then computes what is left
        step = loader.schedule()
        loader.execute()
        if f"{tag}-l" in step["scheduled"]:
            break
        assert time.monotonic() < deadline, "the load never completed"
    # every full block of the prompt was loaded: only its last 5 tokens are computed
    assert step["scheduled"][f"{tag}-l"] == len(p) - PROMPT_BLOCKS * 16, step
    st = run(loader)
    assert st["loads"] >= 1
    return st


@pytest.mark.parametrize("name", list(CONFIGS))
def test_engines_of_one_shape_share_every_block(daemon: DaemonProcess, name: str) -> None:
    shape, layout, why = CONFIGS[name]
    a, b = engine(daemon, f"{name}-a", shape), engine(daemon, f"{name}-b", shape)
    try:
        a.ready(), b.ready()
        a.connected()
        b.connected()
        notes = a.stats()["notes"]
        said = [x for x in notes if "layout" in x and ("per-rank" in x or "canonical" in x)]
        assert len(said) == 1 and layout in said[0] and why in said[0], notes
        share(a, b, daemon, name)
    finally:
        a.close()
        b.close()


def test_data_parallel_engines_share(daemon: DaemonProcess) -> None:
    """DP replicas are separate engines (their own scheduler and ranks): one pool."""
    shape: dict[str, Any] = {"model": "llama", "tp": 2, "dp": 2, "memfd": True}
    a = engine(daemon, "dp-0", {**shape, "dp_index": 0})
    b = engine(daemon, "dp-1", {**shape, "dp_index": 1})
    try:
        a.ready(), b.ready()
        a.connected()
        b.connected()
        share(a, b, daemon, "dp")
        share(b, a, daemon, "dp-back")
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("model", ["llama", "mla", "gptoss"])
def test_canonical_engines_of_different_tp_sizes_share(daemon: DaemonProcess, model: str) -> None:
    """With the canonical layout a TP=2 engine's blocks reach TP=1 and TP=4 engines
    (the GQA model's 4 KV heads sharded anew, MLA's latent read by every rank, the
    hybrid model's two groups each in a canonical namespace of its own, its 2 KV
    heads replicated at TP=4)."""
    canonical = {"model": model, "memfd": True, "extra": {"canonical_layout": True}}
    a = engine(daemon, f"c{model}-tp2", {**canonical, "tp": 2})
    loaders = [engine(daemon, f"c{model}-tp{tp}", {**canonical, "tp": tp}) for tp in (1, 4)]
    try:
        for e in (a, *loaders):
            e.ready()
            e.connected()
        said = [x for x in a.stats()["notes"] if CANONICAL in x]
        assert len(said) == 1 and "shared by every TP size" in said[0], said
        for i, b in enumerate(loaders):
            share(a, b, daemon, f"c{model}{i}")
    finally:
        for e in (a, *loaders):
            e.close()
