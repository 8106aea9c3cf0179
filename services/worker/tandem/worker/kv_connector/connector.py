"""``GrpcKVConnector``: the class vLLM instantiates from
``kv_connector_module_path``, once per engine-core process (scheduler role)
and once per model-runner process (worker role). It only dispatches to
:mod:`scheduler_side` or :mod:`worker_side`.

Engine configuration (``kv_transfer_config.kv_connector_extra_config``):
``model`` (served name, part of the layout check), ``kv_host`` and
``kv_port`` (the KV server of rank 0; rank r listens on ``kv_port + r``),
``lease_s`` (how long a prefill engine holds blocks nobody released),
``model_revision`` (the weights' revision, part of the layout check),
``max_chunk_bytes``, ``pull_timeout_s``, ``prefetch_max_bytes`` (staging
memory for prefetches, 0: none), ``tls`` (a TLSSettings dict) and ``thread_cpus``
(the CPUs of the KV server's and puller's threads, a list; absent or empty: the
engine's own, see :mod:`cpus`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)

from tandem.common.tls import TLSSettings
from tandem.worker.kv_connector.metadata import GrpcKVMetadata, GrpcKVWorkerMeta
from tandem.worker.kv_connector.scheduler_side import SchedulerSide
from tandem.worker.kv_connector.worker_side import WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class GrpcKVConnector(KVConnectorBase_V1):
    """Pull-mode KV transfer over gRPC between a prefill and a decode engine."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra: dict[str, Any] = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        kv_host = str(extra.get("kv_host", "127.0.0.1"))
        kv_port = int(extra["kv_port"])
        block_size = int(vllm_config.cache_config.block_size)
        model = str(extra.get("model") or vllm_config.model_config.served_model_name)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(
                engine_id=str(self._kv_transfer_config.engine_id),
                kv_address=f"{kv_host}:{kv_port}",
                block_size_tokens=block_size,
                lease_s=float(extra.get("lease_s", 60.0)),
            )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._worker = WorkerSide(
                model=model,
                num_blocks=int(kv_cache_config.num_blocks),
                block_size_tokens=block_size,
                tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
                tp_rank=int(get_tensor_model_parallel_rank()),
                kv_host=kv_host,
                kv_port=kv_port,
                max_chunk_bytes=int(extra.get("max_chunk_bytes", 4 * 1024 * 1024)),
                pull_timeout_s=float(extra.get("pull_timeout_s", 30.0)),
                lease_s=float(extra.get("lease_s", 60.0)),
                prefetch_max_bytes=int(extra.get("prefetch_max_bytes", 0)),
                tls=TLSSettings(**dict(extra.get("tls") or {})),
                thread_cpus=frozenset(int(c) for c in extra.get("thread_cpus") or ()),
                shm_dir=str(extra.get("shm_dir", "")),
                shm_max_segments=int(extra.get("shm_max_segments", 4)),
                node_name=str(extra.get("node_name", "")),
                model_revision=str(extra.get("model_revision", "")),
            )

    # -- scheduler role ----------------------------------------------------------

    def _sched(self) -> SchedulerSide:
        assert self._scheduler is not None, "scheduler-side call on a worker-side connector"
        return self._scheduler

    def _work(self) -> WorkerSide:
        assert self._worker is not None, "worker-side call on a scheduler-side connector"
        return self._worker

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = self._sched().build_connector_meta(scheduler_output)
        meta.idle_step = scheduler_output.total_num_scheduled_tokens == 0
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched().update_connector_output(connector_output.kv_connector_worker_meta)

    # -- worker role -------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # The step's work starts here, before its forward pass: vLLM calls start_load_kv only after the
        # forward when no load is synchronous (on a GPU the forward is only launched by then; on the CPU
        # it has run), and a prompt's progress must be known while its layers are saved.
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, GrpcKVMetadata)
        self._work().begin_step(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return  # started when the metadata was bound

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads complete before vLLM schedules the request (asynchronous load).
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        # Pull mode: blocks stay in the paged cache until the decode side releases them. A layer
        # saved is a layer a decode engine's stream of a running prefill may read now.
        self._work().layer_saved(layer_name)

    def wait_for_save(self) -> None:
        return

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._work().get_transfer_results(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving | failed, failed_recving=failed
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().take_failed_block_ids()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        loads = self._work().take_load_records()
        return GrpcKVWorkerMeta(loads) if loads else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
