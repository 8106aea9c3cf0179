"""One SIMULATED worker: serves ``tandem.v1.Worker`` over gRPC without running a model.

:class:`SimulatedWorker` sleeps as long as the latency model says (:mod:`tandem.local.simulated_latency`),
keeps its prefix cache and publishes its KV events (:mod:`tandem.local.simulated_kv`), and holds
SIMULATED LoRA adapter slots. :mod:`tandem.local.simulated_worker` says what it simulates and how.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import grpc

from tandem.common.block_hash import BlockHasher
from tandem.common.kv_events import BlockRemoved, BlockStored, KVEvent
from tandem.common.registry import WorkerLoad, WorkerRecord
from tandem.local.simulated_kv import SimulatedKVEventPublisher, SimulatedPrefixCache
from tandem.local.simulated_latency import SimulatedLatencyModel
from tandem.v1 import common_pb2, worker_pb2, worker_pb2_grpc

_Ctx = grpc.aio.ServicerContext[Any, Any]


#: Where a SIMULATED adapter "lives": the path its blocks are hashed with (a real worker hashes with the
#: catalog's path; a caller that sends block hashes for a SIMULATED worker uses this one).
SIMULATED_ADAPTER_PATH_PREFIX = "/simulated-adapters/"


def simulated_adapter_path(adapter: str) -> str:
    return SIMULATED_ADAPTER_PATH_PREFIX + adapter


class SimulatedAdapterRefused(Exception):
    """A request names an adapter this worker cannot serve (LoRA off)."""


@dataclass
class SimulatedWorkerConfig:
    worker_id: str
    role: str
    model: str = "simulated-model"
    host: str = "127.0.0.1"
    port: int = 0
    kv_events_port: int = 0
    kv_events_replay_port: int = 0
    block_size_tokens: int = 128
    num_kv_blocks: int = 2048
    latency: SimulatedLatencyModel = field(default_factory=SimulatedLatencyModel)
    #: Serve tandem.v1.Worker over gRPC (scale benchmarks that only need KV events skip it).
    serve_grpc: bool = True
    #: SIMULATED LoRA adapter slots (vLLM's max_loras; 0: LoRA off) and the engine seconds one load takes.
    max_adapters: int = 0
    adapter_load_s: float = 0.0


class SimulatedWorker(worker_pb2_grpc.WorkerServicer):
    """One SIMULATED worker (see the module docstring). Start with :meth:`start`, stop with :meth:`aclose`."""

    def __init__(self, config: SimulatedWorkerConfig) -> None:
        if not config.worker_id.startswith("simulated-"):
            raise ValueError("simulated worker ids start with 'simulated-'")
        self.config = config
        self.cache = SimulatedPrefixCache(config.num_kv_blocks)
        self._hasher = BlockHasher(config.block_size_tokens)
        self._publisher: SimulatedKVEventPublisher | None = None
        self._server: grpc.aio.Server | None = None
        self._compute = asyncio.Lock()  # one prefill computes at a time, like one CPU engine
        self.num_running = 0
        self.num_prompt_tokens_in_flight = 0
        self.num_kv_tokens_in_flight = 0
        self.prompt_tokens_computed_total = 0
        #: SIMULATED adapters loaded now, least recently used first, and the running requests of each.
        self.adapters: OrderedDict[str, None] = OrderedDict()
        self._adapter_users: dict[str, int] = {}
        self._adapter_lock = asyncio.Lock()
        #: Every load: (time.monotonic() when it finished, engine name).
        self.adapter_loads: list[tuple[float, str]] = []

    async def start(self) -> None:
        c = self.config
        self._publisher = SimulatedKVEventPublisher(c.host, c.kv_events_port, c.kv_events_replay_port)
        self._publisher.start()
        if c.serve_grpc:
            self._server = grpc.aio.server()
            worker_pb2_grpc.add_WorkerServicer_to_server(self, self._server)
            bound = self._server.add_insecure_port(f"{c.host}:{c.port}")
            self.config = replace(c, port=bound)
            await self._server.start()

    def record(self) -> WorkerRecord:
        c = self.config
        assert self._publisher is not None
        return WorkerRecord(
            worker_id=c.worker_id,
            role=c.role,
            model=c.model,
            address=f"{c.host}:{c.port}",
            kv_events_endpoint=self._publisher.endpoint,
            kv_events_replay_endpoint=self._publisher.replay_endpoint,
            block_size_tokens=c.block_size_tokens,
            num_kv_blocks=c.num_kv_blocks,
            max_model_len=1 << 16,
            started_unix_s=time.time(),
            max_adapters=c.max_adapters,
            adapters=tuple(self.adapters),
            load=WorkerLoad(
                num_running_requests=self.num_running,
                kv_usage=len(self.cache) / c.num_kv_blocks,
                num_prompt_tokens_in_flight=self.num_prompt_tokens_in_flight,
                num_kv_tokens_in_flight=self.num_kv_tokens_in_flight,
            ),
        )

    async def cache_prompt(
        self, token_ids: Sequence[int], cache_salt: str = "", *, lose_event: bool = False, adapter: str = ""
    ) -> int:
        """Put a prompt's blocks in the cache and publish the events; returns cached prompt tokens.
        ``lose_event`` simulates a dropped PUB message (the batch is only in the replay buffer)."""
        lora = {"lora_name": adapter, "lora_path": simulated_adapter_path(adapter)} if adapter else {}
        hashes = self._hasher.block_hashes(token_ids, cache_salt=cache_salt, **lora)
        num_hit = await self.cache_blocks(hashes, lose_event=lose_event)
        num_cached = min(num_hit * self.config.block_size_tokens, max(0, len(token_ids) - 1))
        return num_cached

    async def cache_blocks(self, hashes: Sequence[int], *, lose_event: bool = False) -> int:
        """Put a prompt's block hashes (vLLM's, as the gateway sends them) in the cache and publish the
        events, without any token ids; returns how many leading blocks hit."""
        num_hit, stored, evicted = self.cache.admit(hashes)
        events: list[KVEvent] = []
        if evicted:
            events.append(BlockRemoved(tuple(evicted)))
        if stored:
            first = hashes.index(stored[0])
            parent = hashes[first - 1] if first else None
            events.append(BlockStored(tuple(stored), parent, block_size=self.config.block_size_tokens))
        assert self._publisher is not None
        await self._publisher.publish(events, block_size=self.config.block_size_tokens, lose=lose_event)
        return num_hit

    @contextlib.asynccontextmanager
    async def using_adapter(self, adapter: str) -> AsyncIterator[None]:
        """Hold ``adapter`` (an engine name; "" the base model: nothing) for a request: loaded if it is
        not (its load time with the engine busy), evicting the least recently used adapter no running
        request uses, waiting while every slot is in use; SimulatedAdapterRefused with LoRA off."""
        if not adapter:
            yield
            return
        slots = self.config.max_adapters
        if slots <= 0:
            raise SimulatedAdapterRefused(f"LoRA adapters are off on this worker (adapter {adapter!r})")
        async with self._adapter_lock:
            while adapter not in self.adapters:
                if len(self.adapters) >= slots:
                    idle = next((a for a in self.adapters if not self._adapter_users.get(a)), None)
                    if idle is None:
                        await asyncio.sleep(0.01)  # every slot in use: wait for a request to end
                        continue
                    del self.adapters[idle]
                async with self._compute:  # a load holds the engine
                    await asyncio.sleep(self.config.adapter_load_s)
                self.adapters[adapter] = None
                self.adapter_loads.append((time.monotonic(), adapter))
            self.adapters.move_to_end(adapter)
            self._adapter_users[adapter] = self._adapter_users.get(adapter, 0) + 1
        try:
            yield
        finally:
            self._adapter_users[adapter] -= 1

    async def _compute_prompt(self, prompt: list[int], cache_salt: str, adapter: str = "") -> int:
        """Prefill ``prompt`` (one at a time, like one CPU engine): cache it, take the simulated time of
        its uncached tokens; returns the cached ones."""
        async with self._compute:
            num_cached = await self.cache_prompt(prompt, cache_salt, adapter=adapter)
            num_computed = len(prompt) - num_cached
            await asyncio.sleep(self.config.latency.prefill_s(num_computed))
            self.prompt_tokens_computed_total += num_computed
        return num_cached

    # -- tandem.v1.Worker ----------------------------------------------------------

    async def Prefill(self, request: worker_pb2.PrefillRequest, context: _Ctx) -> worker_pb2.PrefillResponse:
        prompt = list(request.prompt_token_ids)
        started_s = time.perf_counter()
        self.num_running += 1
        self.num_prompt_tokens_in_flight += len(prompt)
        try:
            async with self.using_adapter(request.adapter):
                num_cached = await self._compute_prompt(prompt, request.cache_salt, request.adapter)
        except SimulatedAdapterRefused as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        finally:
            self.num_running -= 1
            self.num_prompt_tokens_in_flight -= len(prompt)
        response = worker_pb2.PrefillResponse(
            request_id=request.request_id,
            first_token_id=1,
            first_text=" simulated",
            num_prompt_tokens=len(prompt),
            num_cached_tokens=num_cached,
            engine_seconds=time.perf_counter() - started_s,
            finish_reason="length" if not request.keep_kv else "",
        )
        if request.keep_kv:
            # A SIMULATED handle, in the real one's shape (the gateway refuses a prefill that kept no KV):
            # this worker's simulated decode peers load nothing from it.
            response.kv_handle.CopyFrom(
                common_pb2.KVHandle(
                    engine_id=self.config.worker_id,
                    kv_address=f"{self.config.host}:{self.config.port}",
                    num_tokens=len(prompt),
                )
            )
        return response

    async def Decode(self, request: worker_pb2.DecodeRequest, context: _Ctx) -> AsyncIterator[worker_pb2.DecodeChunk]:
        max_tokens = max(1, request.sampling.max_tokens)
        prompt = list(request.prompt_token_ids)
        num_kv = len(prompt) + max_tokens
        self.num_running += 1
        self.num_kv_tokens_in_flight += num_kv
        try:
            async with self.using_adapter(request.adapter):
                num_streamed = max_tokens - 1  # the first token came from the prefill worker
                if request.local_prefill:  # this worker prefills the prompt itself and streams every token
                    num_streamed = max_tokens
                    await self._compute_prompt(prompt, request.cache_salt, request.adapter)
                for i in range(num_streamed):
                    await asyncio.sleep(self.config.latency.decode_token_s())
                    chunk = worker_pb2.DecodeChunk(text=" sim", token_ids=[2 + i])
                    if i == num_streamed - 1:
                        chunk.finish_reason = "length"
                    yield chunk
        except SimulatedAdapterRefused as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        finally:
            self.num_running -= 1
            self.num_kv_tokens_in_flight -= num_kv

    async def Abort(self, request: worker_pb2.AbortRequest, context: _Ctx) -> worker_pb2.AbortResponse:
        return worker_pb2.AbortResponse(found=False)

    async def GetLoad(self, request: worker_pb2.LoadRequest, context: _Ctx) -> worker_pb2.LoadReport:
        return worker_pb2.LoadReport(
            worker_id=self.config.worker_id,
            num_running_requests=self.num_running,
            kv_usage=len(self.cache) / self.config.num_kv_blocks,
            prompt_tokens_computed_total=self.prompt_tokens_computed_total,
            num_kv_blocks_total=self.config.num_kv_blocks,
        )

    async def Health(self, request: worker_pb2.HealthRequest, context: _Ctx) -> worker_pb2.HealthResponse:
        return worker_pb2.HealthResponse(
            worker_id=self.config.worker_id, role=self.config.role, model=self.config.model, ready=True
        )

    async def aclose(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=0.1)
        if self._publisher is not None:
            await self._publisher.aclose()
