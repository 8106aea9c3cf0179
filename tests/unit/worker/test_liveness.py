"""EngineWatch: a dead engine at once; a stuck one when its probe goes unanswered for step_timeout_s
while there is work; an idle engine is not probed, and a slow but answering one is alive (a fake
engine whose probe the test answers, and a fake clock)."""

from __future__ import annotations

import asyncio

from tandem.worker.liveness import EngineWatch


class Engine:
    def __init__(self) -> None:
        self.dead = False
        self.num_probes = 0
        self.answer = asyncio.Event()

    def is_dead(self) -> bool:
        return self.dead

    async def probe(self) -> None:
        self.num_probes += 1
        await self.answer.wait()


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def _watch(engine: Engine, clock: Clock, busy: list[bool]) -> EngineWatch:
    return EngineWatch(engine, has_work=lambda: busy[0], step_timeout_s=10.0, probe_interval_s=1.0, clock=clock)


async def test_a_dead_engine_is_seen_at_the_first_check() -> None:
    engine, clock = Engine(), Clock()
    watch = _watch(engine, clock, [True])
    assert watch.check() == ""
    engine.dead = True
    assert watch.check() == "engine_dead"


async def test_a_probe_unanswered_past_the_timeout_while_busy_is_a_stuck_engine() -> None:
    engine, clock = Engine(), Clock()
    watch = _watch(engine, clock, [True])
    assert watch.check() == ""  # sends a probe
    await asyncio.sleep(0)
    assert engine.num_probes == 1
    clock.now_s += 9.9
    assert watch.check() == ""
    clock.now_s += 0.2
    assert watch.check() == "engine_stuck"


async def test_answered_probes_keep_a_slow_engine_alive_and_an_idle_engine_is_not_probed() -> None:
    engine, clock = Engine(), Clock()
    busy = [False]
    watch = _watch(engine, clock, busy)
    clock.now_s += 1000.0
    assert watch.check() == ""
    await asyncio.sleep(0)
    assert engine.num_probes == 0  # nothing waits on an idle engine
    busy[0] = True
    engine.answer.set()  # each probe answered, however long the steps take between them
    for _ in range(20):
        assert watch.check() == ""
        await asyncio.sleep(0)
        clock.now_s += 8.0
    assert engine.num_probes >= 10
    engine.answer.clear()  # now a step hangs
    assert watch.check() == ""
    await asyncio.sleep(0)
    clock.now_s += 10.5
    assert watch.check() == "engine_stuck"


async def test_wait_dead_returns_the_reason_within_a_poll() -> None:
    engine = Engine()
    watch = EngineWatch(engine, has_work=lambda: False, step_timeout_s=10.0, poll_s=0.01)
    waiter = asyncio.ensure_future(watch.wait_dead())
    await asyncio.sleep(0.05)
    assert not waiter.done()
    engine.dead = True
    assert await asyncio.wait_for(waiter, 1.0) == "engine_dead"
