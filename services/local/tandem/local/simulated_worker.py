"""SIMULATED workers: stand-ins for vLLM workers when testing the router at scale.

Nothing here runs a model. A :class:`SimulatedWorker` speaks the same
protocols as a real worker so that the router cannot tell the difference:

* it registers in the Redis worker registry with a heartbeat (worker ids
  start with ``simulated-``), with block size, KV capacity and load;
* it serves ``tandem.v1.Worker`` (Prefill, Decode, GetLoad, Health) over gRPC,
  sleeping as long as :class:`SimulatedLatencyModel` says a CPU engine would;
* it keeps a prefix cache of ``num_kv_blocks`` blocks (LRU, hashed exactly as
  vLLM does, :mod:`tandem.common.block_hash`) and publishes BlockStored /
  BlockRemoved on a ZMQ PUB socket with a replay ROUTER socket, in vLLM's
  wire format (:mod:`tandem.common.kv_events`);
* with ``max_adapters`` > 0 it holds SIMULATED LoRA adapter slots as the real worker does
  (:mod:`tandem.worker.adapters`): an adapter is loaded on first use (``adapter_load_s`` of engine
  time, no prefill computes meanwhile), evicts the least recently used adapter no running request
  uses, and its record reports ``max_adapters`` and ``adapters`` (loaded now, least recently used
  first); a request for an adapter on a worker with ``max_adapters`` 0 is refused with
  FAILED_PRECONDITION, as the real worker refuses it. Nothing is loaded: an adapter is its name.
  Its blocks hash with the adapter as vLLM's do (``lora_name`` the engine name, ``lora_path``
  :func:`simulated_adapter_path`), so two adapters never share blocks here either.

The latency model is fitted to measured CPU numbers (``benchmarks/data/
simulated_latency_cpu.json`` says how they were measured). Numbers from
simulated workers describe the router, never model speed. Used by the router
tests (tests/unit/router, tests/integration) and ``benchmarks/bench_router.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc

from tandem.common.block_hash import BlockHasher
from tandem.common.kv_events import END_SEQ, BlockRemoved, BlockStored, KVEvent, encode_batch, encode_seq
from tandem.common.registry import WorkerLoad, WorkerRecord, WorkerRegistry
from tandem.v1 import common_pb2, worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

#: Where the fitted CPU latency model lives in the repository.
DEFAULT_LATENCY_MODEL_PATH = Path(__file__).resolve().parents[4] / "benchmarks" / "data" / "simulated_latency_cpu.json"

_Ctx = grpc.aio.ServicerContext[Any, Any]


@dataclass(frozen=True)
class SimulatedLatencyModel:
    """Seconds a CPU vLLM engine takes, as straight lines fitted to measurements."""

    #: Prefill: fixed cost plus a cost per uncached prompt token.
    prefill_base_s: float = 0.05
    prefill_s_per_token: float = 0.0005
    #: Decode: seconds per output token (inter-token latency).
    decode_s_per_token: float = 0.03
    #: Multiplies every sleep (tests use 0 to run at the router's own speed).
    time_scale: float = 1.0

    def prefill_s(self, num_uncached_tokens: int) -> float:
        return self.time_scale * (self.prefill_base_s + self.prefill_s_per_token * num_uncached_tokens)

    def decode_token_s(self) -> float:
        return self.time_scale * self.decode_s_per_token

    @classmethod
    def from_json(cls, path: Path = DEFAULT_LATENCY_MODEL_PATH, *, time_scale: float = 1.0) -> SimulatedLatencyModel:
        data = json.loads(path.read_text())["model"]
        return cls(
            prefill_base_s=float(data["prefill_base_s"]),
            prefill_s_per_token=float(data["prefill_s_per_token"]),
            decode_s_per_token=float(data["decode_s_per_token"]),
            time_scale=time_scale,
        )


#: Where a SIMULATED adapter "lives": the path its blocks are hashed with (a real worker hashes with the
#: catalog's path; a caller that sends block hashes for a SIMULATED worker uses this one).
SIMULATED_ADAPTER_PATH_PREFIX = "/simulated-adapters/"


def simulated_adapter_path(adapter: str) -> str:
    return SIMULATED_ADAPTER_PATH_PREFIX + adapter


class SimulatedAdapterRefused(Exception):
    """A request names an adapter this worker cannot serve (LoRA off)."""


class SimulatedPrefixCache:
    """An LRU set of block hashes, ``num_blocks`` at most (vLLM evicts least recently used free blocks)."""

    def __init__(self, num_blocks: int) -> None:
        self._num_blocks = num_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def admit(self, block_hashes: Sequence[int]) -> tuple[int, list[int], list[int]]:
        """Run a prompt's blocks through the cache: (leading blocks that hit, stored, evicted)."""
        num_hit = 0
        for h in block_hashes:
            if h not in self._blocks:
                break
            num_hit += 1
        stored: list[int] = []
        evicted: list[int] = []
        for h in block_hashes:
            if h in self._blocks:
                self._blocks.move_to_end(h)
                continue
            while len(self._blocks) >= self._num_blocks:
                old, _ = self._blocks.popitem(last=False)
                evicted.append(old)
            self._blocks[h] = None
            stored.append(h)
        return num_hit, stored, evicted


#: Sockets the simulated publishers of one process may hold (two each): ZMQ's default of 1,023
#: stops a benchmark at ~500 simulated workers with "Too many open files".
MAX_SOCKETS = 65_536
_zmq_context: Any = None


def _publisher_context() -> Any:
    """The ZMQ context every simulated publisher in this process shares, created on first use with
    ``MAX_SOCKETS`` raised. Process-wide and never terminated, like ``zmq.Context.instance()``: each
    publisher closes its own sockets, and the context's I/O thread lives as long as the process."""
    global _zmq_context
    if _zmq_context is None:
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context()
        ctx.set(zmq.MAX_SOCKETS, min(MAX_SOCKETS, ctx.get(zmq.SOCKET_LIMIT)))  # before any socket
        _zmq_context = ctx
    return _zmq_context


class SimulatedKVEventPublisher:
    """vLLM's ``ZmqEventPublisher`` protocol: PUB ``(topic, seq, payload)`` plus a
    ROUTER replay socket that streams buffered batches from a start seq, then END_SEQ."""

    def __init__(self, host: str, port: int, replay_port: int, *, buffer_steps: int = 10_000) -> None:
        import zmq

        self._ctx = _publisher_context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._replay = self._ctx.socket(zmq.ROUTER)
        self._replay.setsockopt(zmq.LINGER, 0)
        # port 0: any free port (what tests and benchmarks with many workers want)
        port = self._pub.bind_to_random_port(f"tcp://{host}") if port == 0 else self._bind(self._pub, host, port)
        replay_port = (
            self._replay.bind_to_random_port(f"tcp://{host}")
            if replay_port == 0
            else self._bind(self._replay, host, replay_port)
        )
        self.endpoint = f"tcp://{host}:{port}"
        self.replay_endpoint = f"tcp://{host}:{replay_port}"
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._replay_task: asyncio.Task[None] | None = None

    @staticmethod
    def _bind(sock: Any, host: str, port: int) -> int:
        sock.bind(f"tcp://{host}:{port}")
        return port

    def start(self) -> None:
        self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    async def publish(self, events: Sequence[KVEvent], *, block_size: int, lose: bool = False) -> None:
        """Send one batch; ``lose`` keeps it for replay only, as if the PUB message was dropped."""
        if not events:
            return
        payload = encode_batch(time.time(), events, block_size=block_size)
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        if not lose:
            await self._pub.send_multipart((b"", encode_seq(seq), payload))

    async def _serve_replay(self) -> None:
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                continue
            client_id, _, start = frames
            start_seq = int.from_bytes(start, "big", signed=True)
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await self._replay.send_multipart((client_id, b"", b"", encode_seq(seq), payload))
            await self._replay.send_multipart((client_id, b"", b"", END_SEQ, b""))

    async def aclose(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        self._pub.close(linger=0)
        self._replay.close(linger=0)


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


class SimulatedCluster:
    """Many SIMULATED workers in one process, registered in Redis under ``key_prefix``."""

    def __init__(
        self,
        configs: Sequence[SimulatedWorkerConfig],
        *,
        redis_url: str,
        key_prefix: str,
        heartbeat_interval_s: float = 0.5,
        ttl_s: float = 3.0,
    ) -> None:
        self.workers = [SimulatedWorker(c) for c in configs]
        self.key_prefix = key_prefix
        self._registry = WorkerRegistry(redis_url, key_prefix=key_prefix, ttl_s=ttl_s)
        self._interval_s = heartbeat_interval_s
        self._heartbeat: asyncio.Task[None] | None = None
        # redis-py can swallow a CancelledError that lands inside a command (the heartbeat then went on
        # beating and aclose() waited for it forever, ~1 run in 10 of the 64-worker test): it stops on this too.
        self._closed = False
        self._started_unix_s: dict[str, float] = {}

    async def start(self) -> None:
        for worker in self.workers:
            await worker.start()
            self._started_unix_s[worker.config.worker_id] = time.time()
        await self.heartbeat_once()
        self._heartbeat = asyncio.get_running_loop().create_task(self._beat_forever())

    async def heartbeat_once(self) -> None:
        for worker in list(self.workers):  # workers come and go while a heartbeat awaits Redis
            if worker not in self.workers:
                continue
            record = replace(worker.record(), started_unix_s=self._started_unix_s[worker.config.worker_id])
            await self._registry.heartbeat(record)

    async def _beat_forever(self) -> None:
        while not self._closed:
            await asyncio.sleep(self._interval_s)
            try:
                await self.heartbeat_once()
            except Exception:
                logger.exception("simulated heartbeat failed")

    async def add_worker(self, config: SimulatedWorkerConfig) -> SimulatedWorker:
        """Start one more worker; it is registered at once (a scale-up whose engine is ready)."""
        worker = SimulatedWorker(config)
        await worker.start()
        self._started_unix_s[config.worker_id] = time.time()
        self.workers.append(worker)
        await self._registry.heartbeat(replace(worker.record(), started_unix_s=self._started_unix_s[config.worker_id]))
        return worker

    async def drain_worker(self, worker: SimulatedWorker, timeout_s: float = 60.0) -> None:
        """Unregister ``worker`` (no new requests), let its requests finish, then close it: what a real
        worker does on SIGTERM."""
        self.workers.remove(worker)
        await self._registry.unregister(worker.config.worker_id)
        deadline = time.monotonic() + timeout_s
        while worker.num_running and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await worker.aclose()

    async def stop_worker(self, worker: SimulatedWorker) -> None:
        """Take one worker away (unregister and close), like a worker that was drained."""
        self.workers.remove(worker)
        await self._registry.unregister(worker.config.worker_id)
        await worker.aclose()

    async def aclose(self) -> None:
        self._closed = True
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
        for worker in self.workers:
            with contextlib.suppress(Exception):
                await self._registry.unregister(worker.config.worker_id)
            await worker.aclose()
        await self._registry.aclose()
