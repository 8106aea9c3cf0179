from __future__ import annotations

from collections import Counter

import pytest

from tandem.router.policy import (
    POLICIES,
    LeastLoadedPolicy,
    RoundRobinPolicy,
    ScheduleRequest,
    create_policy,
)
from tests.kit.workers import StaticLoad, make_pool, make_worker


def request(**kwargs: object) -> ScheduleRequest:
    return ScheduleRequest(request_id="r", model="m", **kwargs)  # type: ignore[arg-type]


def test_filter_keeps_role_and_model_and_drops_excluded() -> None:
    workers = [*make_pool(2, 2), make_worker("p-other", "prefill", model="other")]
    policy = LeastLoadedPolicy()
    kept = policy.filter(request(exclude_worker_ids=frozenset({"p0"})), "prefill", workers, StaticLoad())
    assert [w.worker_id for w in kept] == ["p1"]


def test_choose_returns_none_without_candidates() -> None:
    assert LeastLoadedPolicy().choose(request(), "decode", make_pool(2, 0), StaticLoad()) is None


def test_least_loaded_prefers_fewest_in_flight() -> None:
    workers = make_pool(3, 0)
    load = StaticLoad({"p0": 2, "p1": 1, "p2": 3})
    chosen = LeastLoadedPolicy().choose(request(), "prefill", workers, load)
    assert chosen is not None and chosen.worker.worker_id == "p1"


def test_least_loaded_counts_reported_load_when_it_exceeds_own_in_flight() -> None:
    # p0: nothing from us but its engine is busy (another router replica's traffic).
    workers = [make_worker("p0", "prefill", num_running=3, num_waiting=2), make_worker("p1", "prefill")]
    chosen = LeastLoadedPolicy().choose(request(), "prefill", workers, StaticLoad({"p1": 2}))
    assert chosen is not None and chosen.worker.worker_id == "p1"


def test_least_loaded_breaks_ties_by_reported_load() -> None:
    # Both at two requests by our count; p1's engine reports less.
    workers = [make_worker("p0", "prefill", num_running=2), make_worker("p1", "prefill", num_running=1)]
    chosen = LeastLoadedPolicy().choose(request(), "prefill", workers, StaticLoad({"p0": 2, "p1": 2}))
    assert chosen is not None and chosen.worker.worker_id == "p1"


def test_reported_tiebreak_never_outweighs_a_whole_request() -> None:
    policy = LeastLoadedPolicy()
    busy_engine = make_worker("p0", "prefill", num_running=1000)
    idle_engine = make_worker("p1", "prefill")
    load = StaticLoad({"p0": 1000, "p1": 1001})
    assert policy.score(request(), busy_engine, load) > policy.score(request(), idle_engine, load)


def test_scores_are_in_unit_interval() -> None:
    policy = LeastLoadedPolicy()
    idle, busy = make_worker("p0", "prefill"), make_worker("p1", "prefill", num_running=50, num_waiting=50)
    for worker in (idle, busy):
        for n in (0, 1, 10_000):
            assert 0.0 < policy.score(request(), worker, StaticLoad({worker.worker_id: n})) <= 1.0


def test_equal_workers_share_the_traffic_and_every_replica_picks_alike() -> None:
    pool = make_pool(0, 3)
    replica_a, replica_b = LeastLoadedPolicy(), LeastLoadedPolicy()
    picks_a = [replica_a.choose(request_id(f"r{i}"), "decode", pool, StaticLoad()) for i in range(600)]
    picks_b = [replica_b.choose(request_id(f"r{i}"), "decode", pool, StaticLoad()) for i in range(600)]
    ids_a = [p.worker.worker_id for p in picks_a if p is not None]
    assert ids_a == [p.worker.worker_id for p in picks_b if p is not None]  # no shared state, same answers
    counts = Counter(ids_a)
    assert set(counts) == {"d0", "d1", "d2"} and all(150 <= n <= 250 for n in counts.values()), counts
    # the same request id lands on the same worker every time
    again = replica_a.choose(request_id("r7"), "decode", pool, StaticLoad())
    assert again is not None and again.worker.worker_id == ids_a[7]


def request_id(value: str) -> ScheduleRequest:
    return ScheduleRequest(request_id=value, model="m")


def test_round_robin_cycles_regardless_of_load() -> None:
    policy = RoundRobinPolicy()
    load = StaticLoad({"p0": 100})
    picks = [policy.choose(request(), "prefill", make_pool(2, 0), load) for _ in range(4)]
    assert [p.worker.worker_id for p in picks if p is not None] == ["p0", "p1", "p0", "p1"]


def test_rotation_is_per_role() -> None:
    policy = RoundRobinPolicy()
    workers = make_pool(2, 2)
    first_prefill = policy.choose(request(), "prefill", workers, StaticLoad())
    first_decode = policy.choose(request(), "decode", workers, StaticLoad())
    assert first_prefill is not None and first_prefill.worker.worker_id == "p0"
    assert first_decode is not None and first_decode.worker.worker_id == "d0"


def test_create_policy_by_name() -> None:
    assert set(POLICIES) == {"cache_aware", "least_loaded", "round_robin"}
    assert isinstance(create_policy("least_loaded"), LeastLoadedPolicy)
    assert isinstance(create_policy("round_robin"), RoundRobinPolicy)
    # Fresh state every time: two replicas must not share rotation counters.
    assert create_policy("round_robin") is not create_policy("round_robin")


def test_create_policy_rejects_unknown_name_listing_known_ones() -> None:
    with pytest.raises(ValueError, match="cache_aware, least_loaded, round_robin"):
        create_policy("cache-aware")
