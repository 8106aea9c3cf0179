"""The worker's LoRA adapter residency (tandem.worker.adapters) over a fake engine and a catalog held
in a dict: loads on demand, LRU eviction of idle adapters only, in-use protection with a bounded
wait, retiring removed and superseded versions once their requests end, garbage catalog entries,
an unreachable catalog, failed and aborted loads. The real engine's side is
tests/integration/test_adapters_real.py (test_the_workers_keep_adapters_apart_over_grpc)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import grpc
import pytest

from tandem.common.adapters import AdapterEntry
from tandem.common.errors import BackendUnavailableError
from tandem.worker.adapters import AdapterRefused, AdapterResidency

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]

MODEL = "SmolLM2-135M-Instruct"


class FakeCatalog:
    def __init__(self) -> None:
        self.entries: dict[str, AdapterEntry] = {}
        self.version = 0
        self.down = False
        self.num_reads = 0

    def put(self, name: str, *, base_model: str = MODEL, path: str = "") -> AdapterEntry:
        self.version += 1
        entry = AdapterEntry(name, base_model, path or f"/adapters/{name}-v{self.version}", self.version)
        self.entries[name] = entry
        return entry

    async def read(self) -> Mapping[str, AdapterEntry]:
        self.num_reads += 1
        if self.down:
            raise BackendUnavailableError("redis down (SIMULATED)")
        return dict(self.entries)


class FakeEngine:
    """Records add/remove; a load can be made slow (an event to wait for) or to fail."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.loaded: set[str] = set()
        self.gate: asyncio.Event | None = None
        self.bad: set[str] = set()

    async def add_adapter(self, entry: AdapterEntry) -> None:
        self.calls.append(("add", entry.engine_name))
        if self.gate is not None:
            await self.gate.wait()
        if entry.engine_name in self.bad:
            raise ValueError(f"no adapter_config.json in {entry.path} (SIMULATED)")
        self.loaded.add(entry.engine_name)

    async def remove_adapter(self, entry: AdapterEntry) -> None:
        self.calls.append(("remove", entry.engine_name))
        self.loaded.discard(entry.engine_name)


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def _residency(
    catalog: FakeCatalog, engine: FakeEngine, *, max_adapters: int = 2, slot_wait_s: float = 0.2, **kw: object
) -> AdapterResidency:
    return AdapterResidency(
        engine,
        catalog.read,
        model=MODEL,
        max_adapters=max_adapters,
        slot_wait_s=slot_wait_s,
        **kw,  # type: ignore[arg-type]
    )


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_loads_on_demand_once_and_keeps_lru_order() -> None:
    catalog, engine = FakeCatalog(), FakeEngine()
    a, b = catalog.put("a"), catalog.put("b")
    res = _residency(catalog, engine)
    async with res.use(a.engine_name) as got:
        assert got == a
        assert res.in_use(a.engine_name) == 1
    async with res.use(b.engine_name):
        pass
    async with res.use(a.engine_name):
        pass
    assert engine.calls == [("add", a.engine_name), ("add", b.engine_name)]  # a's second use loads nothing
    assert res.loaded() == (b.engine_name, a.engine_name)  # least recently used first
    assert res.in_use(a.engine_name) == 0


async def test_a_full_engine_evicts_the_least_recently_used_idle_adapter() -> None:
    catalog, engine = FakeCatalog(), FakeEngine()
    a, b, c = catalog.put("a"), catalog.put("b"), catalog.put("c")
    res = _residency(catalog, engine)
    async with res.use(a.engine_name):
        async with res.use(b.engine_name):
            pass
        # a runs a request, b is idle: c takes b's slot although a was loaded first.
        async with res.use(c.engine_name):
            assert set(res.loaded()) == {a.engine_name, c.engine_name}
    assert engine.calls[-2:] == [("remove", b.engine_name), ("add", c.engine_name)]
    assert engine.loaded == {a.engine_name, c.engine_name}
    assert res.num_evictions == 1


async def test_every_slot_busy_waits_then_is_refused() -> None:
    catalog, engine = FakeCatalog(), FakeEngine()
    a, b, c = catalog.put("a"), catalog.put("b"), catalog.put("c")
    res = _residency(catalog, engine, slot_wait_s=0.2)
    async with res.use(a.engine_name), res.use(b.engine_name):
        with pytest.raises(AdapterRefused) as refused:
            async with res.use(c.engine_name):
                pass
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert c.engine_name not in engine.loaded
    assert res.in_use(a.engine_name) == res.in_use(b.engine_name) == 0


async def test_a_waiting_request_takes_the_slot_that_frees() -> None:
    catalog, engine = FakeCatalog(), FakeEngine()
    a, b = catalog.put("a"), catalog.put("b")
    res = _residency(catalog, engine, max_adapters=1, slot_wait_s=5.0)
    release = asyncio.Event()

    async def hold_a() -> None:
        async with res.use(a.engine_name):
            await release.wait()

    holder = asyncio.create_task(hold_a())
    await _settle()
    waiter = asyncio.create_task(res.use(b.engine_name).__aenter__())
    await asyncio.sleep(0.05)
    assert not waiter.done()  # a's request still runs
    release.set()
    assert await asyncio.wait_for(waiter, 2) == b
    await holder
    assert res.loaded() == (b.engine_name,)
    assert engine.calls == [("add", a.engine_name), ("remove", a.engine_name), ("add", b.engine_name)]


async def test_concurrent_requests_share_one_load() -> None:
    catalog, engine = FakeCatalog(), FakeEngine()
    a = catalog.put("a")
    engine.gate = asyncio.Event()
    res = _residency(catalog, engine)
    entered = asyncio.Event()

    async def run() -> None:
        async with res.use(a.engine_name):
            entered.set()
            await asyncio.sleep(0.01)

    tasks = [asyncio.create_task(run()) for _ in range(3)]
    await _settle()
    assert engine.calls == [("add", a.engine_name)]
    engine.gate.set()
    await asyncio.gather(*tasks)
    assert engine.calls == [("add", a.engine_name)]
    assert res.in_use(a.engine_name) == 0


async def test_a_superseded_version_serves_its_running_request_then_is_removed() -> None:
    catalog, engine = FakeCatalog(), FakeEngine()
    old = catalog.put("a")
    res = _residency(catalog, engine)
    async with res.use(old.engine_name):
        new = catalog.put("a")  # reloaded: a new version
        await res.refresh()
        assert old.engine_name in res.loaded()  # its request still runs
        with pytest.raises(AdapterRefused) as refused:
            async with res.use(old.engine_name):
                pass
        assert refused.value.code == grpc.StatusCode.NOT_FOUND
        assert f"current version is {new.version}" in refused.value.message
    await _settle()
    assert ("remove", old.engine_name) in engine.calls
    assert old.engine_name not in engine.loaded and res.loaded() == ()
    async with res.use(new.engine_name):
        assert res.loaded() == (new.engine_name,)


async def test_an_unloaded_adapter_is_removed_and_refused() -> None:
    catalog, engine = FakeCatalog(), FakeEngine()
    a = catalog.put("a")
    res = _residency(catalog, engine)
    async with res.use(a.engine_name):
        pass
    del catalog.entries["a"]
    await res.refresh()
    await _settle()
    assert engine.calls[-1] == ("remove", a.engine_name) and res.loaded() == ()
    with pytest.raises(AdapterRefused) as refused:
        async with res.use(a.engine_name):
            pass
    assert refused.value.code == grpc.StatusCode.NOT_FOUND
    assert "/adapters" not in refused.value.message  # no path in a client's error


async def test_a_request_ahead_of_the_workers_catalog_reads_it_again() -> None:
    catalog, engine = FakeCatalog(), FakeEngine()
    catalog.put("a")
    res = _residency(catalog, engine)
    await res.refresh()
    newer = catalog.put("a")  # the gateway saw this before the worker's next refresh
    async with res.use(newer.engine_name) as got:
        assert got == newer


async def test_another_models_adapter_and_garbage_entries_are_refused() -> None:
    catalog, engine = FakeCatalog(), FakeEngine()
    other = catalog.put("other", base_model="Qwen3-0.6B")
    catalog.entries["nopath"] = AdapterEntry("nopath", MODEL, "", 7)
    catalog.entries["zero"] = AdapterEntry("zero", MODEL, "/x", 0)
    catalog.entries["liar"] = AdapterEntry("somebody-else", MODEL, "/x", 8)
    catalog.entries["bad name"] = AdapterEntry("bad name", MODEL, "/x", 9)
    res = _residency(catalog, engine)
    with pytest.raises(AdapterRefused) as refused:
        async with res.use(other.engine_name):
            pass
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    for engine_name in ("nopath@7", "zero@0", "liar@8", "somebody-else@8"):
        with pytest.raises(AdapterRefused) as refused:
            async with res.use(engine_name):
                pass
        assert refused.value.code == grpc.StatusCode.NOT_FOUND, engine_name
    for garbage in ("no-version", "a@", "@3", "a@-1", "<|im_start|>@1", "😀@2"):
        with pytest.raises(AdapterRefused) as refused:
            async with res.use(garbage):
                pass
        assert refused.value.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), garbage
    assert engine.calls == []


async def test_a_load_that_fails_is_not_marked_loaded_and_frees_its_slot() -> None:
    catalog, engine = FakeCatalog(), FakeEngine()
    bad, good = catalog.put("bad"), catalog.put("good")
    engine.bad.add(bad.engine_name)
    res = _residency(catalog, engine, max_adapters=1)
    with pytest.raises(AdapterRefused) as refused:
        async with res.use(bad.engine_name):
            pass
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "failed to load" in refused.value.message and "SIMULATED" not in refused.value.message
    assert res.loaded() == ()
    # Remembered for a while: the next request is refused without another load.
    with pytest.raises(AdapterRefused):
        async with res.use(bad.engine_name):
            pass
    assert engine.calls.count(("add", bad.engine_name)) == 1
    async with res.use(good.engine_name):
        assert res.loaded() == (good.engine_name,)


async def test_a_request_aborted_mid_load_leaves_the_adapter_loaded_and_idle() -> None:
    catalog, engine = FakeCatalog(), FakeEngine()
    a = catalog.put("a")
    engine.gate = asyncio.Event()
    res = _residency(catalog, engine, max_adapters=1)

    async def run() -> None:
        async with res.use(a.engine_name):
            await asyncio.sleep(10)

    task = asyncio.create_task(run())
    await _settle()
    task.cancel()  # the caller went away while add_lora runs
    with pytest.raises(asyncio.CancelledError):
        await task
    engine.gate.set()
    await _settle()
    assert res.loaded() == (a.engine_name,) and res.in_use(a.engine_name) == 0
    assert engine.loaded == {a.engine_name}
    # Idle, so its slot is free for another adapter.
    b = catalog.put("b")
    async with res.use(b.engine_name):
        assert res.loaded() == (b.engine_name,)


async def test_an_unreachable_catalog_serves_the_last_read_then_refuses() -> None:
    catalog, engine, clock = FakeCatalog(), FakeEngine(), Clock()
    a = catalog.put("a")
    res = _residency(catalog, engine, clock=clock, catalog_max_age_s=1.0, catalog_stale_s=30.0)
    async with res.use(a.engine_name):
        pass
    catalog.down = True
    del catalog.entries["a"]  # unseen: Redis does not answer
    clock.now_s += 10
    async with res.use(a.engine_name):
        pass
    assert res.loaded() == (a.engine_name,)  # an outage retires nothing
    clock.now_s += 30
    with pytest.raises(AdapterRefused) as refused:
        async with res.use(a.engine_name):
            pass
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE
    catalog.down = False
    await res.refresh()
    await _settle()
    assert res.loaded() == ()  # back: the unload is seen


async def test_the_catalog_is_read_at_most_once_per_max_age() -> None:
    catalog, engine, clock = FakeCatalog(), FakeEngine(), Clock()
    a = catalog.put("a")
    res = _residency(catalog, engine, clock=clock, catalog_max_age_s=1.0)
    for _ in range(5):
        async with res.use(a.engine_name):
            pass
    assert catalog.num_reads == 1
    clock.now_s += 1.5
    async with res.use(a.engine_name):
        pass
    assert catalog.num_reads == 2
