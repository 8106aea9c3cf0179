"""EngineWatch: a dead engine at once, a stuck one after step_timeout_s of work without a step, an idle
one never (a fake engine and a fake clock)."""

from __future__ import annotations

import asyncio

from tandem.worker.liveness import EngineWatch


class Engine:
    def __init__(self) -> None:
        self.dead = False
        self.steps = 0

    def is_dead(self) -> bool:
        return self.dead

    def num_steps(self) -> int:
        return self.steps


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def _watch(engine: Engine, clock: Clock, busy: list[bool]) -> EngineWatch:
    return EngineWatch(engine, has_work=lambda: busy[0], step_timeout_s=10.0, clock=clock)


def test_a_dead_engine_is_seen_at_the_first_check() -> None:
    engine, clock = Engine(), Clock()
    watch = _watch(engine, clock, [True])
    assert watch.check() == ""
    engine.dead = True
    assert watch.check() == "engine_dead"


def test_work_without_a_step_for_longer_than_the_timeout_is_a_stuck_engine() -> None:
    engine, clock = Engine(), Clock()
    watch = _watch(engine, clock, [True])
    assert watch.check() == ""
    clock.now_s += 9.9
    assert watch.check() == ""
    clock.now_s += 0.2
    assert watch.check() == "engine_stuck"


def test_steps_keep_a_busy_engine_alive_and_an_idle_engine_is_never_stuck() -> None:
    engine, clock = Engine(), Clock()
    busy = [True]
    watch = _watch(engine, clock, busy)
    for _ in range(5):  # 40 s of work, a step every 8 s
        clock.now_s += 8.0
        engine.steps += 1
        assert watch.check() == ""
    busy[0] = False
    clock.now_s += 1000.0  # idle: no steps, and nothing waits for one
    assert watch.check() == ""
    busy[0] = True  # new work: the clock starts now, not at the last step
    clock.now_s += 5.0
    assert watch.check() == ""
    clock.now_s += 6.0
    assert watch.check() == "engine_stuck"


async def test_wait_dead_returns_the_reason_within_a_poll() -> None:
    engine = Engine()
    watch = EngineWatch(engine, has_work=lambda: False, step_timeout_s=10.0, poll_s=0.01)
    waiter = asyncio.ensure_future(watch.wait_dead())
    await asyncio.sleep(0.05)
    assert not waiter.done()
    engine.dead = True
    assert await asyncio.wait_for(waiter, 1.0) == "engine_dead"
