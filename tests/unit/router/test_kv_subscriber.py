"""The KV-event subscriber against SIMULATED workers' ZMQ publishers (vLLM's
wire protocol: PUB + replay ROUTER), registered in the real Redis."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable

import pytest
import pytest_asyncio

from tandem.common.block_hash import BlockHasher
from tandem.common.kv_events import BlockStored
from tandem.common.registry import WorkerRecord, WorkerRegistry
from tandem.local.simulated_worker import (
    SimulatedCluster,
    SimulatedKVEventPublisher,
    SimulatedLatencyModel,
    SimulatedWorkerConfig,
)
from tandem.router.kv_index import KVIndex
from tandem.router.kv_subscriber import KVEventSubscriber
from tests.kit.net import dead_address

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


def record_of(publisher: SimulatedKVEventPublisher, i: int = 0, *, replay_endpoint: str | None = None) -> WorkerRecord:
    """The registration of SIMULATED prefill worker ``i`` whose events ``publisher`` publishes (its replay
    socket, or ``replay_endpoint``)."""
    return WorkerRecord(
        worker_id=f"simulated-prefill-{i}",
        role="prefill",
        model="m",
        address="127.0.0.1:1",
        kv_events_endpoint=publisher.endpoint,
        kv_events_replay_endpoint=publisher.replay_endpoint if replay_endpoint is None else replay_endpoint,
    )


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


async def test_a_lost_last_batch_is_repaired_by_the_periodic_catch_up(cluster: SimulatedCluster) -> None:
    w0 = cluster.workers[0]
    subscriber = KVEventSubscriber(KVIndex(), catch_up_interval_s=0.3)
    subscriber.sync([w0.record()])
    await eventually(lambda: subscriber.stats.num_replays >= 1)
    await asyncio.sleep(0.2)
    await w0.cache_prompt(prompt(1))
    await w0.cache_prompt(prompt(2), lose_event=True)  # the last batch of the burst: no later seq reveals it
    h2 = BlockHasher(BLOCK).block_hashes(prompt(2))
    await eventually(lambda: subscriber.index.match(h2) == {w0.config.worker_id: 3})
    # no gap was seen: only a catch-up could have found it (and prompt 1 too, had the slow joiner lost it)
    assert subscriber.stats.num_gaps == 0 and subscriber.stats.num_catch_ups >= 1
    assert subscriber.stats.num_recovered_batches >= 1
    await subscriber.aclose()


async def test_a_replay_socket_that_does_not_answer_leaves_the_live_stream_followed() -> None:
    publisher = SimulatedKVEventPublisher("127.0.0.1", 0, 0)
    publisher.start()
    record = record_of(publisher, replay_endpoint=f"tcp://{dead_address()}")
    subscriber = KVEventSubscriber(KVIndex(), replay_timeout_s=0.2, catch_up_interval_s=5.0)
    try:
        subscriber.sync([record])
        await eventually(lambda: subscriber.stats.num_replays >= 1)
        await asyncio.sleep(0.4)  # the first replay timed out; the SUB is connected
        await publisher.publish([BlockStored((1,))], block_size=BLOCK)
        await publisher.publish([BlockStored((2,))], block_size=BLOCK, lose=True)
        await publisher.publish([BlockStored((3,))], block_size=BLOCK)
        await eventually(lambda: subscriber.index.match([3]) != {})
        assert subscriber.index.match([1]) != {} and subscriber.index.match([2]) == {}
        assert subscriber.stats.num_gaps == subscriber.stats.num_unrepaired_batches == 1
        # the gap came while the replay socket was known down: no replay for it (catch-ups still ask)
        assert subscriber.stats.num_replays == 1 + subscriber.stats.num_catch_ups
    finally:
        await subscriber.aclose()
        await publisher.aclose()


def test_drop_fraction_is_a_fraction() -> None:
    with pytest.raises(ValueError):
        KVEventSubscriber(KVIndex(), drop_fraction=1.0)


async def test_following_more_workers_than_zmqs_default_socket_limit() -> None:
    """650 publishers (1,300 sockets in the simulated workers' shared context) followed by one
    subscriber (a SUB and a DEALER each: 1,300 in its own): ZMQ's default limit is 1,023 per context."""
    num_workers = 650
    publishers = [SimulatedKVEventPublisher("127.0.0.1", 0, 0) for _ in range(num_workers)]
    subscriber = KVEventSubscriber(KVIndex())
    try:
        for p in publishers:
            p.start()
        started_s = time.perf_counter()
        subscriber.sync(record_of(p, i) for i, p in enumerate(publishers))
        await eventually(lambda: subscriber.stats.num_replays >= num_workers, timeout_s=10)
        for i, p in enumerate(publishers):  # lost or not, the catch-up delivers each within ~2 s
            await p.publish([BlockStored((i,))], block_size=BLOCK)
        await eventually(lambda: subscriber.index.num_block_entries == num_workers, timeout_s=10)
        assert subscriber.index.match([7]) == {"simulated-prefill-7": 1}
        assert subscriber.stats.num_decode_errors == 0, time.perf_counter() - started_s
    finally:
        await subscriber.aclose()
        for p in publishers:
            await p.aclose()


def test_simulated_ids_are_marked() -> None:
    with pytest.raises(ValueError):
        from tandem.local.simulated_worker import SimulatedWorker

        SimulatedWorker(SimulatedWorkerConfig(worker_id="prefill-1", role="prefill"))


async def test_a_follower_yields_to_the_loop_once_its_slice_is_spent(monkeypatch: pytest.MonkeyPatch) -> None:
    """A burst of queued batches must not run as one loop callback: a follower applies what is queued
    for ``APPLY_SLICE_S``, then lets the callbacks waiting meanwhile (Schedules) run."""
    from tandem.router import kv_follower

    publisher = SimulatedKVEventPublisher("127.0.0.1", 0, 0)
    publisher.start()
    record = record_of(publisher, replay_endpoint=f"tcp://{dead_address()}")
    # The first replay goes unanswered for 0.5 s: the live batches published meanwhile queue up.
    subscriber = KVEventSubscriber(KVIndex(), replay_timeout_s=0.5, catch_up_interval_s=60.0)
    seen: list[int] = []
    try:
        subscriber.sync([record])
        await asyncio.sleep(0.2)
        for i in range(40):
            await publisher.publish([BlockStored((i,))], block_size=BLOCK)
        # Each look at the clock moves it a quarter slice: a slice is ~4 batches.
        clock = [100.0]

        def tick() -> float:
            clock[0] += kv_follower.APPLY_SLICE_S / 4
            return clock[0]

        monkeypatch.setattr(kv_follower.time, "perf_counter", tick)

        def probe() -> None:  # a callback that waits its turn as a Schedule would
            seen.append(subscriber.stats.num_batches)
            if subscriber.stats.num_batches < 40:
                asyncio.get_running_loop().call_soon(probe)

        asyncio.get_running_loop().call_soon(probe)
        await eventually(lambda: subscriber.stats.num_batches == 40)
        # It ran between slices of the burst, again and again (unsliced, it would see 0, then 40).
        assert len({n for n in seen if 0 < n < 40}) >= 3, seen
    finally:
        await subscriber.aclose()
        await publisher.aclose()


def test_following_on_uvloop() -> None:
    """Ray Serve runs the router on uvloop: a follower's descriptors and timers work there too
    (the first replay, live batches, a lost batch repaired by the catch-up)."""
    import uvloop

    async def scenario() -> tuple[dict[str, int], dict[str, int], int]:
        publisher = SimulatedKVEventPublisher("127.0.0.1", 0, 0)
        publisher.start()
        await publisher.publish([BlockStored((1,))], block_size=BLOCK)  # history: from the first replay
        record = record_of(publisher)
        subscriber = KVEventSubscriber(KVIndex(), catch_up_interval_s=0.3)
        try:
            subscriber.sync([record])
            await eventually(lambda: subscriber.index.match([1]) != {})
            await asyncio.sleep(0.2)
            await publisher.publish([BlockStored((2,))], block_size=BLOCK)
            await publisher.publish([BlockStored((3,))], block_size=BLOCK, lose=True)  # only a catch-up finds it
            await eventually(lambda: subscriber.index.match([3]) != {})
            return subscriber.index.match([2]), subscriber.index.match([3]), subscriber.stats.num_catch_ups
        finally:
            await subscriber.aclose()
            await publisher.aclose()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        live, repaired, num_catch_ups = runner.run(scenario())
    assert live == repaired == {"simulated-prefill-0": 1} and num_catch_ups >= 1
