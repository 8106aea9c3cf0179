"""The KV-event subscriber against vLLM's REAL publisher: ``ZmqEventPublisher``
(its own thread, PUB + replay ROUTER over tcp on 127.0.0.1) publishing vLLM's own
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``, block hashes as ints and
as raw digests. The index must end up holding exactly what the engine holds, also
when live messages are lost (``drop_fraction``) and when the lost ones are the very
last of a burst, which only the periodic catch-up repairs.

Two layouts: a stock vLLM publisher binding ``tcp://*:port`` itself, and the
worker's (:mod:`tandem.worker.kv_events_relay`): the engine publishes and replays
on ipc and the relay serves both, token ids zeroed, on ``tcp://127.0.0.1``.
Imports vLLM, hence ``slow``.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import zmq
import zmq.asyncio

from tandem.common.block_hash import external_block_hash
from tandem.common.kv_events import END_SEQ
from tandem.common.registry import WorkerRecord
from tandem.router.kv_index import KVIndex
from tandem.router.kv_subscriber import KVEventSubscriber
from tandem.worker.kv_events_relay import KVEventRelay, plan_endpoints
from tests.kit.net import free_port

pytestmark = pytest.mark.slow

BLOCK = 16
WORKER_ID = "prefill-vllm-0"
DROP_FRACTION = 0.05


@pytest.fixture(scope="module")
def vkv() -> Any:
    """``vllm.distributed.kv_events`` (imported here, not at collection: importing vLLM takes seconds)."""
    return pytest.importorskip("vllm.distributed.kv_events")


@dataclass
class Publisher:
    engine: Any  # vllm.distributed.kv_events.ZmqEventPublisher
    record: WorkerRecord
    relayed: bool = False

    def publish(self, batches: list[Any]) -> None:
        for batch in batches:
            self.engine.publish(batch)


@pytest.fixture(params=["engine-binds", "worker-relay"])
def publisher(request: pytest.FixtureRequest, vkv: Any) -> Iterator[Publisher]:
    port, replay_port = free_port(), free_port()
    relay: KVEventRelay | None = None
    if request.param == "engine-binds":
        # vLLM binds only a wildcard (any other tcp endpoint it connects to)
        engine_publish, engine_replay = f"tcp://*:{port}", f"tcp://127.0.0.1:{replay_port}"
        endpoint = f"tcp://127.0.0.1:{port}"
    else:
        plan = plan_endpoints("127.0.0.1", port, replay_port)
        engine_publish, engine_replay = plan.engine_publish, plan.engine_replay
        relay = KVEventRelay(plan)
        relay.start()
        endpoint = plan.public_publish
    engine = vkv.ZmqEventPublisher(0, endpoint=engine_publish, replay_endpoint=engine_replay)
    replay_endpoint = engine_replay if relay is None else plan.public_replay
    record = WorkerRecord(
        worker_id=WORKER_ID,
        role="prefill",
        model="m",
        address="127.0.0.1:1",
        kv_events_endpoint=endpoint,
        kv_events_replay_endpoint=replay_endpoint,
        block_size_tokens=BLOCK,
        started_unix_s=time.time(),
    )
    try:
        yield Publisher(engine, record, relayed=relay is not None)
    finally:
        engine.shutdown()
        if relay is not None:
            relay.close()


class Engine:
    """The test's oracle: a prefix cache that emits vLLM's events and knows what it holds
    (the GPU tier; blocks offloaded to CPU are not the index's)."""

    def __init__(self, vkv: Any, seed: int, *, block_size: int = BLOCK) -> None:
        self._v = vkv
        self._block_size = block_size
        self._rnd = random.Random(seed)
        self._raw: dict[int, bytes | int] = {}  # held block → the hash as the engine sent it
        self.seen: set[int] = set()
        self._num_batches = 0

    @property
    def held(self) -> set[int]:
        return set(self._raw)

    def _stored(self, n: int, *, digests: bool = False, medium: str = "GPU") -> Any:
        raw: list[bytes | int] = [self._rnd.randbytes(32) if digests else self._rnd.getrandbits(64) for _ in range(n)]
        for h in raw:
            self.seen.add(external_block_hash(h))
            if medium == "GPU":
                self._raw[external_block_hash(h)] = h
        return self._v.BlockStored(
            block_hashes=raw,
            parent_block_hash=None,
            token_ids=list(range(n * self._block_size)),
            block_size=self._block_size,
            lora_id=None,
            medium=medium,
            lora_name=None,
        )

    def _removed(self, n: int) -> Any:
        gone = self._rnd.sample(sorted(self._raw), n)
        return self._v.BlockRemoved(block_hashes=[self._raw.pop(h) for h in gone], medium="GPU")

    def batch(self, *, num_stored: int | None = None) -> Any:
        """The next step's events: an eviction now and then, new blocks (every tenth batch as raw
        digests), a block offloaded to CPU and, rarely, the whole cache reset."""
        i = self._num_batches
        self._num_batches += 1
        events: list[Any] = []
        if num_stored is None:
            if i % 97 == 96:
                self._raw.clear()
                events.append(self._v.AllBlocksCleared())
            if self._raw and self._rnd.random() < 0.4:
                events.append(self._removed(self._rnd.randint(1, min(3, len(self._raw)))))
            if i % 50 == 7:
                events.append(self._stored(2, medium="CPU"))
        events.append(self._stored(num_stored or self._rnd.randint(1, 4), digests=i % 10 == 3))
        return self._v.KVEventBatch(ts=time.time(), events=events)

    def batches(self, n: int, **kwargs: Any) -> list[Any]:
        return [self.batch(**kwargs) for _ in range(n)]


def differences(index: KVIndex, engine: Engine) -> tuple[int, int]:
    """(blocks the engine holds that the index lacks, blocks the index holds that the engine does not)."""
    held = engine.held
    missing = sum(1 for h in held if index.match([h]).get(WORKER_ID) != 1)
    extra = sum(1 for h in engine.seen - held if WORKER_ID in index.match([h]))
    return missing, extra + max(0, index.num_blocks(WORKER_ID) - len(held))


def in_step(index: KVIndex, engine: Engine) -> bool:
    return index.num_blocks(WORKER_ID) == len(engine.held) and differences(index, engine) == (0, 0)


async def eventually(predicate: Callable[[], bool], timeout_s: float, what: Callable[[], object]) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached in {timeout_s} s: {what()}")
        await asyncio.sleep(0.02)


async def until_in_step(subscriber: KVEventSubscriber, engine: Engine, timeout_s: float) -> None:
    await eventually(
        lambda: in_step(subscriber.index, engine),
        timeout_s,
        lambda: (differences(subscriber.index, engine), subscriber.stats),
    )


async def buffered_through(replay_endpoint: str, seq: int, timeout_s: float = 5.0) -> None:
    """Wait until the publisher's replay buffer holds batch ``seq`` (vLLM buffers a batch right
    after sending it), asking its replay socket as any subscriber would."""
    ctx = zmq.asyncio.Context()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(replay_endpoint)
            await dealer.send_multipart((b"", seq.to_bytes(8, "big")))
            found = False
            while await dealer.poll(2000):
                frames = await dealer.recv_multipart()
                if frames[2] == END_SEQ:
                    break
                found = True
            dealer.close(linger=0)
            if found:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"batch {seq} not buffered in {timeout_s} s")
    finally:
        ctx.destroy(linger=0)


def drops(seed: int, n: int) -> list[bool]:
    """Which of ``n`` live messages the subscriber's fault injection discards (its documented rule:
    one draw of ``random.Random(drop_seed)`` per live message, in arrival order)."""
    rnd = random.Random(seed)
    return [rnd.random() < DROP_FRACTION for _ in range(n)]


NUM_HISTORY, NUM_BURST, NUM_TAIL, NUM_TAIL_LOST = 40, 300, 5, 2


def seed_losing_the_tail() -> int:
    """A drop seed that loses several batches of the burst and the last ``NUM_TAIL_LOST`` batches of
    the tail, nothing else of it (so no later message reveals their loss)."""
    want_tail = [False] * (NUM_TAIL - NUM_TAIL_LOST) + [True] * NUM_TAIL_LOST
    for seed in range(100_000):
        pattern = drops(seed, NUM_BURST + NUM_TAIL)
        if pattern[NUM_BURST:] == want_tail and sum(pattern[:NUM_BURST]) >= 8:
            return seed
    raise AssertionError("no seed")


async def test_lost_messages_and_a_lost_tail_are_repaired_from_vllms_replay(publisher: Publisher, vkv: Any) -> None:
    engine = Engine(vkv, seed=1)
    seed = seed_losing_the_tail()
    pattern = drops(seed, NUM_BURST + NUM_TAIL)
    subscriber = KVEventSubscriber(
        KVIndex(), drop_fraction=DROP_FRACTION, drop_seed=seed, catch_up_interval_s=1.0, replay_timeout_s=2.0
    )
    try:
        # history the engine published before anyone followed it: rebuilt by the first replay
        publisher.publish(engine.batches(NUM_HISTORY))
        await buffered_through(publisher.record.kv_events_replay_endpoint, NUM_HISTORY - 1)
        subscriber.sync([publisher.record])
        await until_in_step(subscriber, engine, 5)
        await asyncio.sleep(0.5)  # slow joiner: let the SUB's subscription reach the publisher
        assert subscriber.stats.num_recovered_batches == 0

        # a burst, some of it lost on the way: gaps are replayed
        publisher.publish(engine.batches(NUM_BURST))
        await until_in_step(subscriber, engine, 8)
        stats = subscriber.stats
        # a replay may have applied the burst before the live messages behind it were read (and drawn for)
        await eventually(lambda: stats.num_dropped == sum(pattern[:NUM_BURST]), 3, lambda: stats)
        assert stats.num_gaps >= 1 and stats.num_recovered_batches >= 1 and stats.num_unrepaired_batches == 0

        # a tail whose last batches are lost: no later message reveals the gap, a catch-up repairs it
        num_catch_ups = stats.num_catch_ups
        await eventually(lambda: subscriber.stats.num_catch_ups > num_catch_ups, 3, lambda: subscriber.stats)
        # Its answer must end before the tail goes out: asked before, but answered after the tail was
        # published (the relay's extra hop, a loaded host), it would carry the tail itself (CI once saw
        # one catch-up do both).
        follower = subscriber._followers[WORKER_ID]  # the one follower (its replay state)
        await eventually(lambda: not follower.replaying, 3, lambda: subscriber.stats)
        num_catch_ups = stats.num_catch_ups
        num_gaps, num_recovered = stats.num_gaps, stats.num_recovered_batches
        publisher.publish(engine.batches(NUM_TAIL, num_stored=2))
        await eventually(lambda: stats.num_dropped == sum(pattern), 3, lambda: stats)
        await until_in_step(subscriber, engine, 4)
        assert stats.num_gaps == num_gaps  # nothing after the lost batches: only a catch-up found them
        assert stats.num_recovered_batches >= num_recovered + NUM_TAIL_LOST
        assert stats.num_catch_ups >= num_catch_ups + 1
        assert stats.num_decode_errors == stats.num_unrepaired_batches == 0
        assert stats.num_batches == NUM_HISTORY + NUM_BURST + NUM_TAIL
    finally:
        await subscriber.aclose()


async def test_without_losses_the_index_follows_with_no_replay_but_the_first(publisher: Publisher, vkv: Any) -> None:
    engine = Engine(vkv, seed=2)
    subscriber = KVEventSubscriber(KVIndex(), catch_up_interval_s=0.5)
    try:
        publisher.publish(engine.batches(NUM_HISTORY))
        await buffered_through(publisher.record.kv_events_replay_endpoint, NUM_HISTORY - 1)
        subscriber.sync([publisher.record])
        await until_in_step(subscriber, engine, 5)
        await asyncio.sleep(0.5)  # slow joiner
        # The burst goes right after a catch-up has been answered (the next is then ~1 s away): published
        # at a random moment, it once met a catch-up on a loaded CI host, which fetched a batch before the
        # live stream delivered it (counted as recovered, though nothing was lost).
        num_catch_ups = subscriber.stats.num_catch_ups
        await eventually(lambda: subscriber.stats.num_catch_ups > num_catch_ups, 3, lambda: subscriber.stats)
        await asyncio.sleep(0.3)  # vLLM answers a replay within ~0.1 s when idle
        publisher.publish(engine.batches(NUM_BURST))
        await until_in_step(subscriber, engine, 5)
        num_catch_ups = subscriber.stats.num_catch_ups
        await eventually(lambda: subscriber.stats.num_catch_ups > num_catch_ups, 3, lambda: subscriber.stats)
        await asyncio.sleep(0.3)  # vLLM answers a replay within ~0.1 s when idle
        stats = subscriber.stats
        assert in_step(subscriber.index, engine)
        assert stats.num_gaps == stats.num_recovered_batches == stats.num_dropped == 0
        assert stats.num_replays == 1 + stats.num_catch_ups  # catch-ups found nothing new
        assert stats.num_batches == NUM_HISTORY + NUM_BURST and stats.num_decode_errors == 0
    finally:
        await subscriber.aclose()


class SlowIndex(KVIndex):
    """An index that takes 0.2 ms per event, as a router busy with many workers would: a replay then
    arrives faster than it is read."""

    def apply(self, worker_id: str, event: Any) -> None:
        time.sleep(0.0002)
        super().apply(worker_id, event)


async def test_a_buffer_larger_than_the_replay_sockets_high_water_mark_is_replayed_whole(
    publisher: Publisher, vkv: Any
) -> None:
    """vLLM streams a replay without flow control: its ROUTER drops what exceeds the high-water
    mark (1,000 messages) once the socket buffers are full, end marker included, so a rebuild from
    a long buffer of CPU-sized batches (16 blocks of 128 tokens, ~6 KB each) takes several requests.
    Through the worker's relay it takes one: the relay drains vLLM's ROUTER and queues up to its own
    high-water mark (100,000 messages)."""
    engine = Engine(vkv, seed=3, block_size=128)
    num_batches = 4_000
    publisher.publish(engine.batches(num_batches, num_stored=16))
    await buffered_through(publisher.record.kv_events_replay_endpoint, num_batches - 1, timeout_s=10)
    subscriber = KVEventSubscriber(SlowIndex())
    try:
        subscriber.sync([publisher.record])
        await until_in_step(subscriber, engine, 8)
        stats = subscriber.stats
        assert stats.num_batches == num_batches
        assert stats.num_replays - stats.num_catch_ups >= (1 if publisher.relayed else 2)
        assert stats.num_unrepaired_batches == stats.num_decode_errors == stats.num_recovered_batches == 0
    finally:
        await subscriber.aclose()
