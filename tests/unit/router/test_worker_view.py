from __future__ import annotations

import asyncio
import json
import time

import pytest

from tandem.common.errors import BackendUnavailableError
from tandem.common.registry import WorkerRecord, WorkerRegistry
from tandem.router.worker_view import CachedWorkerView
from tests.kit.clock import FakeClock
from tests.kit.redis import acl_users
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


class RawRegistry(FakeRegistry):
    """A registry that offers its records as stored (JSON), as WorkerRegistry does."""

    async def list_raw_records(self, *, batch_size: int = 0) -> list[bytes]:
        self.num_calls += 1
        if self.fail:
            raise BackendUnavailableError("redis down")
        await asyncio.sleep(0.01)  # a Redis round trip
        return [w.to_json().encode() for w in self.workers]


async def test_in_the_background_no_caller_waits_for_a_refresh_and_unchanged_records_are_kept() -> None:
    clock, registry = FakeClock(), RawRegistry(make_pool(2, 1))
    view = CachedWorkerView(registry, refresh_interval_s=0.5, max_stale_s=5.0, clock=clock, refresh_in_background=True)
    first = await view.workers()  # the first call waits: there is nothing to serve yet
    assert len(first) == 3 and registry.num_calls == 1
    registry.workers = make_pool(3, 1)
    clock.advance(0.6)
    assert await view.workers() is first  # stale: served at once, a refresh starts
    await asyncio.sleep(0.05)
    refreshed = await view.workers()
    assert len(refreshed) == 4 and registry.num_calls == 2
    clock.advance(0.6)
    await view.workers()
    await asyncio.sleep(0.05)
    again = await view.workers()
    assert again is not refreshed and registry.num_calls == 3
    # the same JSON: the same record objects, not parsed again
    assert all(a is b for a, b in zip(again, refreshed, strict=True))
    registry.fail = True
    clock.advance(1.0)
    assert await view.workers() is again  # the registry is down: the last list, for up to max_stale_s
    await asyncio.sleep(0.05)
    clock.advance(5.0)
    with pytest.raises(BackendUnavailableError):
        await view.workers()


async def test_a_forced_read_sees_workers_registered_since_and_a_key_still_unknown_is_not_read_again() -> None:
    clock, registry = FakeClock(), RawRegistry(make_pool(2, 1))
    view = CachedWorkerView(registry, refresh_interval_s=0.5, max_stale_s=5.0, clock=clock, refresh_in_background=True)
    cached = await view.workers()
    registry.workers = [*make_pool(2, 1), *make_pool(1, 1, model="m2")]
    assert await view.workers() is cached  # fresh enough: no read
    now = await view.workers_now("m2")
    assert {w.model for w in now} == {"m", "m2"} and registry.num_calls == 2
    assert await view.workers() is now  # the read is the cached list from then on
    # A model nobody serves: one read, then the cache for the refresh interval.
    clock.advance(0.1)
    await view.workers_now("nope")
    view.still_unknown("nope")
    assert registry.num_calls == 3
    for _ in range(5):
        await view.workers_now("nope")
    assert registry.num_calls == 3
    clock.advance(0.6)
    await view.workers_now("nope")
    assert registry.num_calls == 4


async def test_callers_that_arrived_before_a_forced_read_began_share_it() -> None:
    clock, registry = FakeClock(), RawRegistry(make_pool(1, 1))
    view = CachedWorkerView(registry, refresh_interval_s=0.5, max_stale_s=5.0, clock=clock, refresh_in_background=True)
    await view.workers()
    clock.advance(1.0)
    results = await asyncio.gather(*(view.workers_now(f"k{i}") for i in range(10)))
    assert all(r is results[0] for r in results)
    assert registry.num_calls == 2


@pytest.mark.parametrize("removal_check_interval_s", [0.05, 0.0])
async def test_a_worker_that_unregisters_leaves_the_view_within_the_removal_check(
    removal_check_interval_s: float,
) -> None:
    """The real registry on the real Redis, each side under its own ACL user: the worker's unregister
    counts itself, and the router's view, reading that counter every 50 ms, drops the worker long
    before its next full read (60 s here). Off (0), the view keeps the worker until that read. (The
    bound is loose: on a quiet host the drop takes ~50-100 ms; a loaded one delays the event loop.)"""
    async with acl_users(label="removals") as users:
        worker_side = WorkerRegistry(users.url("worker"), key_prefix=users.key_prefix, ttl_s=30)
        router_side = WorkerRegistry(users.url("router"), key_prefix=users.key_prefix, ttl_s=30)
        try:
            for record in make_pool(1, 2):
                await worker_side.heartbeat(record)
            view = CachedWorkerView(
                router_side,
                refresh_interval_s=60.0,
                max_stale_s=30.0,
                refresh_in_background=True,
                removal_check_interval_s=removal_check_interval_s,
            )
            assert {w.worker_id for w in await view.workers()} == {"p0", "d0", "d1"}
            await asyncio.sleep(0.1)  # the first look at the counter: the baseline
            await view.workers()
            removed_at = time.monotonic()
            await worker_side.unregister("d1")
            gone_after_s = None
            while time.monotonic() - removed_at < 3.0:
                if "d1" not in {w.worker_id for w in await view.workers()}:
                    gone_after_s = time.monotonic() - removed_at
                    break
                await asyncio.sleep(0.01)
            if removal_check_interval_s:
                assert gone_after_s is not None and gone_after_s < 2.0, gone_after_s
                assert {w.worker_id for w in await view.workers()} == {"p0", "d0"}
            else:
                assert gone_after_s is None  # only the full read (60 s) would have dropped it
            assert await router_side.removals() == 1
        finally:
            await worker_side.aclose()
            await router_side.aclose()


class ForgedRegistry(RawRegistry):
    """The registry's real records plus ones an insider with the workers' Redis user wrote."""

    def __init__(self, workers: list[WorkerRecord], forged: list[bytes]) -> None:
        super().__init__(workers)
        self.forged = forged

    async def list_raw_records(self, *, batch_size: int = 0) -> list[bytes]:
        return [*self.forged, *await super().list_raw_records(batch_size=batch_size)]


async def test_a_forged_record_is_skipped_and_the_real_ones_are_served() -> None:
    """One bad record used to fail the whole refresh (the old list served for good), and a non-ASCII model
    reached the router's Ray metric tags (every Schedule failed). Now each is skipped and counted."""
    real = make_pool(2, 1)
    template = json.loads(real[0].to_json())
    forged = [
        json.dumps({**template, "worker_id": "forged-model", "model": "模型 🚀 café"}).encode(),
        b'{"worker_id": "forged-json", "role": ',
        json.dumps({**template, "worker_id": "forged-type", "num_kv_blocks": "many"}).encode(),
        json.dumps({**template, "worker_id": "forged-role", "role": "admin"}).encode(),
    ]
    clock, registry = FakeClock(), ForgedRegistry(real, forged)
    view = CachedWorkerView(registry, refresh_interval_s=0.5, max_stale_s=5.0, clock=clock, refresh_in_background=True)
    assert len(await view.workers()) == 3  # the first read (the fake's parsed list) waits for the registry
    registry.workers = make_pool(3, 1)  # a worker joins; the background refresh reads the records as stored
    clock.advance(0.6)
    await view.workers()
    await asyncio.sleep(0.05)
    listed = await view.workers()
    assert [w.worker_id for w in listed] == sorted(w.worker_id for w in registry.workers)
    assert view.num_rejected == len(forged)
