"""The KV-event subscriber against SIMULATED workers' ZMQ publishers (vLLM's
wire protocol: PUB + replay ROUTER), registered in the real Redis."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable

import pytest
import pytest_asyncio

from tandem.common.block_hash import BlockHasher
from tandem.common.registry import WorkerRegistry
from tandem.local.simulated_worker import SimulatedCluster, SimulatedLatencyModel, SimulatedWorkerConfig
from tandem.router.kv_index import KVIndex
from tandem.router.kv_subscriber import KVEventSubscriber

REDIS_URL = "redis://127.0.0.1:6379/0"
BLOCK = 16


async def eventually(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


def config(i: int) -> SimulatedWorkerConfig:
    return SimulatedWorkerConfig(
        worker_id=f"simulated-prefill-{i}",
        role="prefill",
        block_size_tokens=BLOCK,
        num_kv_blocks=8,
        latency=SimulatedLatencyModel(time_scale=0.0),
        serve_grpc=False,
    )


@pytest_asyncio.fixture
async def cluster() -> AsyncIterator[SimulatedCluster]:
    c = SimulatedCluster(
        [config(0), config(1)], redis_url=REDIS_URL, key_prefix=f"tandem-test-sub-{uuid.uuid4().hex[:8]}"
    )
    await c.start()
    yield c
    await c.aclose()


def prompt(seed: int, num_blocks: int = 3) -> list[int]:
    return [seed * 1000 + i for i in range(num_blocks * BLOCK)]


async def test_subscribing_replays_history_then_follows_live_events(cluster: SimulatedCluster) -> None:
    w0 = cluster.workers[0]
    await w0.cache_prompt(prompt(1))  # before anyone subscribed
    subscriber = KVEventSubscriber(KVIndex())
    subscriber.sync(w.record() for w in cluster.workers)
    hashes = BlockHasher(BLOCK).block_hashes(prompt(1))
    await eventually(lambda: subscriber.index.match(hashes) == {w0.config.worker_id: 3})
    await asyncio.sleep(0.2)  # slow joiner: let the SUB connection settle
    await cluster.workers[1].cache_prompt(prompt(1))
    await eventually(lambda: len(subscriber.index.match(hashes)) == 2)
    assert subscriber.stats.num_replays >= 2 and subscriber.stats.num_decode_errors == 0
    await subscriber.aclose()


async def test_a_lost_message_is_recovered_by_replay_and_evictions_are_followed(cluster: SimulatedCluster) -> None:
    w0 = cluster.workers[0]
    subscriber = KVEventSubscriber(KVIndex())
    subscriber.sync([w0.record()])
    await eventually(lambda: subscriber.num_following == 1)
    await asyncio.sleep(0.2)
    await w0.cache_prompt(prompt(1), lose_event=True)  # only in the replay buffer
    await w0.cache_prompt(prompt(2))  # live; its seq reveals the gap
    h1, h2 = BlockHasher(BLOCK).block_hashes(prompt(1)), BlockHasher(BLOCK).block_hashes(prompt(2))
    await eventually(lambda: subscriber.index.match(h1) != {} and subscriber.index.match(h2) != {})
    assert subscriber.stats.num_gaps == 1
    await w0.cache_prompt(prompt(3))  # 8-block cache: the oldest blocks (prompt 1) are evicted
    await eventually(lambda: subscriber.index.match(h1) == {})
    assert subscriber.index.num_blocks(w0.config.worker_id) == len(w0.cache) == 8
    await subscriber.aclose()


async def test_a_worker_leaving_the_registry_loses_its_entries_and_a_new_replica_rebuilds(
    cluster: SimulatedCluster,
) -> None:
    for w in cluster.workers:
        await w.cache_prompt(prompt(5))
    hashes = BlockHasher(BLOCK).block_hashes(prompt(5))
    registry = WorkerRegistry(REDIS_URL, key_prefix=cluster.key_prefix)
    subscriber = KVEventSubscriber(KVIndex())
    subscriber.sync(await registry.list_workers())
    await eventually(lambda: len(subscriber.index.match(hashes)) == 2)
    # a second, "restarted" replica rebuilds the same index from the publishers' replay
    rebuilt = KVEventSubscriber(KVIndex())
    rebuilt.sync(await registry.list_workers())
    await eventually(lambda: rebuilt.index.match(hashes) == subscriber.index.match(hashes))
    await rebuilt.aclose()
    gone = cluster.workers[1]
    await cluster.stop_worker(gone)
    subscriber.sync(await registry.list_workers())
    assert gone.config.worker_id not in subscriber.index.match(hashes)
    assert gone.config.worker_id not in subscriber.index.workers()
    await subscriber.aclose()
    await registry.aclose()


def test_simulated_ids_are_marked() -> None:
    with pytest.raises(ValueError):
        from tandem.local.simulated_worker import SimulatedWorker

        SimulatedWorker(SimulatedWorkerConfig(worker_id="prefill-1", role="prefill"))
