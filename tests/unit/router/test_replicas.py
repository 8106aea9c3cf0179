"""Active-active replicas: Schedulers sharing one view through their ledgers over the real Redis
(127.0.0.1:6379, a private key prefix): reservations within milliseconds, a dead replica forgotten,
forwarded Releases, repair after a lost message, and the fair-share order across replicas."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable

import pytest
import pytest_asyncio
import redis.asyncio as aioredis

from tandem.common.errors import NoCapacityError
from tandem.common.registry import WorkerRecord
from tandem.router.ledger import Ledger
from tandem.router.policy import ScheduleRequest
from tandem.router.reservations import ReservationTable
from tandem.router.scheduler import PlacementDecision, Scheduler
from tests.kit.redis import delete_prefix
from tests.kit.router import LEDGER_SECRET, make_replica

REDIS_URL = "redis://127.0.0.1:6379/0"
SNAPSHOT_S = 0.05
TTL_S = 1.0


def req(request_id: str, tokens: int = 60, tenant: str = "t") -> ScheduleRequest:
    return ScheduleRequest(request_id=request_id, model="m", num_prompt_tokens=tokens, max_tokens=4, tenant=tenant)


async def until(condition: Callable[[], bool], timeout_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.005)


async def test_build_replica_hands_each_settings_group_to_its_part() -> None:
    """The one assembly (the deployment's, the benchmarks', the tests'): each group of RouterConfig
    reaches the part it configures, with nothing copied on the way."""
    replica = make_replica(
        lease_s=42,
        policy="least_loaded",
        budget={"prefill_tokens_in_flight": 100},
        queue={"timeout_s": 0.05, "poll_interval_s": 0.01},
        # Bursts off reach the placer too: "over" waits for prefill budget instead of running on d0 alone.
        disaggregation={"min_uncached_tokens": 50, "burst_local_prefill": False},
    )
    scheduler = replica.scheduler
    assert replica.ledger is None and replica.subscriber is None and scheduler.index is replica.index
    short = await scheduler.schedule(req("short", 40))  # 40 uncached tokens < 50: the decode worker prefills
    assert short.local_prefill and short.lease_s == 42 and short.reason.startswith("least_loaded local_prefill")
    long = await scheduler.schedule(req("long", 60))  # through p0: 60 of its 100 tokens
    assert long.prefill is not None and long.prefill.worker_id == "p0"
    started = time.monotonic()
    with pytest.raises(NoCapacityError):  # 60 more would be 120 > 100: refused after the queue's 0.05 s
        await scheduler.schedule(req("over", 60))
    assert 0.05 <= time.monotonic() - started < 1.0


@pytest_asyncio.fixture
async def replicas() -> AsyncIterator[Callable[..., tuple[Scheduler, Ledger]]]:
    key_prefix = f"tandem-test-replicas-{uuid.uuid4().hex[:8]}"
    made: list[Ledger] = []

    def make(
        name: str,
        *,
        workers: list[WorkerRecord] | None = None,
        prefill_budget: int = 100,
        timeout_s: float = 0.3,
        handoff_timeout_s: float = 2.0,
    ) -> tuple[Scheduler, Ledger]:
        replica = make_replica(
            workers,
            replica_id=name,
            redis={"url": REDIS_URL},
            # young_s = 2 x heartbeat + 1 = 5 s: a reservation counts as young through every test
            registry={"key_prefix": key_prefix, "heartbeat_interval_s": 2.0},
            lease_s=60,
            replica_sync_interval_s=SNAPSHOT_S,
            ledger={"replica_ttl_s": TTL_S},
            budget={"prefill_tokens_in_flight": prefill_budget},
            queue={"timeout_s": timeout_s, "poll_interval_s": 0.02, "handoff_timeout_s": handoff_timeout_s},
        )
        scheduler, ledger = replica.scheduler, replica.ledger
        assert ledger is not None
        ledger.start()
        made.append(ledger)
        return scheduler, ledger

    yield make
    for ledger in made:
        await ledger.aclose()
    client = aioredis.Redis.from_url(REDIS_URL)
    await delete_prefix(client, key_prefix)
    await client.aclose()


async def test_a_reservation_counts_in_the_other_replica_within_milliseconds(replicas) -> None:  # type: ignore[no-untyped-def]
    a, ledger_a = replicas("a")
    b, ledger_b = replicas("b")
    await until(lambda: ledger_a.num_live_replicas == 2 and ledger_b.num_live_replicas == 2)
    started = time.monotonic()
    await a.schedule(req("r1", 60))
    await until(lambda: ledger_b.others_tokens("p0") == 60)
    # well inside one snapshot round: the change itself travelled, not a periodic copy
    assert time.monotonic() - started < 0.5
    assert ledger_b.others_in_flight("p0") == 1 and ledger_b.others_young_tokens("p0") == 60
    # 60 held by A + 60 would exceed the 100-token budget: B queues, then gives up.
    with pytest.raises(NoCapacityError):
        await b.schedule(req("r2", 60))
    a.end_reservation("r1")
    await until(lambda: ledger_b.others_tokens("p0") == 0)
    assert (await b.schedule(req("r2", 60))).prefill is not None


async def test_a_dead_replicas_requests_keep_counting_until_their_release_reaches_a_survivor(replicas) -> None:  # type: ignore[no-untyped-def]
    """A replica that dies does not take its requests with it (their gateways stream on): the
    survivors adopt its reservations, and the Release that Serve now routes to a survivor frees them."""
    a, ledger_a = replicas("a")
    b, ledger_b = replicas("b")
    await until(lambda: ledger_b.num_live_replicas == 2)
    await a.schedule(req("r1", 60))
    await until(lambda: ledger_b.others_tokens("p0") == 60)
    await ledger_a.aclose()  # A dies without a word: its liveness key expires
    await until(lambda: ledger_b.num_live_replicas == 1, timeout_s=TTL_S + 2)
    assert ledger_b.stats.num_replicas_forgotten == 1
    assert ledger_b.others_tokens("p0") == 60  # r1 still runs on p0
    with pytest.raises(NoCapacityError):
        await b.schedule(req("r2", 60))
    assert await b.end_reservation_anywhere("r1") is True  # its Release reaches B now
    assert ledger_b.others_tokens("p0") == 0
    placement = await b.schedule(req("r2", 60))
    assert placement.prefill is not None and placement.prefill.worker_id == "p0"


async def test_the_work_a_dead_replica_placed_keeps_counting_after_its_requests_end(replicas) -> None:  # type: ignore[no-untyped-def]
    """Its requests ran on the workers all the same: the survivors' recent-work view keeps them (a
    survivor that forgot them at once would see p0 as idle as a worker nobody used)."""
    a, ledger_a = replicas("a")
    b, ledger_b = replicas("b")
    await until(lambda: ledger_b.num_live_replicas == 2)
    await a.schedule(req("r1", 60))
    await until(lambda: ledger_b.others_tokens("p0") == 60)
    await ledger_a.aclose()
    await until(lambda: ledger_b.num_live_replicas == 1, timeout_s=TTL_S + 2)
    assert await b.end_reservation_anywhere("r1") is True
    await asyncio.sleep(3 * SNAPSHOT_S)  # a few ticks, where an empty dead mirror used to be dropped
    assert ledger_b.others_tokens("p0") == 0
    recent, _ = ledger_b.others_recent_tokens_at("p0")
    assert 55 < recent <= 60


async def test_a_release_forwarded_to_a_replica_that_dies_before_acting_on_it_still_frees_the_budget(replicas) -> None:  # type: ignore[no-untyped-def]
    a, ledger_a = replicas("a")
    b, ledger_b = replicas("b")
    _, ledger_c = replicas("c")
    await until(lambda: all(ledger.num_live_replicas == 3 for ledger in (ledger_a, ledger_b, ledger_c)))
    await a.schedule(req("r1", 60))
    await until(lambda: ledger_b.others_tokens("p0") == 60 and ledger_c.others_tokens("p0") == 60)
    await ledger_a.aclose()  # A is gone, but nobody knows yet
    assert await b.end_reservation_anywhere("r1") is True  # forwarded to A, which will never act on it
    await until(lambda: ledger_c.num_live_replicas == 2 and ledger_b.num_live_replicas == 2, timeout_s=TTL_S + 2)
    assert ledger_b.others_tokens("p0") == 0 and ledger_c.others_tokens("p0") == 0


async def test_a_release_reaching_another_replica_is_forwarded_to_the_owner(replicas) -> None:  # type: ignore[no-untyped-def]
    a, _ = replicas("a")
    b, ledger_b = replicas("b")
    await until(lambda: ledger_b.num_live_replicas == 2)
    await a.schedule(req("r1", 60))
    await until(lambda: ledger_b.others_tokens("p0") == 60)
    assert await b.end_reservation_anywhere("r1") is True  # B does not hold it: forwarded to A
    await until(lambda: a.reservations.num_in_flight("p0") == 0)
    await until(lambda: ledger_b.others_tokens("p0") == 0)
    assert await b.end_reservation_anywhere("never-scheduled") is False


async def test_a_retry_on_another_replica_releases_the_first_placement(replicas) -> None:  # type: ignore[no-untyped-def]
    """The gateway retries a Schedule elsewhere (its replica was moved or restarting): the new
    replica places it afresh and the old reservation does not linger until its lease ends."""
    a, _ = replicas("a")
    b, ledger_b = replicas("b")
    await until(lambda: ledger_b.num_live_replicas == 2)
    await a.schedule(req("r1", 30))
    await until(lambda: ledger_b.others_tokens("p0") == 30)
    placement = await b.schedule(req("r1", 30))  # same request id, placed again by B
    assert placement.request_id == "r1" and b.reservations.num_in_flight("p0") == 1
    await until(lambda: a.reservations.num_in_flight("p0") == 0)


async def test_a_lost_message_is_repaired_from_the_snapshot(replicas) -> None:  # type: ignore[no-untyped-def]
    a, _ = replicas("a")
    _, ledger_b = replicas("b")
    await until(lambda: ledger_b.num_live_replicas == 2)
    await a.schedule(req("r1", 40))
    await until(lambda: ledger_b.others_tokens("p0") == 40)
    # A message of A's that B never gets: A reserves r2 while B is deaf to it.
    receive = ledger_b.receive
    ledger_b.receive = lambda payload: None  # type: ignore[method-assign]
    await a.schedule(req("r2", 20))
    await asyncio.sleep(0.05)
    ledger_b.receive = receive  # type: ignore[method-assign]
    a.end_reservation("r1")  # the next message B hears shows a gap in A's seqs
    await until(lambda: ledger_b.others_tokens("p0") == 20, timeout_s=2)
    assert ledger_b.stats.num_gaps + ledger_b.stats.num_snapshots_applied >= 2


async def test_a_mirror_rebuilt_from_a_snapshot_keeps_the_work_placed_lately(replicas) -> None:  # type: ignore[no-untyped-def]
    """The snapshot carries each worker's recent tokens, released reservations included: a replica
    that joins late, and one that repairs a gap, score the workers as a replica that heard every
    message does (before, a rebuilt mirror knew only what was in flight, and the fleet benchmark's
    replicas parted from the oracle's decode choices for the rest of the half-life)."""
    a, _ = replicas("a")
    _, ledger_b = replicas("b")
    await until(lambda: ledger_b.num_live_replicas == 2)
    await a.schedule(req("r1", 60))
    a.end_reservation("r1")
    await until(lambda: ledger_b.others_tokens("p0") == 0 and ledger_b.others_recent_tokens_at("p0")[0] > 55)
    # C never heard r1: it learns A's recent work from A's snapshot.
    _, ledger_c = replicas("c")
    await until(lambda: ledger_c.others_recent_tokens_at("p0")[0] > 55)
    assert ledger_c.others_recent_tokens_at("p0")[0] <= 60 and ledger_c.others_tokens("p0") == 0
    # B misses r2's message; the gap's repair keeps r1 and learns r2 (both released by then).
    receive = ledger_b.receive
    ledger_b.receive = lambda payload: None  # type: ignore[method-assign]
    await a.schedule(req("r2", 20))
    a.end_reservation("r2")
    await asyncio.sleep(0.05)
    ledger_b.receive = receive  # type: ignore[method-assign]
    await a.schedule(req("r3", 10))  # the next message B hears shows a gap in A's seqs
    await until(lambda: ledger_b.stats.num_gaps >= 1 and ledger_b.others_recent_tokens_at("p0")[0] > 85)
    assert ledger_b.others_recent_tokens_at("p0")[0] <= 90 and ledger_b.others_tokens("p0") == 10


async def test_the_router_wide_fair_share_lets_the_other_replicas_better_waiter_go_first(replicas) -> None:  # type: ignore[no-untyped-def]
    """Budget frees on replica A, whose queue holds a noisy tenant; replica B holds a request of a
    tenant served less: A places B's waiter on the spot (in the message of the release, so the
    budget is never free for anyone else) and B adopts the placement as its own."""
    a, ledger_a = replicas("a", timeout_s=3.0)
    b, ledger_b = replicas("b", timeout_s=3.0)
    await until(lambda: ledger_a.num_live_replicas == 2 and ledger_b.num_live_replicas == 2)
    await a.schedule(req("hold", 100, tenant="noisy"))
    noisy = [asyncio.create_task(a.schedule(req(f"n{i}", 100, tenant="noisy"))) for i in range(3)]
    # B must see A's hold before its request comes, or it places it at once on budget it sees free (a
    # CI run on a loaded host: B had not applied A's message 50 ms on, and no waiter ever reached A).
    await until(lambda: ledger_b.others_tokens("p0") == 100, timeout_s=5.0)
    await asyncio.sleep(0.05)
    victim = asyncio.create_task(b.schedule(req("v", 100, tenant="victim")))
    # B's waiter reaches A once A mirrors B (from B's snapshot, ~0.1 s here); one CI run, its host
    # loaded, took over 2 s.
    await until(lambda: any(w.tenant == "victim" for w in ledger_a.remote_waiters()), timeout_s=5.0)
    a.end_reservation("hold")
    assert a.reservations.get("v") is not None  # placed by A at once, in the release's own iteration
    placement = await asyncio.wait_for(victim, 2)
    assert placement.request_id == "v" and placement.prefill is not None and placement.prefill.worker_id == "p0"
    assert not any(t.done() for t in noisy)
    # B holds it now, A's copy is gone, and every replica counts it once.
    assert b.reservations.get("v") is not None
    await until(lambda: a.reservations.get("v") is None)
    await until(lambda: ledger_a.others_tokens("p0") == 100 and ledger_b.others_tokens("p0") == 0)
    b.end_reservation("v")
    done, _ = await asyncio.wait(noisy, timeout=2, return_when=asyncio.FIRST_COMPLETED)
    assert len(done) == 1
    for task in noisy:
        task.cancel()


def _two_cold_pools() -> list[WorkerRecord]:
    return [
        *(WorkerRecord(f"p{i}", "prefill", "m", f"p{i}:1", block_size_tokens=16, num_kv_blocks=100) for i in range(8)),
        *(
            WorkerRecord(f"d{i}", "decode", "m", f"d{i}:1", block_size_tokens=16, num_kv_blocks=10_000)
            for i in range(4)
        ),
    ]


async def test_replicas_with_the_same_view_choose_alike(replicas) -> None:  # type: ignore[no-untyped-def]
    """Ties between equal workers are broken by the request id, not by a replica's own rotation."""
    workers = _two_cold_pools()
    a, _ = replicas("a", workers=workers, prefill_budget=10_000)
    b, _ = replicas("b", workers=workers, prefill_budget=10_000)
    for i in range(40):
        ra = a.place_now(req(f"r{i}", 50), workers)
        rb = b.place_now(req(f"r{i}", 50), workers)
        assert (ra.prefill, ra.decode) == (rb.prefill, rb.decode)
        a.end_reservation(f"r{i}")
        b.end_reservation(f"r{i}")


async def victim_waiting_on_b(
    a: Scheduler, ledger_a: Ledger, b: Scheduler, ledger_b: Ledger
) -> asyncio.Task[PlacementDecision]:
    """A holds p0's whole budget ("hold", tenant noisy); B's request "v" (tenant victim) waits for it,
    and A sees it waiting."""
    await a.schedule(req("hold", 100, tenant="noisy"))
    await until(lambda: ledger_b.others_tokens("p0") == 100)
    victim = asyncio.create_task(b.schedule(req("v", 100, tenant="victim")))
    await until(lambda: any(w.tenant == "victim" for w in ledger_a.remote_waiters()))
    return victim


async def test_a_handoff_for_a_request_that_no_longer_waits_is_refused_and_frees_the_budget(replicas) -> None:  # type: ignore[no-untyped-def]
    """B's waiter gave up (its queue timeout) after A placed it, before the hand-off arrived: B
    refuses it, and A's budget comes back to A's own waiter."""
    a, ledger_a = replicas("a", timeout_s=3.0)
    b, ledger_b = replicas("b", timeout_s=0.3)
    await until(lambda: ledger_a.num_live_replicas == 2 and ledger_b.num_live_replicas == 2)
    victim = await victim_waiting_on_b(a, ledger_a, b, ledger_b)
    noisy = asyncio.create_task(a.schedule(req("n0", 100, tenant="noisy")))
    await asyncio.sleep(0.02)
    b._room.waiters_by_id.clear()  # as if v's Schedule had ended in the instant before the hand-off arrived
    a.end_reservation("hold")
    assert a.reservations.get("v") is not None
    await until(lambda: a.reservations.get("v") is None)  # refused: released on A
    assert (await asyncio.wait_for(noisy, 2)).prefill is not None  # and the budget went on to n0
    with pytest.raises(NoCapacityError):
        await victim
    assert b.reservations.get("v") is None


async def test_a_handoff_nobody_answers_gives_its_budget_back(replicas) -> None:  # type: ignore[no-untyped-def]
    """The waiter's replica died before answering: the placement's budget comes back after the
    hand-off timeout, not at the lease's end."""
    a, ledger_a = replicas("a", timeout_s=3.0, handoff_timeout_s=0.2)
    b, ledger_b = replicas("b", timeout_s=3.0)
    await until(lambda: ledger_a.num_live_replicas == 2 and ledger_b.num_live_replicas == 2)
    victim = await victim_waiting_on_b(a, ledger_a, b, ledger_b)
    ledger_b.on_change = None  # B stops answering (its process hangs, then dies)
    a.end_reservation("hold")
    assert a.reservations.get("v") is not None
    await asyncio.sleep(0.3)
    a.tick()
    assert a.reservations.get("v") is None
    victim.cancel()


async def test_a_retry_placed_here_is_not_released_by_the_handoff_it_replaced(replicas) -> None:  # type: ignore[no-untyped-def]
    """B died with A's hand-off unanswered, and the gateway retried the request on A: A's new
    placement of it must outlive the hand-off's timeout."""
    a, ledger_a = replicas("a", timeout_s=3.0, handoff_timeout_s=0.2)
    b, ledger_b = replicas("b", timeout_s=3.0)
    await until(lambda: ledger_a.num_live_replicas == 2 and ledger_b.num_live_replicas == 2)
    victim = await victim_waiting_on_b(a, ledger_a, b, ledger_b)
    ledger_b.on_change = None  # B stops answering
    a.end_reservation("hold")
    assert a.reservations.get("v") is not None  # the hand-off
    retried = await a.schedule(req("v", 100, tenant="victim"))  # the gateway's retry, now on A
    assert retried.prefill is not None
    await asyncio.sleep(0.3)
    a.tick()
    assert a.reservations.get("v") is not None
    victim.cancel()


async def test_a_ledger_drops_its_own_messages_and_applies_a_replica_whose_id_extends_its_own() -> None:
    """The channel hands a publisher its own messages back; they are dropped before decoding, by their
    first bytes. A replica named ``r10`` is not ``r1``: its messages are applied by ``r1``."""
    published: dict[str, list[bytes]] = {}
    ledgers = {}
    for name in ("r1", "r10"):
        ledger = Ledger(
            "redis://127.0.0.1:6379/0",
            key_prefix="unused",
            replica_id=name,
            secret=LEDGER_SECRET,
            lease_s=60,
            young_s=1,
        )

        def publish(payload: bytes, name: str = name) -> bool:
            published.setdefault(name, []).append(payload)
            return True

        ledger._publisher.publish = publish  # type: ignore[method-assign]  # the real encoding, no Redis
        table = ReservationTable(lease_s=60, young_s=1)
        ledger.reserved(table.reserve(f"req-{name}", ("p0", "d0"), {"p0": 40, "d0": 90}, tenant="t"), 40)
        ledger._flush()
        ledgers[name] = ledger
    r1, r10 = ledgers["r1"], ledgers["r10"]
    try:
        r1.receive(published["r1"][0])
        assert r1.stats.num_received == 0 and not r1._mirrors
        r1.receive(published["r10"][0])
        r10.receive(published["r1"][0])
        # Each follows the other now (a new mirror keeps the message until the sender's snapshot).
        assert r1.stats.num_received == 1 and set(r1._mirrors) == {"r10"}
        assert r10.stats.num_received == 1 and set(r10._mirrors) == {"r1"}
    finally:
        for ledger in ledgers.values():
            await ledger.aclose()
