"""A vLLM engine and an SGLang instance on one daemon at once.

vLLM 0.33 and SGLang 0.5.23 pin different torch and transformers releases, so they
cannot be imported into one virtualenv: the vLLM side is a kvoffload client shaped like
the vLLM plug-in's worker, in its own process: the namespace the plug-in derives
(``kvoffload.vllm.identity``, pure), the plug-in's ``StreamingWorker`` over
``shared_kv_cache`` tensors, stores planned with ``prepare_store``/``complete_store``.
The SGLang side is SGLang's real controller.

What must hold: separate namespaces; the same access rules and budgets (one daemon
config for both); and neither starves the other of region space: the region's
extents are shared out between namespaces (``kvoffloadd.service.namespaces``): one below its
fair share (extents / namespaces holding any) takes whole extents from the fattest
one above it, and one at or above it evicts its own blocks.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterator

import numpy as np
import pytest

import kvoffload
from kvoffload.engine.streaming import StreamingWorker
from kvoffload.vllm.identity import VllmIdentity
from kvoffloadbench import sglang_rig as rig
from kvoffloadbench.launch import DaemonProcess

BLOCK = 256 * 1024
VLLM = VllmIdentity("llama", "bfloat16", 1, [16], 16, parallel="tp1.pp1.pcp1.dcp1")
VLLM_NAME = VLLM.namespace(0, 1, 0, 1)  # one group, one pipeline stage


def vllm_engine(socket_path: str, first: int, blocks: int, out: mp.SimpleQueue[int]) -> None:
    """Store ``blocks`` blocks of 256 KiB as the vLLM plug-in's worker would."""
    with kvoffload.connect(socket_path) as c:
        ns = c.namespace(VLLM_NAME, VLLM.layout([BLOCK], 1, 0))
        cache = kvoffload.shared_kv_cache(64, BLOCK)
        w = StreamingWorker(ns, [cache])
        stored = 0
        for start in range(first, first + blocks, 16):
            keys = [b"vllm%08d" % i for i in range(start, start + 16)]
            plan = ns.prepare_store(keys)
            if plan is None:
                continue
            w.submit_store(start, np.arange(len(plan.slots)), plan.slots)
            w.wait([start])
            ok = all(r.success for r in w.get_finished())
            ns.complete_store(plan.keys_to_store, ok)
            stored += len(plan.keys_to_store) if ok else 0
        w.close()
        out.put(stored)


def run_vllm(socket_path: str, first: int, blocks: int) -> int:
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    p = ctx.Process(target=vllm_engine, args=(socket_path, first, blocks, out))
    p.start()
    p.join(120)
    assert p.exitcode == 0
    stored: int = out.get()
    return stored


@pytest.fixture
def small() -> Iterator[DaemonProcess]:
    """A 64 MiB region of 2 MiB extents: 32 to share out."""
    with DaemonProcess(
        "64MiB", "--log-level", "warning", "--extent-size", "2MiB",
        settings={"max_writing_fraction": 1.0},
    ) as d:  # fmt: skip
        yield d


def blocks(d: DaemonProcess) -> dict[str, int]:
    with kvoffload.connect(d.socket_path) as c:
        return {n: s["stored_blocks"] for n, s in c.stats()["namespaces"].items()}


def test_vllm_and_sglang_share_one_daemon_without_starving(small: DaemonProcess) -> None:
    vllm_name = VLLM_NAME
    # vLLM fills the whole region (and evicts its own blocks to go on storing)
    assert run_vllm(small.socket_path, 0, 320) == 320
    assert blocks(small)[vllm_name] >= 200
    inst = rig.Instance(rig.Model(), "page_first", 16, 256, {"socket_path": small.socket_path})
    try:
        (sgl_name,) = inst.backend.namespaces
        assert sgl_name != vllm_name
        # SGLang (32 KiB pages) gets region space back from vLLM's namespace: whole
        # extents, evicted from the fattest namespace above its fair share
        prompts = []
        for seed in range(4):
            host = inst.alloc(64)
            want = inst.fill(host, seed)
            tokens = rig.page_tokens(seed, 64, 16)
            assert inst.backup(host, tokens) == 64 * 16
            inst.free(host)
            prompts.append((tokens, want))
        assert blocks(small)[sgl_name] == 256
        # vLLM goes on storing: it is above its fair share, so it evicts its own
        # blocks, never SGLang's
        assert run_vllm(small.socket_path, 1000, 320) == 320
        for tokens, want in prompts:
            got = inst.prefetch(tokens)
            assert got.loaded_tokens == 64 * 16
            assert got.host_indices is not None
            assert inst.page_bytes(got.host_indices) == want
            inst.free(got.host_indices)
        after = blocks(small)
        assert after[sgl_name] == 256 and after[vllm_name] >= 200
    finally:
        inst.close()
