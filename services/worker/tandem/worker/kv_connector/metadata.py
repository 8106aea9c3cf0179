"""Messages between the two halves of the connector, once per engine step:
scheduler to worker (``build_connector_meta``) and worker to scheduler
(``build_connector_worker_meta``). Plain data only.

Two ids meet here: ``engine_request_id`` is vLLM's own id of a request in this
engine (what vLLM's scheduler is told of: loads done, blocks to free), and
``request_id`` is the gateway's, which names the prompt's KV between engines
(:mod:`params`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from tandem.worker.kv_connector.params import KVHandleParams, LoadRecord

#: How long an idle engine step (nothing scheduled) waits for the transfers it polls for: a load to
#: finish (decode), a hold to be released (prefill). vLLM steps an engine whose requests only wait for
#: KV (a decode's load) or hold it (a finished prefill's blocks until the decode engine releases them)
#: in a tight Python loop; in the process that also runs the transfer, that loop kept the GIL from its
#: threads (a 118 MB pull took 125-930 ms on the live stack, 65 ms without the loop on the decode
#: side; 0.12-0.17 GB/s with the prefill side looping). Waiting on a condition gives the GIL to the
#: transfer; a request that arrives meanwhile is scheduled at most this late.
IDLE_STEP_WAIT_S = 0.01


@dataclass(frozen=True)
class LoadSpec:
    """Decode side: pull ``remote_block_ids`` into ``local_block_ids``; the first of them is block
    ``first_block_index`` of the prompt (the blocks before it are in the local prefix cache). The KV is
    ``handle.request_id``'s: a prefetch of that id is copied from instead of pulling."""

    #: vLLM's id of the decode request in this engine (its load is reported done under it).
    engine_request_id: str
    handle: KVHandleParams
    remote_block_ids: tuple[int, ...]
    local_block_ids: tuple[int, ...]
    num_tokens: int
    first_block_index: int


@dataclass(frozen=True)
class PrefillProgress:
    """Prefill side: a prompt that a decode engine will pull is computed further in this step."""

    #: vLLM's id of the prefill request in this engine.
    engine_request_id: str
    #: The gateway's: a stream of the prompt's KV names it by this.
    request_id: str
    num_prompt_tokens: int
    #: The request's blocks so far, in prompt order.
    block_ids: tuple[int, ...]
    #: Prompt tokens computed before this step (the prefix-cache hit, on the first step).
    num_computed_tokens: int
    #: Prompt tokens computed once this step's forward pass has saved a layer.
    num_computed_after_step: int
    #: What a caller must present to read it (tandem.common.kv_capability).
    capability: str = field(default="", repr=False)
    #: The LoRA adapter the engine computes it with (its engine name; "" for the base model): a stream for
    #: another adapter is refused while it is prefilled, as a pull is once it is held.
    adapter: str = ""


@dataclass(frozen=True)
class HoldSpec:
    """Prefill side: a finished prefill's blocks, to hold for a decode engine until it releases them or
    the lease expires."""

    #: The gateway's: a pull or a release names the hold by this.
    request_id: str
    block_ids: tuple[int, ...]
    lease_expires_unix_s: float
    #: What a caller must present to read or release it (tandem.common.kv_capability).
    capability: str = field(default="", repr=False)
    #: The LoRA adapter the prefill engine computed the blocks with (its engine name; "" for the base model).
    adapter: str = ""


@dataclass
class GrpcKVMetadata(KVConnectorMetadata):
    #: Decode side: loads to start this step.
    loads: list[LoadSpec] = field(default_factory=list)
    #: Decode side: handles to release without loading (local cache hit, abort).
    releases: list[KVHandleParams] = field(default_factory=list)
    #: Prefill side: holds to start, by vLLM's request id.
    holds: dict[str, HoldSpec] = field(default_factory=dict)
    #: Prefill side: prompts computed further in this step, whose blocks may be streamed as each
    #: layer is saved.
    progress: list[PrefillProgress] = field(default_factory=list)
    #: Prefill side: streamed prompts that ended without a hold (stopped, aborted, preempted), by vLLM's
    #: request id: their blocks may be reused from this step on.
    ended: set[str] = field(default_factory=set)
    #: No tokens are scheduled this step: the engine only polls the connector (it is waiting for loads).
    idle_step: bool = False


@dataclass
class GrpcKVWorkerMeta(KVConnectorWorkerMetadata):
    """Decode side: the loads that ended since the last step, by vLLM's request id."""

    loads: dict[str, LoadRecord] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> GrpcKVWorkerMeta:
        """Another tensor-parallel rank's metadata for the same step."""
        assert isinstance(other, GrpcKVWorkerMeta)
        merged = dict(self.loads)
        for req_id, record in other.loads.items():
            mine = merged.get(req_id)
            merged[req_id] = record if mine is None else mine.merge(record)
        return GrpcKVWorkerMeta(merged)
