"""vLLM 0.33's real engine-side path, without a model: its ``Scheduler`` and its
``OffloadingConnector`` in both roles, every worker rank of the engine in one process.

What runs is vLLM's own code: the configuration and KV cache planning of the engine at
its parallel shape (``vllm_plan``), the scheduler (prefix caching, preemption, the
connector's lookups, load and store planning, deferred stores), the connector's
worker side on every rank (submits, ``get_finished``, ``wait``), vLLM's aggregation of
the ranks' outputs (``KVOutputAggregator``) and ``update_from_output``. The workers
register their KV caches before the scheduler starts, as in a vLLM engine. Only the
forward pass is replaced: every rank writes each KV block of its layers as a function
of the block's hash, the layer and the KV head (``pattern``), so every engine
computing the same prefix writes the same bytes whatever its parallel shape, and it
checks, before each step, that every block a request counts as computed holds exactly
those bytes (``bad_blocks``): a wrong or missing load is caught at once.
Sampling is deterministic in the prompt, so two engines fed one prompt generate one
sequence and offload the same keys.

``spec`` picks the offloading: "kvoffload" (``KVOffloadSpec`` against a daemon),
"vllm" (vLLM's own ``CPUOffloadingSpec``: its worker needs CUDA, so its jobs complete
at once, reporting the transfer sizes and times its real worker reports; the lower
bound of what offloading costs the scheduler), "none" (no connector). KV caches come
from vLLM's own allocation over plain memory (client-copy mode) or, with ``memfd``,
over a ``shared_kv_cache`` buffer (daemon-copy mode).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before vLLM imports the hub (vllm_plan)
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    resolve_dcp_kv_block_size,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from .vllm_plan import allocate_kv_caches, plan, vllm_config

VOCAB = 1000
MAX_MODEL_LEN = 2048


def pattern(block_hash: bytes, layer: str, head: int, nbytes: int) -> torch.Tensor:
    """The KV bytes of one block of one layer and KV head: a function of its hash."""
    tag = f"{layer}/{head}".encode()
    raw = hashlib.shake_128(block_hash + tag).digest(nbytes)
    return torch.frombuffer(bytearray(raw), dtype=torch.int8)


def next_token(prompt: list[int], position: int) -> int:
    """Deterministic sampling: one prompt, one sequence, in every engine."""
    return (sum(prompt[-8:]) * 31 + position * 7) % (VOCAB - 1) + 1


@dataclass
class RankKV:
    """One worker rank: its vLLM config, KV cache config, caches and connector."""

    cfg: VllmConfig
    kv_cache_config: KVCacheConfig
    caches: dict[str, torch.Tensor]  # layer -> vLLM's [blocks, heads, tokens, ...] view
    first_head: int  # the rank's first KV head (of the model's, or its replica's)
    connector: OffloadingConnector | None = None

    def group_layers(self, group: int) -> list[str]:
        return list(self.kv_cache_config.kv_cache_groups[group].layer_names)


class Engine:
    def __init__(
        self,
        spec: str,
        *,
        model: str = "tiny",
        tp: int = 1,
        pp: int = 1,
        dcp: int = 1,
        dp: int = 1,
        dp_index: int = 0,
        socket_path: str = "",
        engine_id: str = "e0",
        num_blocks: int = 2048,
        max_num_seqs: int = 256,
        max_batched_tokens: int = 8192,
        offload_prompt_only: bool = False,
        memfd: bool = False,
        verify: bool = True,
        extra: dict[str, Any] | None = None,
    ) -> None:
        self.spec = spec
        self.verify = verify
        self.bad_blocks = 0
        self.loaded_blocks = 0
        self.last_stores = 0  # store jobs the last executed step carried
        self.prompts: dict[str, list[int]] = {}
        transfer: dict[str, Any] | None = None
        if spec != "none":
            transfer = {"offload_prompt_only": offload_prompt_only}
            if spec == "kvoffload":
                transfer |= {
                    "spec_name": "KVOffloadSpec",
                    "spec_module_path": "kvoffload.vllm",
                    "socket_path": socket_path,
                }
            else:
                transfer["cpu_bytes_to_use"] = 1 << 30
            transfer |= extra or {}
        shape = {"tp": tp, "pp": pp, "dcp": dcp, "dp": dp, "dp_index": dp_index}
        common = {
            "transfer": transfer,
            "engine_id": engine_id,
            "max_num_seqs": max_num_seqs,
            "max_batched_tokens": max_batched_tokens,
            "max_model_len": MAX_MODEL_LEN,
        }
        self.cfg = vllm_config(model, **shape, **common)  # type: ignore[arg-type]
        self.world = self.cfg.parallel_config.world_size
        configs, self.kv_cache_config = plan(self.cfg, num_blocks)
        self.ranks: list[RankKV] = []
        for r, kvc in enumerate(configs):
            rcfg = self.cfg if r == 0 else vllm_config(model, rank=r, **shape, **common)  # type: ignore[arg-type]
            rcfg.cache_config = self.cfg.cache_config  # the layout and block count resolved
            self.ranks.append(
                RankKV(rcfg, kvc, allocate_kv_caches(rcfg, kvc, memfd), _first_head(rcfg, r))
            )
        if spec == "kvoffload":  # workers register first, as in vLLM's engine start-up
            for rk in self.ranks:
                rk.connector = OffloadingConnector(
                    rk.cfg, KVConnectorRole.WORKER, rk.kv_cache_config
                )
                rk.connector.register_kv_caches(rk.caches)
        block, hash_block = resolve_kv_cache_block_sizes(self.kv_cache_config, self.cfg)
        hash_fn = get_hash_fn_by_name(self.cfg.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._hasher = get_request_block_hasher(hash_block, hash_fn)
        self.scheduler = Scheduler(
            self.cfg,
            self.kv_cache_config,
            StructuredOutputManager(self.cfg),
            block,
            hash_block,
        )
        self._aggregator = KVOutputAggregator(self.world)

    # ------------------------------------------------------------ accessors

    @property
    def offload_worker(self) -> Any:
        """Rank 0's ``KVOffloadWorker``."""
        return self.offload_workers[0]

    @property
    def offload_workers(self) -> list[Any]:
        return [rk.connector.connector_worker.worker for rk in self.ranks if rk.connector]

    @property
    def manager(self) -> Any:
        connector = self.scheduler.connector
        assert connector is not None
        return connector.connector_scheduler.manager

    # ------------------------------------------------------------ requests

    def add(self, req_id: str, prompt: list[int], max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.prompts[req_id] = prompt
        req = Request(req_id, list(prompt), params, None, block_hasher=self._hasher)
        self.scheduler.add_request(req)

    @property
    def unfinished(self) -> int:
        return int(self.scheduler.get_num_unfinished_requests())

    def step(self) -> tuple[float, float]:
        """One engine step; returns the seconds of ``schedule()`` and of
        ``update_from_output()`` (the engine-side cost, without the forward pass)."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        t1 = time.perf_counter()
        result = self.execute(out)
        t2 = time.perf_counter()
        self.scheduler.update_from_output(out, result)
        return t1 - t0, time.perf_counter() - t2

    def run(self, max_steps: int = 100_000) -> int:
        """Step until every request finished; returns the steps taken."""
        for n in range(max_steps):
            if not self.unfinished and not self.scheduler.has_requests():
                return n
            self.step()
        raise TimeoutError(f"requests still unfinished after {max_steps} steps")

    # ------------------------------------------------------------ the worker side

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        meta = out.kv_connector_metadata
        self.last_stores = len(getattr(meta, "store_jobs", ()))
        ids = list(out.num_scheduled_tokens)
        sampled = [self._sample(req_id) for req_id in ids]
        outputs = []
        for rk in self.ranks:
            kv_out = None
            if rk.connector is not None:
                w = rk.connector
                assert isinstance(meta, OffloadingConnectorMetadata)
                w.handle_preemptions(meta)
                w.bind_connector_metadata(meta)
                w.start_load_kv(None)  # type: ignore[arg-type]
                self._forward(out, rk)
                w.wait_for_save()
                sending, recving = w.get_finished(out.finished_req_ids)
                kv_out = KVConnectorOutput(
                    finished_sending=sending or None,
                    finished_recving=recving or None,
                    kv_connector_worker_meta=w.build_connector_worker_meta(),
                )
                w.clear_connector_metadata()
            else:
                self._forward(out, rk)
                if isinstance(meta, OffloadingConnectorMetadata):
                    kv_out = self._vllm_worker(meta)
            outputs.append(
                ModelRunnerOutput(
                    req_ids=ids,
                    req_id_to_index={r: i for i, r in enumerate(ids)},
                    sampled_token_ids=sampled,
                    kv_connector_output=kv_out,
                )
            )
        result = self._aggregator.aggregate(outputs)
        assert result is not None
        recving = result.kv_connector_output and result.kv_connector_output.finished_recving
        self.loaded_blocks += len(recving or ())
        return result

    def _vllm_worker(self, meta: OffloadingConnectorMetadata) -> KVConnectorOutput:
        """vLLM's CPU worker, without CUDA: every job completes at once and reports its
        size and time, as ``CPUOffloadingWorker.get_finished`` does."""
        done = OffloadingWorkerMetadata()
        page = self.kv_cache_config.kv_cache_tensors[0].size // self.kv_cache_config.num_blocks
        for jobs, stats in (
            (meta.load_jobs, done.transfer_stats.load),
            (meta.store_jobs, done.transfer_stats.store),
        ):
            for job_id, job in jobs.items():
                done.mark_completed(job_id)
                gpu = job.dst_spec if jobs is meta.load_jobs else job.src_spec
                stats.record(len(gpu.block_ids) * page, 1e-5)  # type: ignore[attr-defined]
        recving = {job.req_id for job in meta.load_jobs.values() if not job.sync}
        return KVConnectorOutput(
            finished_recving=recving or None,
            kv_connector_worker_meta=done if done.completed_jobs else None,
        )

    def _sample(self, req_id: str) -> list[int]:
        req = self.scheduler.requests[req_id]
        if req.num_computed_tokens < req.num_tokens:
            return []  # a chunked prefill step samples nothing
        return [next_token(self.prompts[req_id], req.num_tokens)]

    def _forward(self, out: SchedulerOutput, rk: RankKV) -> None:
        """Check every block the requests count as computed; write the new ones, in
        every KV cache group's blocks of the rank's layers (null blocks skipped)."""
        if not rk.caches:
            return
        dcp = self.cfg.parallel_config.decode_context_parallel_size
        tokens = [
            resolve_dcp_kv_block_size(g.kv_cache_spec, dcp)
            for g in self.kv_cache_config.kv_cache_groups
        ]
        for req_id, n in out.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            end = req.num_computed_tokens
            start = end - n
            hashes = req.block_hashes
            per_group = self.scheduler.kv_cache_manager.get_block_ids(req_id)
            for g, block_ids in enumerate(per_group):
                layers = rk.group_layers(g)
                if not layers:
                    continue
                bt = tokens[g]
                if self.verify:
                    self.bad_blocks += self._check(rk, layers, block_ids[: start // bt], hashes)
                for i in range(start // bt, end // bt):
                    if block_ids[i]:
                        self._write(rk, layers, block_ids[i], hashes[i])

    @staticmethod
    def _write(rk: RankKV, layers: list[str], block: int, block_hash: bytes) -> None:
        for layer in layers:
            view = rk.caches[layer][block]
            for h in range(view.shape[0]):
                page = view[h]
                nbytes = page.numel() * page.element_size()
                page.copy_(
                    pattern(block_hash, layer, rk.first_head + h, nbytes)
                    .view(page.dtype)
                    .view(page.shape)
                )

    @staticmethod
    def _check(rk: RankKV, layers: list[str], block_ids: Iterable[int], hashes: list[bytes]) -> int:
        bad = 0
        for i, b in enumerate(block_ids):
            if not b:
                continue  # a sliding window block that fell out of the window
            for layer in layers:
                view = rk.caches[layer][b]
                nbytes = view[0].numel() * view.element_size()
                if not all(
                    torch.equal(
                        view[h].contiguous().view(torch.int8).view(-1),
                        pattern(hashes[i], layer, rk.first_head + h, nbytes),
                    )
                    for h in range(view.shape[0])
                ):
                    bad += 1
                    break
        return bad

    def shutdown(self) -> None:
        connector = self.scheduler.connector
        if connector is not None:
            connector.shutdown()
        for rk in self.ranks:
            if rk.connector is not None:
                rk.connector.shutdown()


def _first_head(cfg: VllmConfig, rank: int) -> int:
    """The model's KV head a rank's first cache head holds: heads are sharded over TP
    (replicated when TP exceeds them), an MLA latent is one head on every rank; decode
    context parallel ranks of one head hold other tokens, so they count apart."""
    mc, p = cfg.model_config, cfg.parallel_config
    if mc.use_mla:
        return 0
    total, tp = mc.get_total_num_kv_heads(), p.tensor_parallel_size
    tp_rank = rank % tp
    first = tp_rank * total // tp if tp <= total else tp_rank // (tp // total)
    dcp = p.decode_context_parallel_size
    return int(first + total * (tp_rank % dcp if dcp > 1 else 0))
