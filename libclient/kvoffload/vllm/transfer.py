"""vLLM's OffloadingWorker (one per engine rank), backed by kvoffloadd copies.

Rules:
- Built from vLLM's ``CanonicalKVCaches``: every canonical tensor is registered, in
  order, as a part of the rank's page (``identity``), CUDA tensors by IPC handle,
  memfd tensors by descriptor, plain CPU tensors in client-copy mode. The mode is
  picked automatically and logged.
- A vLLM job covers one or more KV cache groups (``GPULoadStoreSpec.group_sizes``);
  each group's blocks live only in that group's tensors, so each non-empty group is
  one kvoffload job that copies only those tensors. The first engine block of a group
  may sit inside its first offloaded block (``block_indices[g] % blocks_per_chunk``):
  that many sub-blocks are skipped, as in vLLM's ``compute_sub_block_ptrs``.
- vLLM 0.33 asserts that every submit and every result succeeded, so this worker
  never reports a failure (``kvoffload.streaming``): a store that could not happen is
  reported finished and is simply not offloaded; a planned load completes byte-exact
  or stops the engine with ``LoadLostError`` naming why.
- A vLLM job finishes when all its parts did.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import numpy as np
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    CanonicalPageMapping,
    CopyRun,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from ..canonical import CanonicalPart
from ..namespace import Namespace
from ..protocol.messages import KVLayout
from ..streaming import StreamingWorker
from .manager import SlotsSpec

log = logging.getLogger(__name__)


@dataclass
class _Job:
    parts_left: int
    nbytes: int = 0
    seconds: float = 0.0


Part = tuple[list[int], list[int], int, list[int], list[bytes]]  # ids, slots, skip, caches, keys


class KVOffloadWorker(OffloadingWorker):
    def __init__(
        self,
        ns: Namespace,
        kv_caches: CanonicalKVCaches,
        rank: int,
        blocks_per_chunk: int,
        copy_mode: str = "auto",
        store_timeout_s: float = 10.0,
        load_wait_s: float = 10.0,
        parts: int = 0,
    ) -> None:
        tensors = [t.tensor for t in kv_caches.tensors]
        canonical = canonical_parts(kv_caches, ns.layout) if parts else []
        self.f = blocks_per_chunk
        everything = list(range(len(tensors)))
        self.group_caches: list[list[int]] = []
        for refs in kv_caches.group_data_refs:
            used = sorted({ref.tensor_idx for ref in refs})
            self.group_caches.append([] if used == everything else used)
        self.worker = StreamingWorker(
            ns,
            tensors,
            rank,
            copy_mode=copy_mode,
            store_timeout_s=store_timeout_s,
            load_wait_s=load_wait_s,
            canonical=canonical,
            parts=max(parts, 1),
        )
        log.info(
            "kvoffload: rank %d attached %d KV tensors to namespace %s (%s copies, %s pages)",
            rank,
            len(tensors),
            ns.name,
            "client" if self.worker.copy_mode == "client" else "daemon",
            f"canonical, part {rank} of {parts}" if parts else "per-rank",
        )
        self._part_ids = itertools.count(1)
        self._part_job: dict[int, int] = {}  # kvoffload job id -> vLLM job id
        self._jobs: dict[int, _Job] = {}
        self._done: list[TransferResult] = []

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self._submit(job_id, src_spec, dst_spec, is_store=True)

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        return self._submit(job_id, dst_spec, src_spec, is_store=False)

    def _submit(
        self, job_id: int, gpu: GPULoadStoreSpec, slot_spec: LoadStoreSpec, is_store: bool
    ) -> bool:
        if not isinstance(slot_spec, SlotsSpec):
            raise TypeError(f"expected kvoffload slots, got {type(slot_spec).__name__}")
        parts = self._split(gpu, slot_spec.block_ids.tolist(), slot_spec.keys)
        if not parts:
            self._done.append(TransferResult(job_id, True, 0, 0.0))
            return True
        self._jobs[job_id] = _Job(len(parts))
        for ids, slots, skip, caches, keys in parts:
            part = next(self._part_ids)
            self._part_job[part] = job_id
            if is_store:
                self.worker.submit_store(part, ids, slots, caches, lease=slot_spec.lease)
            else:
                self.worker.submit_load(part, slots, ids, skip, caches, keys=keys)
        return True

    def _split(self, gpu: GPULoadStoreSpec, slots: list[int], keys: list[bytes]) -> list[Part]:
        """(engine block ids, slots, skip, cache indices, keys) per non-empty group."""
        ids = gpu.block_ids.tolist()
        out = []
        at_id = at_slot = 0
        for g, (size, first) in enumerate(zip(gpu.group_sizes, gpu.block_indices)):
            if size == 0:
                continue
            skip = first % self.f
            n_slots = -(-(size + skip) // self.f)
            out.append(
                (
                    ids[at_id : at_id + size],
                    slots[at_slot : at_slot + n_slots],
                    skip,
                    self.group_caches[g],
                    keys[at_slot : at_slot + n_slots],
                )
            )
            at_id += size
            at_slot += n_slots
        if at_id != len(ids) or at_slot != len(slots):
            raise ValueError(
                f"spec does not add up: {len(ids)} GPU blocks and {len(slots)} slots for "
                f"groups {list(gpu.group_sizes)} starting at {list(gpu.block_indices)}"
            )
        return out

    def get_finished(self) -> list[TransferResult]:
        for r in self.worker.get_finished():
            job_id = self._part_job.pop(r.job_id, None)
            if job_id is None:
                continue
            job = self._jobs[job_id]
            job.parts_left -= 1
            job.nbytes += r.nbytes
            job.seconds = max(job.seconds, r.seconds)
            if job.parts_left == 0:
                del self._jobs[job_id]
                self._done.append(TransferResult(job_id, True, job.nbytes, job.seconds))
        out, self._done = self._done, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        self.worker.wait([p for p, j in self._part_job.items() if j in job_ids])

    def shutdown(self) -> None:
        self.worker.close()
        self.worker.ns.client.close()


def canonical_parts(kv_caches: CanonicalKVCaches, layout: KVLayout) -> list[CanonicalPart]:
    """How each registered tensor's page maps into its canonical page (from the
    ``CanonicalPageMapping`` vLLM derived for this rank); RuntimeError, failing
    closed, where vLLM certified no mapping or the pages do not make the
    namespace's canonical block."""
    by_tensor: dict[int, CanonicalPageMapping] = {}
    for refs in kv_caches.group_data_refs:
        for ref in refs:
            mapping = ref.mapping
            if mapping is None or not mapping.parallelism_agnostic:
                raise RuntimeError(
                    "canonical_layout: vLLM certified no parallelism-agnostic mapping for "
                    f"KV tensor {ref.tensor_idx}; remove canonical_layout from "
                    "kv_connector_extra_config"
                )
            if by_tensor.setdefault(ref.tensor_idx, mapping) != mapping:
                raise RuntimeError(
                    f"canonical_layout: KV tensor {ref.tensor_idx} has layers with different "
                    "canonical mappings; kvoffload needs one per tensor"
                )
    if sorted(by_tensor) != list(range(len(kv_caches.tensors))):
        raise RuntimeError("canonical_layout: a KV tensor has no layer to map it")
    out = [
        CanonicalPart(m.canonical_page_size_bytes, fragments(m.runs), m.num_writers, m.writer_index)
        for _, m in sorted(by_tensor.items())
    ]
    want = layout.tensor_page_bytes[0]
    if sum(p.canonical_page_bytes for p in out) != want:
        raise RuntimeError(
            f"canonical_layout: this rank's canonical pages add up to "
            f"{sum(p.canonical_page_bytes for p in out)} bytes per block, not the {want} the "
            "scheduler sized the namespace for (more TP ranks than KV heads is not "
            "supported); remove canonical_layout from kv_connector_extra_config"
        )
    return out


def fragments(runs: tuple[CopyRun, ...]) -> np.ndarray:
    """(local offset, canonical offset, bytes) of every fragment of vLLM's runs."""
    rows = sorted(
        (
            r.local_offset + i * r.local_stride,
            r.canonical_offset + i * r.canonical_stride,
            r.fragment_size,
        )
        for r in runs
        for i in range(r.num_fragments)
    )
    return np.asarray(rows, dtype=np.int64).reshape(-1, 3)
