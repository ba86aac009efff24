"""SGLang's real HiCacheController and host pools, with kvoffload picked by SGLang's
own storage factory from the extra-config alone: every host layout, both allocators.

Scenario for each: pages written into the L2 host pool are backed up through
``write_storage`` (SGLang's backup thread calls ``batch_set_v1``), acked on
``ack_backup_queue``; the host pages are cleared; ``prefetch`` runs the hit query
(``batch_exists``), then ``prefetch_buffer`` -> ``batch_get_v1`` -> ``ack_prefetch_queue``,
and the pages SGLang reads back are byte-compared with what was written.
"""

from __future__ import annotations

import pytest

from kvoffloadbench import sglang_rig as rig
from kvoffloadbench.launch import DaemonProcess

CASES = [
    *[(False, layout) for layout in rig.MHA_LAYOUTS],
    *[(True, layout) for layout in rig.MLA_LAYOUTS],
]


@pytest.mark.parametrize("controller", ["hybrid", "base"])
@pytest.mark.parametrize("allocator", ["default", "shm"])
@pytest.mark.parametrize(("mla", "layout"), CASES, ids=lambda x: str(x))
def test_backup_then_prefetch_byte_exact(
    daemon: DaemonProcess, mla: bool, layout: str, allocator: str, controller: str
) -> None:
    """``hybrid``: SGLang 0.5.23's server path for every model (HybridCacheController
    over a host pool group); ``base``: the plain HiCacheController."""
    model = rig.Model(mla=mla)
    extra = {"socket_path": daemon.socket_path, "allocator": allocator}
    inst = rig.Instance(model, layout, 4, 64, extra, controller=controller)
    try:
        mode = "daemon" if allocator == "shm" else "client"
        assert inst.backend.copy_mode == "auto"
        assert all(w.client_copy == (mode == "client") for w in inst.backend._workers)
        pages = 10
        tokens = rig.page_tokens(7, pages, 4)
        host = inst.alloc(pages)
        want = inst.fill(host, seed=7)
        assert inst.backup(host, tokens) == pages * 4
        inst.clear(host)
        inst.free(host)

        got = inst.prefetch(tokens)
        assert (got.hit_tokens, got.loaded_tokens) == (pages * 4, pages * 4)
        assert got.host_indices is not None
        assert inst.page_bytes(got.host_indices) == want

        # A prompt that shares the first 6 pages hits exactly those.
        other = tokens[: 6 * 4] + rig.page_tokens(8, 3, 4)
        part = inst.prefetch(other, rid="r2", keep=False)
        assert (part.hit_tokens, part.loaded_tokens) == (24, 24)
    finally:
        inst.close()


def test_without_interface_v1_sglang_refuses_at_start(daemon: DaemonProcess) -> None:
    """Scenario: the user forgot ``interface_v1``: SGLang would copy every page through
    its generic path, so kvoffload refuses at start with one clear error."""
    extra = {"socket_path": daemon.socket_path, "interface_v1": 0}
    with pytest.raises(ValueError, match="interface_v1"):
        rig.Instance(rig.Model(), "page_first", 4, 16, extra)


def test_a_hybrid_model_is_refused_at_start_naming_it(daemon: DaemonProcess) -> None:
    """Scenario: a hybrid model (a sliding-window side pool beside the KV pool) needs
    HiCache's *_v2 calls, which kvoffload does not implement: SGLang's attach fails with
    one error naming the model and the pool, rather than half-working."""
    extra = {"socket_path": daemon.socket_path}
    with pytest.raises(NotImplementedError, match=r"hybrid models.*'gemma-swa'.*swa pool"):
        rig.Instance(rig.Model(), "page_first", 4, 16, extra, model_name="gemma-swa", swa_pool=True)
