from __future__ import annotations

import asyncio

import pytest

from tandem.common.errors import BackendUnavailableError
from tandem.router.worker_view import CachedWorkerView
from tests.kit.clock import FakeClock
from tests.kit.workers import FakeRegistry, make_pool

pytestmark = pytest.mark.asyncio


def make_view(registry: FakeRegistry, clock: FakeClock) -> CachedWorkerView:
    return CachedWorkerView(registry, refresh_interval_s=0.5, max_stale_s=5.0, clock=clock)


async def test_reads_registry_at_most_once_per_interval() -> None:
    clock, registry = FakeClock(), FakeRegistry(make_pool(1, 1))
    view = make_view(registry, clock)
    for _ in range(10):
        assert len(await view.workers()) == 2
    assert registry.num_calls == 1
    registry.workers = make_pool(2, 1)
    clock.advance(0.6)
    assert len(await view.workers()) == 3
    assert registry.num_calls == 2


async def test_concurrent_callers_share_one_refresh() -> None:
    clock, registry = FakeClock(), FakeRegistry(make_pool(1, 1))
    view = make_view(registry, clock)
    results = await asyncio.gather(*(view.workers() for _ in range(20)))
    assert all(len(r) == 2 for r in results)
    assert registry.num_calls == 1


async def test_serves_stale_list_while_registry_is_down_then_fails() -> None:
    clock, registry = FakeClock(), FakeRegistry(make_pool(1, 1))
    view = make_view(registry, clock)
    await view.workers()
    registry.fail = True
    clock.advance(1.0)
    assert len(await view.workers()) == 2
    clock.advance(5.0)
    with pytest.raises(BackendUnavailableError):
        await view.workers()


async def test_fails_when_registry_is_down_from_the_start() -> None:
    registry = FakeRegistry()
    registry.fail = True
    with pytest.raises(BackendUnavailableError):
        await make_view(registry, FakeClock()).workers()
