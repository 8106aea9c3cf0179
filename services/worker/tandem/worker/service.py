"""The gRPC ``tandem.v1.Worker`` service: one engine, one role.

Called by the gateway (Prefill, Decode, PrefetchKV, Abort). GetLoad and Health answer
people and tools (``grpcurl``); no Tandem component calls them: the router
reads load from the registry heartbeat, Kubernetes probes the standard
``grpc.health.v1`` service (served beside this one by ``__main__``, NOT_SERVING
once the engine died). Every field of a request is checked against the model
and the engine (:mod:`tandem.worker.validation`) before the engine sees it;
once the engine died (:meth:`WorkerService.engine_died`) every call answers
UNAVAILABLE.
The role's work is in :mod:`prefill` or :mod:`decode`, over the
:class:`~tandem.worker.engine_api.WorkerEngine` protocol; the engine's KV
server is reached through the engine itself, never over gRPC from here."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from tandem.v1 import kv_transfer_pb2, worker_pb2, worker_pb2_grpc
from tandem.worker.adapters import AdapterResidency
from tandem.worker.decode import DecodeRole
from tandem.worker.engine_api import EngineLoad, WorkerEngine
from tandem.worker.handling import Admission, Ctx, WorkerCounters
from tandem.worker.kv_connector.layout import KVLayout
from tandem.worker.peers import PrefillPeers
from tandem.worker.prefill import PrefillRole
from tandem.worker.settings import WorkerSettings
from tandem.worker.validation import ModelLimits, check_abort, check_decode, check_prefetch, check_prefill

logger = logging.getLogger(__name__)

#: How long a heartbeat waits for the KV server's counters (they come between engine steps).
KV_STATS_TIMEOUT_S = 1.0
#: The heartbeat reads the KV server's counters at most this often. Each read is a collective_rpc, and
#: vLLM's model-runner process busy-polls its message queue for a second after every message: read
#: every second, four idle engines kept ~45 % of a core each busy (measured), starving the host.
KV_STATS_REFRESH_S = 30.0


class WorkerService(worker_pb2_grpc.WorkerServicer):
    """Call :meth:`start` (learns the KV layout from the engine) before serving."""

    def __init__(self, settings: WorkerSettings, engine: WorkerEngine, *, worker_id: str) -> None:
        self._settings = settings
        self._engine = engine
        self._worker_id = worker_id
        self._role = settings.role
        self._model = settings.engine.served_model_name
        self._admission = Admission(worker_id, settings.role)
        self._counters = WorkerCounters()
        #: The model's sampling defaults, applied to options the client left unset.
        self._model_defaults = dict(engine.sampling_defaults())
        self._model_defaults.pop("max_tokens", None)  # the gateway decides max_tokens
        #: What every request is checked against (tandem.worker.validation).
        self.limits: ModelLimits = engine.limits()
        self.layout: KVLayout | None = None
        self._prefill: PrefillRole | None = None
        self._decode: DecodeRole | None = None
        self._kv_peers: PrefillPeers | None = None
        #: LoRA adapters in the engine (tandem.worker.adapters); None: LoRA off (``adapters.max_adapters`` 0).
        self.adapters: AdapterResidency | None = None
        #: The KV server's counters as last read (the heartbeat and GetLoad refresh them; /metrics reads them).
        self.last_kv_stats = kv_transfer_pb2.KVStats()
        self._kv_stats_read_s = -1e9

    async def start(self) -> None:
        self.set_layout(await self._engine.kv_layout())

    def set_layout(self, layout: KVLayout) -> None:
        self.layout = layout
        args = (self._engine, self._admission, self._counters, layout, self._model_defaults, self.adapters)
        self._prefill = PrefillRole(*args) if self._role == "prefill" else None
        self._decode = DecodeRole(*args) if self._role == "decode" else None
        if self._decode is not None:
            self._decode.peers = self._kv_peers

    def use_adapters(self, adapters: AdapterResidency) -> None:
        """Serve requests naming a LoRA adapter through ``adapters`` (before :meth:`start`)."""
        self.adapters = adapters
        if self.layout is not None:
            self.set_layout(self.layout)

    @property
    def loaded_adapters(self) -> tuple[str, ...]:
        """Engine names of the adapters loaded now, least recently used first."""
        return self.adapters.loaded() if self.adapters is not None else ()

    def use_kv_peers(self, peers: PrefillPeers) -> None:
        """Dial only these prefill workers' KV servers (tandem.worker.peers)."""
        self._kv_peers = peers
        if self._decode is not None:
            self._decode.peers = peers

    @property
    def role(self) -> str:
        return self._role

    @property
    def draining(self) -> bool:
        return self._admission.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self._admission.draining = value

    @property
    def engine_dead(self) -> bool:
        return self._admission.engine_dead

    def engine_died(self) -> None:
        """From now on every call answers UNAVAILABLE (tandem.worker.liveness)."""
        self._admission.engine_dead = True

    @property
    def num_running(self) -> int:
        return self._counters.num_running

    @property
    def num_prompt_tokens_in_flight(self) -> int:
        """Prompt tokens of the prefills running now (reported to the router to correct its budgets)."""
        return self._counters.num_prompt_tokens_in_flight

    @property
    def num_kv_tokens_in_flight(self) -> int:
        """Prompt plus max_tokens of the decodes running now."""
        return self._counters.num_kv_tokens_in_flight

    @property
    def decodes_by_continuation(self) -> dict[str, int]:
        """Decodes so far by how they continued the prefill's first token (tandem.worker.continuation)."""
        return dict(self._counters.decodes_by_continuation)

    @property
    def prefetches_by_outcome(self) -> dict[str, int]:
        """PrefetchKV calls so far by outcome (``started``, ``refused``)."""
        return dict(self._counters.prefetches_by_outcome)

    def engine_load(self) -> EngineLoad:
        """The engine's own view of its queue and KV cache (zeros if it cannot say)."""
        try:
            return self._engine.load()
        except Exception:  # a metric renamed by a vLLM upgrade must not stop the heartbeat
            logger.exception("engine load unreadable; reporting zeros")
            return EngineLoad()

    async def recent_kv_stats(self, max_age_s: float = KV_STATS_REFRESH_S) -> kv_transfer_pb2.KVStats:
        """The KV server's counters, read again only if the last read is older than ``max_age_s``."""
        if time.monotonic() - self._kv_stats_read_s < max_age_s:
            return self.last_kv_stats
        return await self.refresh_kv_stats()

    async def refresh_kv_stats(self, timeout_s: float = KV_STATS_TIMEOUT_S) -> kv_transfer_pb2.KVStats:
        """The KV server's counters now; the last ones read if the engine does not answer in time."""
        self._kv_stats_read_s = time.monotonic()
        try:
            self.last_kv_stats = await asyncio.wait_for(self._engine.kv_stats(), timeout_s)
        except Exception as exc:  # the engine is busy with a long step, or gone: report what we know
            logger.debug("KV counters not read (%s); reporting the last ones", type(exc).__name__)
        return self.last_kv_stats

    # -- RPCs --------------------------------------------------------------------

    async def _not_serving(self, context: Ctx, role: str) -> None:
        await self._admission.check(context, role)  # names the wrong role or the drain
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {self._worker_id} is starting")

    async def _invalid(self, context: Ctx, error: str) -> None:
        if error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)

    async def Prefill(self, request: worker_pb2.PrefillRequest, context: Ctx) -> worker_pb2.PrefillResponse:
        if self._prefill is None:
            await self._not_serving(context, "prefill")
        assert self._prefill is not None
        await self._admission.check(context, "prefill")
        await self._invalid(context, check_prefill(request, self.limits))
        return await self._prefill.prefill(request, context)

    async def Decode(self, request: worker_pb2.DecodeRequest, context: Ctx) -> AsyncIterator[worker_pb2.DecodeChunk]:
        if self._decode is None:
            await self._not_serving(context, "decode")
        assert self._decode is not None
        await self._admission.check(context, "decode")
        await self._invalid(context, check_decode(request, self.limits))
        async for chunk in self._decode.decode(request, context):
            yield chunk

    async def PrefetchKV(self, request: worker_pb2.PrefetchKVRequest, context: Ctx) -> worker_pb2.PrefetchKVResponse:
        if self._decode is None:
            await self._not_serving(context, "decode")
        assert self._decode is not None
        await self._admission.check(context, "decode")
        await self._invalid(context, check_prefetch(request, self.limits))
        return await self._decode.prefetch(request, context)

    async def Abort(self, request: worker_pb2.AbortRequest, context: Ctx) -> worker_pb2.AbortResponse:
        """Abort the request in the engine and free the KV kept for it: the blocks the KV server holds
        (prefill), the prefetch's staging (decode). found: there was such KV. Unknown ids are not an
        error; on a dead engine nothing is held (its memory went with it)."""
        await self._invalid(context, check_abort(request))
        if self.engine_dead:
            return worker_pb2.AbortResponse(found=False)
        await self._engine.abort(request.request_id)
        return worker_pb2.AbortResponse(found=await self._engine.kv_abort(request.request_id))

    async def GetLoad(self, request: worker_pb2.LoadRequest, context: Ctx) -> worker_pb2.LoadReport:
        await self._admission.check_serving(context)
        stats = await self.refresh_kv_stats()
        engine = self.engine_load()
        return worker_pb2.LoadReport(
            worker_id=self._worker_id,
            num_running_requests=self._counters.num_running,
            num_waiting_requests=engine.num_waiting_requests,
            kv_usage=engine.kv_usage,
            num_kv_blocks_total=engine.num_kv_blocks,
            num_held_kv_requests=stats.num_held_requests,
            kv_bytes_sent_total=stats.bytes_sent_total,
            kv_bytes_received_total=stats.bytes_received_total,
            kv_tokens_loaded_total=stats.kv_tokens_loaded_total,
            prompt_tokens_computed_total=self._counters.prompt_tokens_computed,
        )

    async def Health(self, request: worker_pb2.HealthRequest, context: Ctx) -> worker_pb2.HealthResponse:
        return worker_pb2.HealthResponse(
            worker_id=self._worker_id,
            role=self._role,
            model=self._model,
            ready=self.layout is not None and not self.draining and not self.engine_dead,
        )


async def wait_idle(service: WorkerService, timeout_s: float) -> None:
    """Wait until no request is running, at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while service.num_running and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
