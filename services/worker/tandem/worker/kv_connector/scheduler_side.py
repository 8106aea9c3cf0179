"""Scheduler-side half of the gRPC KV connector; runs in vLLM's engine-core
process, called by vLLM's scheduler. Decides what to hold (prefill) and what
to load (decode); never touches KV tensors. A decode request's load figures
come back from the worker side and leave with the finished request.

On the prefill side it also tells the worker side, step by step, how far each
prompt that a decode engine will pull is computed (its blocks, tokens before
and after the step), and when such a prompt ends without a hold, so that the
KV server can stream the prompt's blocks while the prefill still runs.

vLLM calls it with its own request ids (``Request.request_id``: the caller's id
with ``-`` and 8 random characters appended); everything it announces to the
worker side names a prefill's KV by the gateway's request id too (from
``kv_transfer_params``, :data:`params.REQUEST_ID`), which is what the handle
carries and what a decode engine pulls and releases by."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from tandem.worker.kv_connector.metadata import GrpcKVMetadata, GrpcKVWorkerMeta, HoldSpec, LoadSpec, PrefillProgress
from tandem.worker.kv_connector.params import (
    CAPABILITY,
    DO_REMOTE_DECODE,
    DO_REMOTE_PREFILL,
    HANDLE,
    KV_LOAD,
    REQUEST_ID,
    KVHandleParams,
    LoadRecord,
)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class SchedulerSide:
    """Per-engine bookkeeping between ``get_num_new_matched_tokens`` and
    ``build_connector_meta``."""

    def __init__(self, *, engine_id: str, kv_address: str, block_size_tokens: int, lease_s: float) -> None:
        self._engine_id = engine_id
        self._kv_address = kv_address
        self._block_size_tokens = block_size_tokens
        self._lease_s = lease_s
        self._pending = GrpcKVMetadata()
        #: Decode requests whose load is planned and not yet reported, and the reports not yet handed out.
        self._loading: set[str] = set()
        self._load_records: dict[str, LoadRecord] = {}
        #: Prefill requests a decode engine will pull, while they run: vLLM's request id → (prompt tokens,
        #: block ids so far).
        self._streamed: dict[str, tuple[int, list[int]]] = {}
        #: Prefill requests a decode engine will pull: vLLM's request id → the gateway's, which names their KV.
        self._request_ids: dict[str, str] = {}
        #: Prefill requests a decode engine will pull: vLLM's request id → the capability that reads their KV.
        self._capabilities: dict[str, str] = {}
        #: Prefill requests a decode engine will pull: vLLM's request id → the adapter they run with.
        self._adapters: dict[str, str] = {}

    # -- decode side -------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not params or not params.get(DO_REMOTE_PREFILL):
            return 0, False
        handle = KVHandleParams.from_dict(params[HANDLE])
        # The last prompt position is always computed here: its logits sample the first output token
        # (which decode replays; see tandem.worker.first_token).
        count = min(handle.num_tokens, request.num_prompt_tokens - 1) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if params and params.get(DO_REMOTE_DECODE) and request.request_id not in self._streamed:
            # A prefill a decode engine will pull: its progress goes to the worker side each step.
            self._streamed[request.request_id] = (request.num_prompt_tokens, [])
            self._request_ids[request.request_id] = _kv_request_id(request, params)
            self._capabilities[request.request_id] = str(params.get(CAPABILITY, ""))
            self._adapters[request.request_id] = _adapter(request)
            return
        if not params or not params.get(DO_REMOTE_PREFILL):
            return
        handle = KVHandleParams.from_dict(params[HANDLE])
        # Only one transfer per request, even though vLLM may call us twice.
        params[DO_REMOTE_PREFILL] = False
        if num_external_tokens <= 0:
            # Everything was in the local prefix cache: nothing to pull, but the
            # prefill engine still holds the blocks until we release them.
            self._pending.releases.append(handle)
            return
        block_size = self._block_size_tokens
        group = blocks.blocks[0]
        num_local_blocks = sum(1 for b in group if b.block_hash is not None and not b.is_null)
        num_local_tokens = num_local_blocks * block_size
        end_block = -(-(num_local_tokens + num_external_tokens) // block_size)
        all_ids = blocks.get_block_ids()[0]
        local_ids = tuple(all_ids[num_local_blocks:end_block])
        remote_ids = tuple(handle.block_ids[num_local_blocks:end_block])
        if len(remote_ids) != len(local_ids):
            logger.error(
                "kv handle of %s has %d blocks, need %d; loading what exists",
                request.request_id,
                len(handle.block_ids),
                end_block,
            )
            n = min(len(remote_ids), len(local_ids))
            local_ids, remote_ids = local_ids[:n], remote_ids[:n]
        self._loading.add(request.request_id)
        self._pending.loads.append(
            LoadSpec(
                engine_request_id=request.request_id,
                handle=handle,
                remote_block_ids=remote_ids,
                local_block_ids=local_ids,
                num_tokens=num_external_tokens,
                first_block_index=num_local_blocks,
            )
        )

    # -- prefill side ------------------------------------------------------------

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get(DO_REMOTE_PREFILL):
            # A decode request that ended before its load was planned (aborted in
            # the queue): tell the prefill engine to free its blocks.
            params[DO_REMOTE_PREFILL] = False
            self._pending.releases.append(KVHandleParams.from_dict(params[HANDLE]))
            return False, None
        streamed = self._streamed.pop(request.request_id, None) is not None
        kv_request_id = self._request_ids.pop(request.request_id, "") or _kv_request_id(request, params)
        capability = self._capabilities.pop(request.request_id, "") or str(params.get(CAPABILITY, ""))
        self._adapters.pop(request.request_id, None)
        if not params.get(DO_REMOTE_DECODE):
            # A decode request: its load's figures leave with it (a load still in flight reports to no one).
            self._loading.discard(request.request_id)
            record = self._load_records.pop(request.request_id, None)
            return False, ({KV_LOAD: record.to_dict()} if record is not None else None)
        if request.status != RequestStatus.FINISHED_LENGTH_CAPPED or not block_ids:
            # Stopped on EOS/stop string or aborted: nothing will be decoded (and a stream of its
            # prompt must stop before its blocks are reused).
            if streamed:
                self._pending.ended.add(request.request_id)
            return False, None
        expiry = time.time() + self._lease_s
        ids = tuple(int(b) for b in block_ids)
        adapter = _adapter(request)
        self._pending.holds[request.request_id] = HoldSpec(kv_request_id, ids, expiry, capability, adapter)
        handle = KVHandleParams(
            engine_id=self._engine_id,
            kv_address=self._kv_address,
            request_id=kv_request_id,
            block_ids=ids,
            num_tokens=request.num_computed_tokens,
            lease_expires_unix_s=expiry,
            adapter=adapter,
        )
        return True, {HANDLE: handle.to_dict()}

    def update_connector_output(self, worker_meta: object) -> None:
        """Keep the figures of loads that ended, for requests still running."""
        if not isinstance(worker_meta, GrpcKVWorkerMeta):
            return
        for req_id, record in worker_meta.loads.items():
            if req_id in self._loading:
                self._loading.discard(req_id)
                self._load_records[req_id] = record

    def build_connector_meta(self, scheduler_output: SchedulerOutput | None = None) -> GrpcKVMetadata:
        if scheduler_output is not None and self._streamed:
            self._plan_progress(scheduler_output)
        meta, self._pending = self._pending, GrpcKVMetadata()
        return meta

    def _plan_progress(self, out: SchedulerOutput) -> None:
        """How far this step computes each streamed prompt; a preempted one (its blocks freed, to be
        computed again elsewhere in the cache) ends its stream and is streamed no more."""
        for req_id in out.preempted_req_ids or ():
            if self._streamed.pop(req_id, None) is not None:
                self._pending.ended.add(req_id)
        scheduled = out.num_scheduled_tokens
        for new in out.scheduled_new_reqs:
            tracked = self._streamed.get(new.req_id)
            if tracked is None:
                continue
            num_prompt, block_ids = tracked
            block_ids[:] = new.block_ids[0]
            self._add_progress(new.req_id, num_prompt, block_ids, new.num_computed_tokens, scheduled.get(new.req_id, 0))
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._streamed.get(req_id)
            if tracked is None:
                continue
            if req_id in cached.resumed_req_ids:
                # Resumed after a preemption we did not see: its blocks are new, its stream is over.
                del self._streamed[req_id]
                self._pending.ended.add(req_id)
                continue
            num_prompt, block_ids = tracked
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                block_ids.extend(new_ids[0])
            self._add_progress(req_id, num_prompt, block_ids, cached.num_computed_tokens[i], scheduled.get(req_id, 0))

    def _add_progress(
        self, req_id: str, num_prompt: int, block_ids: list[int], num_computed: int, num_scheduled: int
    ) -> None:
        if num_computed >= num_prompt:
            return  # the prompt is computed; the request only samples now
        self._pending.progress.append(
            PrefillProgress(
                engine_request_id=req_id,
                request_id=self._request_ids.get(req_id, req_id),
                num_prompt_tokens=num_prompt,
                block_ids=tuple(block_ids),
                num_computed_tokens=num_computed,
                num_computed_after_step=min(num_prompt, num_computed + num_scheduled),
                capability=self._capabilities.get(req_id, ""),
                adapter=self._adapters.get(req_id, ""),
            )
        )


def _adapter(request: Request) -> str:
    """The LoRA adapter ``request`` runs with, by its engine name (vLLM's ``lora_name``); "" for the base model."""
    return request.lora_request.lora_name if request.lora_request is not None else ""


def _kv_request_id(request: Request, params: dict[str, Any]) -> str:
    """The id that names a prefill's KV between engines: the gateway's, as the worker service passed it
    (:func:`params.prefill_params`); vLLM's own id for a caller that named none."""
    return str(params.get(REQUEST_ID) or request.request_id)
