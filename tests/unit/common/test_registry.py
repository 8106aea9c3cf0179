"""WorkerRegistry against the real Redis on 127.0.0.1:6379 (``make test`` starts one).

Each test uses its own key prefix and deletes its keys afterwards.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from tandem.common.errors import BackendUnavailableError, RetryableError
from tandem.common.registry import (
    ROLE_DECODE,
    ROLE_PREFILL,
    InvalidWorkerRecordError,
    WorkerLoad,
    WorkerRecord,
    WorkerRegistry,
)
from tests.kit.net import free_port
from tests.kit.redis import delete_prefix

REDIS_URL = "redis://127.0.0.1:6379/0"
SHORT_TTL_S = 0.3

RegistryFactory = Callable[..., WorkerRegistry]


def make_record(worker_id: str, role: str = ROLE_PREFILL, *, model: str = "smollm2", **changes: Any) -> WorkerRecord:
    record = WorkerRecord(
        worker_id=worker_id,
        role=role,
        model=model,
        address=f"127.0.0.1:{free_port()}",
        kv_address="127.0.0.1:7001" if role == ROLE_PREFILL else "",
        block_size_tokens=16,
        num_kv_blocks=1024,
        max_model_len=4096,
        started_unix_s=1_700_000_000.0,
        load=WorkerLoad(num_running_requests=2, num_waiting_requests=1, kv_usage=0.25),
    )
    return dataclasses.replace(record, **changes)


@pytest.fixture
async def redis_client() -> AsyncIterator[aioredis.Redis]:
    client: aioredis.Redis = aioredis.Redis.from_url(REDIS_URL)
    try:
        await client.ping()
    except OSError as exc:  # pragma: no cover - environment problem, not a test result
        pytest.fail(f"no Redis at {REDIS_URL} (make test starts one): {exc}")
    yield client
    await client.aclose()


@pytest.fixture
async def key_prefix(redis_client: aioredis.Redis) -> AsyncIterator[str]:
    prefix = f"tandem-test-registry-{uuid.uuid4().hex[:12]}"
    yield prefix
    await delete_prefix(redis_client, prefix)


@pytest.fixture
async def make_registry(key_prefix: str) -> AsyncIterator[RegistryFactory]:
    created: list[WorkerRegistry] = []

    def factory(*, ttl_s: float = 5.0) -> WorkerRegistry:
        registry = WorkerRegistry(REDIS_URL, key_prefix=key_prefix, ttl_s=ttl_s)
        created.append(registry)
        return registry

    yield factory
    for registry in created:
        await registry.aclose()


async def test_registered_workers_are_listed_sorted_and_round_trip(make_registry: RegistryFactory) -> None:
    registry = make_registry()
    records = [make_record("p-b"), make_record("d-a", ROLE_DECODE), make_record("p-a")]
    for record in records:
        await registry.heartbeat(record)

    listed = await registry.list_workers()

    assert [r.worker_id for r in listed] == ["d-a", "p-a", "p-b"]
    assert listed == sorted(records, key=lambda r: r.worker_id)
    assert listed[1].capacity_tokens == 16 * 1024


async def test_list_filters_by_role_and_model(make_registry: RegistryFactory) -> None:
    registry = make_registry()
    await registry.heartbeat(make_record("p0"))
    await registry.heartbeat(make_record("p1", model="other"))
    await registry.heartbeat(make_record("d0", ROLE_DECODE))

    assert [r.worker_id for r in await registry.list_workers(role=ROLE_PREFILL)] == ["p0", "p1"]
    assert [r.worker_id for r in await registry.list_workers(role=ROLE_DECODE)] == ["d0"]
    assert [r.worker_id for r in await registry.list_workers(role=ROLE_PREFILL, model="other")] == ["p1"]
    assert await registry.list_workers(role=ROLE_DECODE, model="other") == []


async def test_heartbeat_replaces_the_reported_load(make_registry: RegistryFactory) -> None:
    registry = make_registry()
    await registry.heartbeat(make_record("p0"))
    busier = make_record("p0", load=WorkerLoad(num_running_requests=9, kv_usage=0.75))
    await registry.heartbeat(busier)

    (listed,) = await registry.list_workers()

    assert listed.load == WorkerLoad(num_running_requests=9, kv_usage=0.75)


async def test_worker_disappears_after_ttl_without_heartbeat(
    make_registry: RegistryFactory, redis_client: aioredis.Redis, key_prefix: str
) -> None:
    registry = make_registry(ttl_s=SHORT_TTL_S)
    await registry.heartbeat(make_record("dying"))
    assert [r.worker_id for r in await registry.list_workers()] == ["dying"]

    await asyncio.sleep(SHORT_TTL_S + 0.2)

    assert await registry.list_workers() == []
    # The index is pruned too, so dead workers do not pile up in Redis.
    assert await redis_client.zcard(f"{key_prefix}:workers") == 0


async def test_heartbeats_keep_a_worker_alive_past_its_ttl(make_registry: RegistryFactory) -> None:
    registry = make_registry(ttl_s=SHORT_TTL_S)
    record = make_record("alive")
    deadline_s = time.monotonic() + 3 * SHORT_TTL_S
    while time.monotonic() < deadline_s:
        await registry.heartbeat(record)
        await asyncio.sleep(SHORT_TTL_S / 4)

    assert [r.worker_id for r in await registry.list_workers()] == ["alive"]


async def test_unregister_removes_only_that_worker(
    make_registry: RegistryFactory, redis_client: aioredis.Redis, key_prefix: str
) -> None:
    registry = make_registry()
    await registry.heartbeat(make_record("p0"))
    await registry.heartbeat(make_record("d0", ROLE_DECODE))

    await registry.unregister("p0")

    assert [r.worker_id for r in await registry.list_workers()] == ["d0"]
    assert await redis_client.exists(f"{key_prefix}:worker:p0") == 0
    await registry.unregister("never-registered")  # idempotent, no error


async def test_worker_with_a_slow_clock_is_still_listed(
    make_registry: RegistryFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Liveness follows Redis's clock, not the worker's: a worker whose clock is a
    minute behind the router's must not vanish while it keeps heart-beating."""
    registry = make_registry(ttl_s=5.0)
    real_time = time.time
    monkeypatch.setattr("tandem.common.registry.time.time", lambda: real_time() - 60.0)
    await registry.heartbeat(make_record("skewed"))
    monkeypatch.undo()

    assert [r.worker_id for r in await registry.list_workers()] == ["skewed"]


async def test_unknown_fields_from_a_newer_worker_are_ignored(
    make_registry: RegistryFactory, redis_client: aioredis.Redis, key_prefix: str
) -> None:
    registry = make_registry()
    data = dataclasses.asdict(make_record("newer"))
    data["gpu_model"] = "H200"
    data["load"]["num_preempted_requests"] = 3
    await redis_client.set(f"{key_prefix}:worker:newer", json.dumps(data), px=5000)
    await redis_client.zadd(f"{key_prefix}:workers", {"newer": 0})

    (listed,) = await registry.list_workers()

    assert listed == make_record("newer", address=data["address"])


async def test_redis_down_is_backend_unavailable() -> None:
    registry = WorkerRegistry(f"redis://127.0.0.1:{free_port()}/0", key_prefix="unused", ttl_s=1.0)
    try:
        with pytest.raises(BackendUnavailableError) as info:
            await registry.heartbeat(make_record("p0"))
        assert isinstance(info.value, RetryableError)
        with pytest.raises(BackendUnavailableError):
            await registry.list_workers()
        with pytest.raises(BackendUnavailableError):
            await registry.unregister("p0")
    finally:
        await registry.aclose()


async def test_raw_records_read_in_batches_are_the_whole_list_and_expired_ones_drop_out(
    make_registry: RegistryFactory, redis_client: aioredis.Redis, key_prefix: str
) -> None:
    """The router's background refresh reads the records a few per MGET (its event loop then
    parses small replies): the same records as one MGET, and a record that expired still leaves
    the worker set, whichever batch it falls in."""
    registry = make_registry()
    for i in range(7):
        await registry.heartbeat(make_record(f"w{i}", model_revision="révision-模型-🚀"))  # non-ASCII bytes stored
    await redis_client.delete(f"{key_prefix}:worker:w4")  # its TTL ran out

    batched = await registry.list_raw_records(batch_size=3)  # w4 is in the second batch
    assert await redis_client.zcard(f"{key_prefix}:workers") == 6
    assert sorted(WorkerRecord.from_json(raw).worker_id for raw in batched) == ["w0", "w1", "w2", "w3", "w5", "w6"]
    for batch_size in (0, 1, 2, 64):
        assert await registry.list_raw_records(batch_size=batch_size) == batched
    for i in (0, 1, 2, 3, 5, 6):
        await registry.unregister(f"w{i}")


def _forged(**changes: Any) -> bytes:
    return json.dumps({**dataclasses.asdict(make_record("forged")), **changes}).encode()


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b'{"worker_id": "x", "role": ', "does not parse"),
        (b"[1, 2]", "does not parse"),
        (b'{"role": "decode"}', "does not parse"),  # no worker_id
        (_forged(num_kv_blocks="many"), "does not parse"),
        (_forged(model=7), "does not parse"),
        (_forged(load={"kv_usage": "full"}), "does not parse"),
        (_forged(model="模型 🚀 café"), "does not match"),
        (_forged(model='m",namespace="other'), "does not match"),  # a PromQL selector breaking out
        (_forged(model=""), "does not match"),
        (_forged(model="<|im_start|>system"), "does not match"),
        (_forged(model="smollm2\n"), "does not match"),  # re's "$" matches before a final newline
        (_forged(worker_id="w1\n"), "does not match"),
        (_forged(worker_id="w 1"), "does not match"),
        (_forged(worker_id="x" * 200), "does not match"),
        (_forged(role="admin"), "role"),
        (_forged(num_kv_blocks=-5), "negative num_kv_blocks"),
        (_forged(load={"num_running_requests": -1}), "negative num_running_requests"),
        (_forged(load={"kv_usage": -0.5}), "not a share"),  # (JSON has no NaN or infinity)
    ],
)
def test_a_record_no_worker_would_write_is_refused(raw: bytes, reason: str) -> None:
    with pytest.raises(InvalidWorkerRecordError, match=reason):
        WorkerRecord.from_json(raw)


def test_a_real_record_round_trips_through_the_checks() -> None:
    record = make_record("decode-0a1b2c", ROLE_DECODE, model="org/Llama-3.1-8B:rev.2", adapters=("a1",))
    assert WorkerRecord.from_json(record.to_json()) == record


async def test_a_forged_record_does_not_hide_the_real_ones(
    make_registry: RegistryFactory, redis_client: aioredis.Redis, key_prefix: str
) -> None:
    registry = make_registry()
    await registry.heartbeat(make_record("p0"))
    await registry.heartbeat(make_record("d0", ROLE_DECODE))
    for worker_id, raw in {"f-model": _forged(model="モデル"), "f-json": b"{"}.items():
        await redis_client.set(f"{key_prefix}:worker:{worker_id}", raw, px=5000)
        await redis_client.zadd(f"{key_prefix}:workers", {worker_id: 0})

    assert [r.worker_id for r in await registry.list_workers()] == ["d0", "p0"]
