"""The router's KV index against a real vLLM engine (the shared stack's prefill
worker): the engine's own KV events, received over its ZMQ publisher, contain
exactly the block hashes the router computes for the same prompt and salt;
an in-process scheduler then expects the cache hit that the engine reports."""

from __future__ import annotations

import asyncio
import uuid

import msgspec
import pytest
import zmq
import zmq.asyncio

from tandem.common.block_hash import BlockHasher
from tandem.common.kv_events import END_SEQ, BlockStored, decode_batch
from tandem.common.registry import WorkerRegistry
from tandem.common.tls import aio_channel
from tandem.local.stack import LocalStack
from tandem.router.kv_index import KVIndex
from tandem.router.kv_subscriber import KVEventSubscriber
from tandem.router.policy import ScheduleRequest, create_policy
from tandem.router.reservations import ReservationTable
from tandem.router.scheduler import Scheduler
from tandem.router.worker_view import CachedWorkerView
from tandem.v1 import common_pb2, worker_pb2, worker_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(600)]


async def _prefill(stack: LocalStack, address: str, prompt: list[int], salt: str) -> worker_pb2.PrefillResponse:
    # As the gateway calls it: over the stack's mTLS with the gateway's certificate.
    async with aio_channel(address, stack.tls("gateway")) as channel:
        response: worker_pb2.PrefillResponse = await worker_pb2_grpc.WorkerStub(channel).Prefill(
            worker_pb2.PrefillRequest(
                request_id=f"kv-index-{uuid.uuid4().hex[:8]}",
                prompt_token_ids=prompt,
                sampling=common_pb2.SamplingOptions(max_tokens=1, temperature=0.0),
                cache_salt=salt,
                keep_kv=False,
            ),
            timeout=300,
        )
        return response


async def test_engine_kv_events_carry_the_routers_block_hashes(stack: LocalStack) -> None:
    registry = WorkerRegistry(stack.config.redis_url, key_prefix=stack.config.key_prefix)
    subscriber = KVEventSubscriber(KVIndex())
    try:
        workers = await registry.list_workers()
        prefill = next(w for w in workers if w.role == "prefill")
        assert prefill.kv_events_endpoint and prefill.kv_events_replay_endpoint
        assert prefill.block_size_tokens > 0 and prefill.block_hash_algo == "sha256"  # 128 on CPU, 16 on GPUs
        subscriber.sync(workers)
        # what anyone on the pod network reads: the worker's public feed, raw
        ctx = zmq.asyncio.Context()
        raw_feed = ctx.socket(zmq.SUB)
        raw_feed.setsockopt(zmq.SUBSCRIBE, b"")
        raw_feed.connect(prefill.kv_events_endpoint)
        await asyncio.sleep(0.5)

        salt = f"it-{uuid.uuid4().hex[:8]}"
        block = prefill.block_size_tokens
        prompt = [(17 * i + 5) % 30000 + 100 for i in range(3 * block + 50 % block)]  # 3 full blocks + a tail
        ours = BlockHasher(prefill.block_size_tokens, prefill.block_hash_seed).block_hashes(prompt, cache_salt=salt)
        assert len(ours) == 3
        first = await _prefill(stack, prefill.address, prompt, salt)
        assert first.num_cached_tokens == 0
        deadline = asyncio.get_running_loop().time() + 30
        while subscriber.index.match(ours).get(prefill.worker_id, 0) < 3:
            assert asyncio.get_running_loop().time() < deadline, f"events: {subscriber.stats}"
            await asyncio.sleep(0.1)
        # the feed and the replay say how many tokens each block holds, never which, nor the salt
        payloads: list[bytes] = []
        while await raw_feed.poll(500):
            payloads.append((await raw_feed.recv_multipart())[2])
        replay = ctx.socket(zmq.DEALER)
        replay.connect(prefill.kv_events_replay_endpoint)
        await replay.send_multipart((b"", (0).to_bytes(8, "big")))
        while await replay.poll(10_000) and (frames := await replay.recv_multipart())[2] != END_SEQ:
            payloads.append(frames[3])
        ours_stored = [
            e
            for p in payloads
            for e in decode_batch(p).events
            if isinstance(e, BlockStored) and set(e.block_hashes) & set(ours)
        ]
        assert sum(e.num_tokens for e in ours_stored) >= 3 * block  # the router still reads the counts
        raw = [e for p in payloads for e in msgspec.msgpack.decode(p)[1] if e.get("type") == "BlockStored"]
        assert raw and all(not any(e["token_ids"]) and not e.get("extra_keys") for e in raw)
        assert all(salt.encode() not in p for p in payloads)
        raw_feed.close(linger=0)
        replay.close(linger=0)
        ctx.term()

        # another salt hashes differently: the engine did not store those blocks
        other = BlockHasher(prefill.block_size_tokens).block_hashes(prompt, cache_salt=salt + "x")
        assert prefill.worker_id not in subscriber.index.match(other)

        # the scheduler expects the hit the engine then reports
        scheduler = Scheduler(
            CachedWorkerView(registry, refresh_interval_s=0.5, max_stale_s=5),
            create_policy("cache_aware"),
            ReservationTable(lease_s=60),
            subscriber=subscriber,
        )
        placement = await scheduler.schedule(
            ScheduleRequest(
                request_id="kv-index-check",
                model=prefill.model,
                num_prompt_tokens=len(prompt),
                max_tokens=4,
                prompt_token_ids=tuple(prompt),
                cache_salt=salt,
            )
        )
        scheduler.end_reservation("kv-index-check")
        assert placement.num_cached_tokens == 3 * block
        second = await _prefill(stack, placement.prefill.address, prompt, salt)
        assert second.num_cached_tokens == placement.num_cached_tokens
        assert subscriber.stats.num_decode_errors == 0
    finally:
        await subscriber.aclose()
        await registry.aclose()
