"""A SIMULATED fleet in a process of its own: many :class:`~tandem.local.simulated_worker.SimulatedWorker`
registered in Redis and publishing KV events over ZMQ, driven by commands, for the router's fleet
benchmark (``benchmarks/router_fleet.py``).

Nothing here runs a model, and nothing here is model speed. The fleet runs in its own process so
that, as in production, the workers' work (their prefix caches, their publishers, their heartbeats)
is not on the router's event loop. The driver (:class:`SimulatedFleet`) talks to it over two ZMQ
sockets: a PUSH of ``store`` commands (a placement made a worker compute a prompt: it caches the
blocks, evicting its least recently used, and publishes BlockStored / BlockRemoved as vLLM does),
and a REQ/REP control channel (fill the caches, read or reset the hit counters, dump the caches,
stop). Block hashes are opaque 64-bit ints here: the router only ever sees hashes (the gateway
sends them; ``tandem.common.block_hash`` is tested against vLLM's own hasher elsewhere), so the
corpus is random chains of hashes (:class:`FleetCorpus`), reproducible from a seed on both sides.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from tandem.local.simulated_worker import (
    SimulatedCluster,
    SimulatedLatencyModel,
    SimulatedWorker,
    SimulatedWorkerConfig,
)

_U64 = (1 << 64) - 1


@dataclass(frozen=True)
class FleetSpec:
    num_prefill: int
    num_decode: int
    redis_url: str
    key_prefix: str
    block_size_tokens: int = 16
    num_kv_blocks_prefill: int = 16_384
    num_kv_blocks_decode: int = 16_384
    heartbeat_interval_s: float = 1.0
    registry_ttl_s: float = 10.0
    seed: int = 7

    def worker_ids(self) -> list[str]:
        return [f"simulated-prefill-{i}" for i in range(self.num_prefill)] + [
            f"simulated-decode-{i}" for i in range(self.num_decode)
        ]


@dataclass(frozen=True)
class FleetCorpus:
    """Prompt prefixes as chains of block hashes: a few system prompts that every prefill worker
    caches, and tenant documents (each after its tenant's system prompt) cached on one to three
    prefill workers. Both sides rebuild it from the same numbers."""

    seed: int
    num_system_prompts: int = 8
    system_blocks: int = 32
    num_tenants: int = 400
    docs_per_tenant: int = 5
    doc_blocks: int = 96

    def _rnd(self, *key: int) -> random.Random:
        return random.Random(hash((self.seed, *key)))

    def system_prompt(self, s: int) -> list[int]:
        rnd = self._rnd(1, s)
        return [rnd.getrandbits(64) for _ in range(self.system_blocks)]

    def tenant_system_prompt(self, tenant: int) -> int:
        return tenant % self.num_system_prompts

    def doc(self, tenant: int, d: int) -> list[int]:
        rnd = self._rnd(2, tenant, d)
        return [rnd.getrandbits(64) for _ in range(self.doc_blocks)]

    def prefix(self, tenant: int, d: int) -> list[int]:
        return self.system_prompt(self.tenant_system_prompt(tenant)) + self.doc(tenant, d)

    def doc_homes(self, tenant: int, d: int, num_prefill: int) -> list[int]:
        """The prefill workers that start with this document cached (1 to 3 of them)."""
        rnd = self._rnd(3, tenant, d)
        return rnd.sample(range(num_prefill), k=min(num_prefill, rnd.choice((1, 1, 2, 3))))


# -- the child process -------------------------------------------------------------------------


async def _serve(spec: FleetSpec, control_endpoint: str, store_endpoint: str) -> None:
    import msgspec
    import zmq
    import zmq.asyncio

    latency = SimulatedLatencyModel(time_scale=0.0)
    configs = [
        SimulatedWorkerConfig(
            worker_id=worker_id,
            role="prefill" if worker_id.startswith("simulated-prefill") else "decode",
            block_size_tokens=spec.block_size_tokens,
            num_kv_blocks=spec.num_kv_blocks_prefill
            if worker_id.startswith("simulated-prefill")
            else spec.num_kv_blocks_decode,
            latency=latency,
            serve_grpc=False,
        )
        for worker_id in spec.worker_ids()
    ]
    cluster = SimulatedCluster(
        configs,
        redis_url=spec.redis_url,
        key_prefix=spec.key_prefix,
        heartbeat_interval_s=spec.heartbeat_interval_s,
        ttl_s=spec.registry_ttl_s,
    )
    await cluster.start()
    by_id: dict[str, SimulatedWorker] = {w.config.worker_id: w for w in cluster.workers}
    ctx = zmq.asyncio.Context()
    control = ctx.socket(zmq.REP)
    control.bind(control_endpoint)
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 0)
    pull.bind(store_endpoint)
    hits = {"num_blocks": 0, "num_hit_blocks": 0, "num_commands": 0}
    decoder = msgspec.msgpack.Decoder()
    encoder = msgspec.msgpack.Encoder()

    async def stores() -> None:
        while True:
            worker_id, hashes = decoder.decode(await pull.recv())
            worker = by_id.get(worker_id)
            if worker is None:
                continue
            hits["num_hit_blocks"] += await worker.cache_blocks(hashes)
            hits["num_blocks"] += len(hashes)
            hits["num_commands"] += 1

    store_task = asyncio.get_running_loop().create_task(stores())
    try:
        while True:
            command, args = decoder.decode(await control.recv())
            reply: Any = None
            if command == "fill":
                reply = await _fill(cluster, spec, FleetCorpus(**args["corpus"]), int(args["entries"]))
            elif command == "stats":
                reply = dict(hits)
            elif command == "reset":
                hits.update(num_blocks=0, num_hit_blocks=0, num_commands=0)
            elif command == "dump":
                reply = {w.config.worker_id: list(w.cache._blocks) for w in cluster.workers}
            elif command == "stop":
                await control.send(encoder.encode(None))
                return
            await control.send(encoder.encode(reply))
    finally:
        store_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await store_task
        await cluster.aclose()
        control.close(linger=0)
        pull.close(linger=0)
        ctx.term()


async def _fill(cluster: SimulatedCluster, spec: FleetSpec, corpus: FleetCorpus, entries: int) -> dict[str, int]:
    """Cache the corpus where it lives, then random filler, until the prefill workers hold about
    ``entries`` blocks; publishes every batch (the router's subscribers index them)."""
    prefill = [w for w in cluster.workers if w.config.role == "prefill"]
    per_worker = entries // max(1, len(prefill))
    rnd = random.Random(spec.seed)
    batch = 256
    for s in range(corpus.num_system_prompts):
        chain = corpus.system_prompt(s)
        for worker in prefill:
            await worker.cache_blocks(chain)
    for tenant in range(corpus.num_tenants):
        for d in range(corpus.docs_per_tenant):
            chain = corpus.prefix(tenant, d)
            for home in corpus.doc_homes(tenant, d, len(prefill)):
                await prefill[home].cache_blocks(chain)
    # Filler: cold content, in chains of batch blocks, stored oldest first (LRU keeps the corpus, which
    # is refreshed below so that it is the most recent).
    for worker in prefill:
        room = per_worker - len(worker.cache)
        while room > 0:
            n = min(batch, room)
            await worker.cache_blocks([rnd.getrandbits(64) for _ in range(n)])
            room -= n
            await asyncio.sleep(0)
    for tenant in range(corpus.num_tenants):
        for d in range(corpus.docs_per_tenant):
            chain = corpus.prefix(tenant, d)
            for home in corpus.doc_homes(tenant, d, len(prefill)):
                await prefill[home].cache_blocks(chain)
    return {"num_entries": sum(len(w.cache) for w in cluster.workers)}


def _child(spec: dict[str, Any], control_endpoint: str, store_endpoint: str) -> None:
    asyncio.run(_serve(FleetSpec(**spec), control_endpoint, store_endpoint))


# -- the driver's side -------------------------------------------------------------------------


class SimulatedFleet:
    """Starts the SIMULATED fleet process and commands it (see the module docstring)."""

    def __init__(self, spec: FleetSpec, *, control_port: int, store_port: int) -> None:
        import msgspec
        import zmq
        import zmq.asyncio

        self.spec = spec
        self._control_endpoint = f"tcp://127.0.0.1:{control_port}"
        self._store_endpoint = f"tcp://127.0.0.1:{store_port}"
        self._process = mp.get_context("spawn").Process(
            target=_child, args=(asdict(spec), self._control_endpoint, self._store_endpoint), daemon=True
        )
        self._ctx = zmq.asyncio.Context()
        self._control: Any = None
        self._push: Any = None
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder()

    async def start(self) -> None:
        import zmq

        self._process.start()
        self._control = self._ctx.socket(zmq.REQ)
        self._control.connect(self._control_endpoint)
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.connect(self._store_endpoint)
        await self.command("stats", timeout_s=120)  # answered once every worker is registered

    async def command(self, name: str, args: dict[str, Any] | None = None, *, timeout_s: float = 600) -> Any:
        await self._control.send(self._encoder.encode([name, args or {}]))
        if not await self._control.poll(timeout_s * 1000):
            raise TimeoutError(f"simulated fleet did not answer {name!r} within {timeout_s} s")
        return self._decoder.decode(await self._control.recv())

    @property
    def pid(self) -> int:
        """The fleet process's id (once started)."""
        assert self._process.pid is not None, "the fleet is not started"
        return self._process.pid

    def store(self, worker_id: str, hashes: Sequence[int] | bytes) -> None:
        """A placement made ``worker_id`` compute this prompt (fire and forget); ``hashes`` as they are
        or as :meth:`encode_hashes` gave them (a driver that prepares its trace ahead encodes them
        then, so that its own work does not land in the router's event loop)."""
        encoded = hashes if isinstance(hashes, bytes) else self.encode_hashes(hashes)
        self._push.send(b"\x92" + self._encoder.encode(worker_id) + encoded)

    def encode_hashes(self, hashes: Sequence[int]) -> bytes:
        return self._encoder.encode([h & _U64 for h in hashes])

    async def fill(self, corpus: FleetCorpus, entries: int) -> int:
        reply = await self.command("fill", {"corpus": asdict(corpus), "entries": entries}, timeout_s=1800)
        return int(reply["num_entries"])

    async def dump(self) -> dict[str, list[int]]:
        reply: dict[str, list[int]] = await self.command("dump", timeout_s=600)
        return reply

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await self.command("stop", timeout_s=30)
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()
        for sock in (self._control, self._push):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()
