"""Messages between the two halves of the connector, once per engine step:
scheduler to worker (``build_connector_meta``) and worker to scheduler
(``build_connector_worker_meta``). Plain data only."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from tandem.worker.kv_connector.params import KVHandleParams, LoadRecord


@dataclass(frozen=True)
class LoadSpec:
    """Decode side: pull ``remote_block_ids`` into ``local_block_ids``."""

    request_id: str
    handle: KVHandleParams
    remote_block_ids: tuple[int, ...]
    local_block_ids: tuple[int, ...]
    num_tokens: int


@dataclass
class GrpcKVMetadata(KVConnectorMetadata):
    #: Decode side: loads to start this step.
    loads: list[LoadSpec] = field(default_factory=list)
    #: Decode side: handles to release without loading (local cache hit, abort).
    releases: list[KVHandleParams] = field(default_factory=list)
    #: Prefill side: request id → (block ids, lease expiry in Unix seconds).
    holds: dict[str, tuple[tuple[int, ...], float]] = field(default_factory=dict)
    #: No tokens are scheduled this step: the engine only polls the connector (it is waiting for loads).
    idle_step: bool = False


@dataclass
class GrpcKVWorkerMeta(KVConnectorWorkerMetadata):
    """Decode side: the loads that ended since the last step, by vLLM request id."""

    loads: dict[str, LoadRecord] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> GrpcKVWorkerMeta:
        """Another tensor-parallel rank's metadata for the same step."""
        assert isinstance(other, GrpcKVWorkerMeta)
        merged = dict(self.loads)
        for req_id, record in other.loads.items():
            mine = merged.get(req_id)
            merged[req_id] = record if mine is None else mine.merge(record)
        return GrpcKVWorkerMeta(merged)
