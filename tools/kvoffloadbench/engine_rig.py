"""vLLM 0.33's real engine-side path, without a model: its ``Scheduler`` and its
``OffloadingConnector`` in both roles, in one process.

What runs is vLLM's own code: the scheduler (prefix caching, preemption, the
connector's lookups, load and store planning, deferred stores), the connector's
worker side (submits, ``get_finished``, ``wait``) and ``update_from_output``. Only the
forward pass is replaced: it writes each KV block as a function of the block's hash
(``pattern``), so every engine computing the same prefix writes the same bytes, and
it checks, before each step, that every block a request counts as computed holds
exactly those bytes (``bad_blocks``): a wrong or missing load is caught at once.
Sampling is deterministic in the prompt, so two engines fed one prompt generate one
sequence and offload the same keys.

The configuration comes from a tiny local model ``config.json`` with the Hugging Face
hub offline: nothing is downloaded.

``spec`` picks the offloading: "kvoffload" (``KVOffloadSpec`` against a daemon),
"vllm" (vLLM's own ``CPUOffloadingSpec``; its worker needs CUDA, so jobs complete at
once, which makes it the lower bound of the engine-side cost), "none" (no connector).
KV caches come from vLLM's own allocation (``allocate_kv_cache``: plain CPU tensors,
client-copy mode) or, with ``memfd``, the same views over a ``shared_kv_cache``
buffer (daemon-copy mode).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
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
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
from vllm.v1.core.kv_cache_planning import (
    get_global_kv_cache_groups,
    get_kv_cache_configs,
)
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, create_kv_cache_views
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

MODEL_DIR = Path(__file__).with_name("tiny-llama")
BLOCK_TOKENS = 16
LAYERS = 2
VOCAB = 1000
MAX_MODEL_LEN = 2048

if "KVOffloadSpec" not in OffloadingSpecFactory._registry:
    # vLLM resolves spec_name + spec_module_path with this same loader, after a
    # warning whose import chain needs all of vLLM's optional dependencies.
    OffloadingSpecFactory.register_spec("KVOffloadSpec", "kvoffload.vllm", "KVOffloadSpec")


def pattern(block_hash: bytes, tensor: int, nbytes: int) -> torch.Tensor:
    """The KV bytes of one block in one canonical tensor: a function of its hash."""
    raw = hashlib.shake_128(block_hash + tensor.to_bytes(2, "little")).digest(nbytes)
    return torch.frombuffer(bytearray(raw), dtype=torch.int8)


def next_token(prompt: list[int], position: int) -> int:
    """Deterministic sampling: one prompt, one sequence, in every engine."""
    return (sum(prompt[-8:]) * 31 + position * 7) % (VOCAB - 1) + 1


class Engine:
    def __init__(
        self,
        spec: str,
        *,
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
        self.prompts: dict[str, list[int]] = {}
        self.cfg = self._config(
            spec, socket_path, engine_id, max_num_seqs, max_batched_tokens,
            offload_prompt_only, extra or {},
        )  # fmt: skip
        kv_spec = FullAttentionSpec(
            block_size=BLOCK_TOKENS, num_kv_heads=2, head_size=16, dtype=torch.bfloat16
        )
        specs = {f"model.layers.{i}.self_attn.attn": kv_spec for i in range(LAYERS)}
        resolve_kv_cache_layout(self.cfg, [["LBHNC"]], specs.values())
        groups = get_global_kv_cache_groups(self.cfg, [specs])
        memory = num_blocks * kv_spec.page_size_bytes * LAYERS
        self.kv_cache_config = get_kv_cache_configs(self.cfg, [specs], [memory], groups)[0]
        self.cfg.cache_config.num_gpu_blocks = self.kv_cache_config.num_blocks
        hash_fn = get_hash_fn_by_name(self.cfg.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._hasher = get_request_block_hasher(BLOCK_TOKENS, hash_fn)
        self.scheduler = Scheduler(
            self.cfg, self.kv_cache_config, StructuredOutputManager(self.cfg), BLOCK_TOKENS
        )
        self.worker: OffloadingConnector | None = None
        self.tensors: list[torch.Tensor] = []
        if spec == "kvoffload":
            self.worker = OffloadingConnector(
                self.cfg, KVConnectorRole.WORKER, self.kv_cache_config
            )
            self.worker.register_kv_caches(self._allocate(memfd))
            self.tensors = list(self.offload_worker.worker.caches)

    # ------------------------------------------------------------ set-up

    @staticmethod
    def _config(
        spec: str,
        socket_path: str,
        engine_id: str,
        max_num_seqs: int,
        max_batched_tokens: int,
        offload_prompt_only: bool,
        extra: dict[str, Any],
    ) -> VllmConfig:
        transfer = None
        if spec != "none":
            options: dict[str, Any] = {"offload_prompt_only": offload_prompt_only}
            if spec == "kvoffload":
                options |= {
                    "spec_name": "KVOffloadSpec",
                    "spec_module_path": "kvoffload.vllm",
                    "socket_path": socket_path,
                }
            else:
                options |= {"cpu_bytes_to_use": 1 << 30}
            transfer = KVTransferConfig(
                kv_connector="OffloadingConnector",
                kv_role="kv_both",
                engine_id=engine_id,
                kv_connector_extra_config=options | extra,
            )
        model = ModelConfig(
            model=str(MODEL_DIR),
            skip_tokenizer_init=True,
            dtype="bfloat16",
            max_model_len=MAX_MODEL_LEN,
        )
        return VllmConfig(
            model_config=model,
            cache_config=CacheConfig(block_size=BLOCK_TOKENS, enable_prefix_caching=True),
            scheduler_config=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_batched_tokens,
                max_model_len=MAX_MODEL_LEN,
                is_encoder_decoder=False,
            ),
            kv_transfer_config=transfer,
            device_config=DeviceConfig("cpu"),
        )

    def _allocate(self, memfd: bool) -> dict[str, torch.Tensor]:
        return allocate_kv_caches(self.cfg, self.kv_cache_config, memfd)

    @property
    def offload_worker(self) -> Any:
        """The connector's worker: our ``KVOffloadWorker``."""
        assert self.worker is not None and self.worker.connector_worker is not None
        return self.worker.connector_worker.worker

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
        kv_out: KVConnectorOutput | None = None
        if self.worker is not None:
            w = self.worker
            assert isinstance(meta, OffloadingConnectorMetadata)
            w.handle_preemptions(meta)
            w.bind_connector_metadata(meta)
            w.start_load_kv(None)
            self._forward(out)
            w.wait_for_save()
            sending, recving = w.get_finished(out.finished_req_ids)
            self.loaded_blocks += 0 if not recving else len(recving)
            kv_out = KVConnectorOutput(
                finished_sending=sending or None,
                finished_recving=recving or None,
                kv_connector_worker_meta=w.build_connector_worker_meta(),
            )
            w.clear_connector_metadata()
        elif isinstance(meta, OffloadingConnectorMetadata):
            done = OffloadingWorkerMetadata()
            for job_id in (*meta.load_jobs, *meta.store_jobs):
                done.mark_completed(job_id)
            recving = {job.req_id for job in meta.load_jobs.values() if not job.sync}
            kv_out = KVConnectorOutput(
                finished_recving=recving or None,
                kv_connector_worker_meta=done if done.completed_jobs else None,
            )
        ids = list(out.num_scheduled_tokens)
        sampled = [self._sample(req_id) for req_id in ids]
        return ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_out,
        )

    def _sample(self, req_id: str) -> list[int]:
        req = self.scheduler.requests[req_id]
        if req.num_computed_tokens < req.num_tokens:
            return []  # a chunked prefill step samples nothing
        return [next_token(self.prompts[req_id], req.num_tokens)]

    def _forward(self, out: SchedulerOutput) -> None:
        """Check every block the requests count as computed; write the new ones."""
        if not self.tensors:
            return
        for req_id, n in out.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            end = req.num_computed_tokens
            start = end - n
            block_ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
            hashes = req.block_hashes
            if self.verify:
                self.bad_blocks += self._check(block_ids[: start // BLOCK_TOKENS], hashes)
            for i in range(start // BLOCK_TOKENS, end // BLOCK_TOKENS):
                for t, tensor in enumerate(self.tensors):
                    tensor[block_ids[i]] = pattern(hashes[i], t, tensor.shape[1])

    def _check(self, block_ids: Iterable[int], hashes: list[bytes]) -> int:
        bad = 0
        for i, b in enumerate(block_ids):
            for t, tensor in enumerate(self.tensors):
                if not torch.equal(tensor[b], pattern(hashes[i], t, tensor.shape[1])):
                    bad += 1
                    break
        return bad

    def shutdown(self) -> None:
        connector = self.scheduler.connector
        if connector is not None:
            connector.shutdown()
        if self.worker is not None:
            self.worker.shutdown()


def allocate_kv_caches(cfg: VllmConfig, kvc: Any, memfd: bool) -> dict[str, torch.Tensor]:
    """vLLM's own KV allocation (``allocate_kv_cache``'s views), over a memfd (the
    daemon copies) or plain memory (the worker copies itself: client-copy mode)."""
    size = kvc.kv_cache_tensors[0].size
    if memfd:
        import kvoffload

        buf = kvoffload.shared_kv_cache(1, size).view(-1)
    else:
        buf = torch.zeros(size, dtype=torch.int8)
    layout = cfg.cache_config.get_resolved_kv_cache_layout()
    spec = kvc.kv_cache_groups[0].kv_cache_spec
    caches: dict[str, torch.Tensor] = {}
    for t in kvc.kv_cache_tensors:
        views = create_kv_cache_views(buf, spec, kvc.num_blocks_of(t), layout, t)
        caches.update(zip(t.layers, views))
    return caches
