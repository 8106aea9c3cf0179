"""Adding a scorer to cache_aware is one class and one weight in configuration, and it moves placements."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.common.registry import WorkerRecord
from tandem.router.budget import BudgetConfig, BudgetView
from tandem.router.policy import CacheAwarePolicy, CacheAwareWeights, ScheduleRequest
from tandem.router.pool import F64, PoolArrays
from tandem.router.reservations import ReservationTable
from tandem.router.scorers import SCORERS, Scorer
from tandem.router.settings import TandemRouterSettings


class SameZone(Scorer):
    """The example of the scorers module: prefer workers in the router's zone ("a"), read from the
    host of the worker's address (``<worker>.zone-<z>:<port>``)."""

    name = "same_zone"
    kind = "affinity"

    def scores(self, request: ScheduleRequest, pool: PoolArrays) -> F64:
        return np.array([1.0 if ".zone-a:" in w.address else 0.0 for w in pool.workers])


def zone_worker(worker_id: str, role: str, zone: str) -> WorkerRecord:
    return WorkerRecord(worker_id, role, "m", f"{worker_id}.zone-{zone}:1", block_size_tokens=16, num_kv_blocks=1000)


WORKERS = [
    zone_worker("p0", "prefill", "a"),
    zone_worker("p1", "prefill", "b"),
    zone_worker("p2", "prefill", "b"),
    zone_worker("d0", "decode", "a"),
    zone_worker("d1", "decode", "b"),
]


def placements(policy: CacheAwarePolicy, role: str, num_requests: int = 60) -> list[str]:
    view = BudgetView(ReservationTable(lease_s=60), BudgetConfig())
    chosen = []
    for i in range(num_requests):
        request = ScheduleRequest(request_id=f"r{i}", model="m", num_prompt_tokens=500, max_tokens=50)
        scored = policy.choose(request, role, WORKERS, view)
        assert scored is not None
        chosen.append(scored.worker.worker_id)
    return chosen


def test_the_added_scorer_is_registered_by_its_name() -> None:
    assert SCORERS["same_zone"] is SameZone
    assert {"prefix_locality", "token_load", "kv_headroom"} <= set(SCORERS)


def test_one_weight_turns_it_on_and_it_changes_placement() -> None:
    # Without its weight, equally idle workers share the traffic (the rendezvous tie-break).
    assert set(placements(CacheAwarePolicy(), "prefill")) == {"p0", "p1", "p2"}
    assert set(placements(CacheAwarePolicy(), "decode")) == {"d0", "d1"}
    # One line of configuration: every placement goes to the zone-a worker, on both roles.
    policy = CacheAwarePolicy(CacheAwareWeights(same_zone=2.0))  # type: ignore[call-arg]
    assert set(placements(policy, "prefill")) == {"p0"}
    assert set(placements(policy, "decode")) == {"d0"}
    view = BudgetView(ReservationTable(lease_s=60), BudgetConfig())
    request = ScheduleRequest(request_id="r", model="m", num_prompt_tokens=500)
    assert policy.scorers(request, WORKERS[1], view)["same_zone"] == 0.0


def test_a_decode_weight_overrides_it_on_decode_pools_only() -> None:
    policy = CacheAwarePolicy(CacheAwareWeights(same_zone=2.0, decode_same_zone=0.0))  # type: ignore[call-arg]
    assert set(placements(policy, "prefill")) == {"p0"}
    assert set(placements(policy, "decode")) == {"d0", "d1"}


def test_it_is_weighed_against_the_built_in_scorers() -> None:
    """A weak zone preference loses to a busy zone-a worker: the built-in token load still counts."""
    table = ReservationTable(lease_s=60)
    table.reserve("busy", ("p0",), {"p0": 15_000})
    view = BudgetView(table, BudgetConfig())
    request = ScheduleRequest(request_id="r", model="m", num_prompt_tokens=500, max_tokens=50)
    weak = CacheAwarePolicy(CacheAwareWeights(same_zone=0.2))  # type: ignore[call-arg]
    strong = CacheAwarePolicy(CacheAwareWeights(same_zone=5.0))  # type: ignore[call-arg]
    weak_choice, strong_choice = (
        weak.choose(request, "prefill", WORKERS, view),
        strong.choose(request, "prefill", WORKERS, view),
    )
    assert weak_choice is not None and weak_choice.worker.worker_id in {"p1", "p2"}
    assert strong_choice is not None and strong_choice.worker.worker_id == "p0"


def test_its_weight_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_ROUTER_WEIGHTS__SAME_ZONE", "2")
    weights = TandemRouterSettings().weights
    assert weights.by_role(decode=False) == {
        "prefix_locality": 3.0,
        "token_load": 1.0,
        "kv_headroom": 0.5,
        "same_zone": 2.0,
    }
    assert weights.by_role(decode=True)["prefix_locality"] == 1.0  # decode_prefix_locality


def test_a_weight_for_no_scorer_or_below_zero_is_refused() -> None:
    with pytest.raises(ValueError, match="no scorer named 'same_zones'"):
        CacheAwareWeights(same_zones=1.0)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="must be >= 0"):
        CacheAwareWeights(same_zone=-1.0)  # type: ignore[call-arg]


def test_two_scorers_cannot_share_a_name() -> None:
    with pytest.raises(ValueError, match="exists already"):

        class AnotherSameZone(Scorer):
            name = "same_zone"
            kind = "affinity"

            def scores(self, request: ScheduleRequest, pool: PoolArrays) -> F64:
                return np.zeros(len(pool))
