"""Readiness against a real Redis worker registry and a real gRPC connection attempt."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from tandem.common.registry import WorkerRecord, WorkerRegistry
from tandem.gateway.readiness import GrpcConnectProbe, RouterAndWorkersReadiness
from tests.kit.clock import FakeClock

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]


class FlagProbe:
    def __init__(self) -> None:
        self.up = True
        self.num_calls = 0

    async def reachable(self) -> bool:
        self.num_calls += 1
        return self.up


@pytest_asyncio.fixture
async def registry() -> AsyncIterator[WorkerRegistry]:
    prefix = f"tandem-test-gateway-{secrets.token_hex(4)}"
    registry = WorkerRegistry("redis://127.0.0.1:6379/0", key_prefix=prefix, ttl_s=5.0)
    try:
        await registry.list_workers()
    except Exception as exc:  # pragma: no cover - environment without Redis
        await registry.aclose()
        pytest.skip(f"Redis not reachable: {exc}")
    yield registry
    for worker in await registry.list_workers():
        await registry.unregister(worker.worker_id)
    await registry.aclose()


def record(worker_id: str, role: str) -> WorkerRecord:
    return WorkerRecord(worker_id=worker_id, role=role, model="SmolLM2-135M-Instruct", address="127.0.0.1:1")


async def test_ready_needs_the_router_not_the_workers(registry: WorkerRegistry) -> None:
    """Pools may be at zero (scale from zero): the gateway stays ready, the counts say what is there."""
    probe, clock = FlagProbe(), FakeClock()
    readiness = RouterAndWorkersReadiness(probe, registry, cache_s=1.0, timeout_s=1.0, clock=clock)

    report = await readiness.check()
    assert report.ready and report.router_reachable
    assert (report.num_prefill_workers, report.num_decode_workers) == (0, 0)
    assert report.detail == "no prefill worker; no decode worker"

    await registry.heartbeat(record("prefill-a", "prefill"))
    await registry.heartbeat(record("decode-a", "decode"))
    assert (await readiness.check()).num_prefill_workers == 0  # cached for cache_s
    assert probe.num_calls == 1
    clock.now_s += 1.5
    report = await readiness.check()
    assert report.ready and (report.num_prefill_workers, report.num_decode_workers) == (1, 1)
    assert report.detail == ""

    await registry.unregister("decode-a")  # the decode pool went to zero
    clock.now_s += 1.5
    report = await readiness.check()
    assert report.ready and (report.num_prefill_workers, report.num_decode_workers) == (1, 0)
    assert report.detail == "no decode worker"

    probe.up = False
    clock.now_s += 1.5
    report = await readiness.check()
    assert not report.ready and report.detail == "router unreachable; no decode worker"


async def test_registry_down_is_not_ready() -> None:
    registry = WorkerRegistry("redis://127.0.0.1:1/0", key_prefix="x")
    try:
        readiness = RouterAndWorkersReadiness(FlagProbe(), registry, cache_s=0, timeout_s=1.0)
        report = await readiness.check()
        assert not report.ready
        assert report.detail.startswith("worker registry unreachable")
    finally:
        await registry.aclose()


async def test_concurrent_checks_share_one_probe(registry: WorkerRegistry) -> None:
    probe = FlagProbe()
    readiness = RouterAndWorkersReadiness(probe, registry, cache_s=5.0, timeout_s=1.0)
    await asyncio.gather(*(readiness.check() for _ in range(10)))
    assert probe.num_calls == 1


async def test_grpc_connect_probe(start_worker: Any, free_dead_address: str) -> None:
    worker = await start_worker("any")
    assert await GrpcConnectProbe(worker.address, timeout_s=1.0).reachable() is True
    assert await GrpcConnectProbe(free_dead_address, timeout_s=0.3).reachable() is False
