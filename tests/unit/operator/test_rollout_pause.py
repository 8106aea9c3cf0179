"""tandem_operator.rollout_pause: while a model's pools roll a new revision, the autoscaler grows them
but holds every scale-down, and says so (the decision's reason, the ScaleDownPaused condition).

The Deployment statuses below are shaped as the Deployment controller writes them (``updatedReplicas``
left out when 0, as the API's omitempty does)."""

from __future__ import annotations

from typing import Any

from tandem_operator.autoscale import Decision, PoolSignals, decide
from tandem_operator.rollout_pause import CONDITION, hold_scale_down, paused_condition, rolling_models, rollout_progress
from tandem_operator.spec import AutoscalingSpec, PoolSpec, SloSpec, parse_spec

POOL = PoolSpec(replicas=2, min_replicas=1, max_replicas=6)
POLICY = AutoscalingSpec.model_validate({"scale_up_stabilization_seconds": 0, "scale_down_stabilization_seconds": 0})
SLO = SloSpec(ttft_p90_seconds=2.0, itl_p90_seconds=0.1)
BASE: dict[str, Any] = {"image": {"repository": "r", "tag": "t"}, "redis": {"url": "redis://r:6379/0"}}
TWO: dict[str, Any] = {
    **BASE,
    "models": [
        {"name": "smol", "pvc": {"claimName": "models"}},
        {"name": "Qwen/Qwen2.5-7B-Instruct", "path": "/models/qwen", "pvc": {"claimName": "qwen"}},
    ],
}


def dep(spec_replicas: int, **status: Any) -> dict[str, Any]:
    return {"spec": {"replicas": spec_replicas}, "status": status}


#: A pool of 2 one surge pod into its rollout (maxSurge 1): 3 pods, 1 of the new template, 2 Ready.
SURGING = dep(2, replicas=3, updatedReplicas=1, readyReplicas=2, availableReplicas=2)
SETTLED = dep(2, replicas=2, updatedReplicas=2, readyReplicas=2, availableReplicas=2)


def decision(role: str, current: int, signals: PoolSignals) -> Decision:
    made, _ = decide(
        role=role, current_replicas=current, signals=signals, pool=POOL, policy=POLICY, slo=SLO, history=(), now_s=100.0
    )
    return made


def test_a_deployment_is_rolling_while_it_has_pods_of_an_older_template() -> None:
    assert rollout_progress(SURGING) == "1 of 3 pods updated"
    # maxSurge 0 / maxUnavailable 1: the controller first takes an old pod away; no new pod yet.
    assert rollout_progress(dep(2, replicas=1, readyReplicas=1)) == "0 of 1 pods updated"
    stalled = dep(
        2,
        replicas=3,
        updatedReplicas=1,
        conditions=[
            {"type": "Available", "status": "True"},
            {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"},
        ],
    )
    assert rollout_progress(stalled) == "1 of 3 pods updated, stalled (ProgressDeadlineExceeded)"


def test_a_scale_up_a_settled_pool_and_a_missing_one_are_no_rollout() -> None:
    assert rollout_progress(SETTLED) is None
    # A scale-up in progress (2 → 3): every pod is of the current template, one is still to come.
    assert rollout_progress(dep(3, replicas=2, updatedReplicas=2, readyReplicas=2)) is None
    assert rollout_progress(dep(0)) is None  # a pool at zero, no status yet
    assert rollout_progress(None) is None


def test_a_rolling_pool_pauses_its_models_pools_only() -> None:
    pools = parse_spec(TWO).pools_of()
    keys = [p.key for p in pools]
    qwen_decode = next(k for k in keys if k.endswith("-decode") and not k.startswith("smol"))
    deployments = {k: SETTLED for k in keys} | {"smol-prefill": SURGING}
    assert rolling_models(pools, deployments) == {"smol": "smol-prefill: 1 of 3 pods updated"}
    both = deployments | {"smol-decode": dep(1, replicas=2, updatedReplicas=1), qwen_decode: None}
    assert rolling_models(pools, both) == {
        "smol": "smol-prefill: 1 of 3 pods updated; smol-decode: 1 of 2 pods updated"
    }
    assert rolling_models(pools, {k: SETTLED for k in keys}) == {}


def test_a_scale_down_waits_for_the_rollout_and_says_what_it_would_do() -> None:
    idle = decision("prefill", 3, PoolSignals(queue_depth=0, uncached_tokens=0))
    assert idle.desired_replicas == 2 and idle.reason.startswith("scale down")
    held = hold_scale_down(idle, "prefill: 1 of 3 pods updated")
    assert held.desired_replicas == 3 and not held.changed and held.step == "" and held.drivers == ()
    assert held.reason == f"scale down paused: rollout (prefill: 1 of 3 pods updated); would go to 2: {idle.reason}"
    assert held.votes == idle.votes and held.raw_replicas == idle.raw_replicas  # the log still shows the votes
    assert hold_scale_down(idle, None) is idle  # no rollout: the decision stands


def test_a_scale_up_goes_on_during_a_rollout() -> None:
    busy = decision("decode", 2, PoolSignals(kv_usage=0.95))
    assert busy.desired_replicas == 3
    assert hold_scale_down(busy, "decode: 1 of 3 pods updated") is busy
    steady = decision("decode", 2, PoolSignals(kv_usage=0.7))
    assert hold_scale_down(steady, "decode: 1 of 3 pods updated") is steady


def _condition(conditions: list[dict[str, Any]]) -> dict[str, Any]:
    return next(c for c in conditions if c["type"] == CONDITION)


def test_the_condition_comes_with_the_first_rollout_and_turns_false_after_it() -> None:
    ready = [
        {
            "type": "Ready",
            "status": "True",
            "reason": "PoolsReady",
            "message": "",
            "lastTransitionTime": "t0",
            "observedGeneration": 1,
        }
    ]
    assert paused_condition(ready, {}, "t1", 1) is None  # never rolled: no condition at all
    rolling = {"smol": "smol-prefill: 1 of 3 pods updated"}
    paused = paused_condition(ready, rolling, "t1", 2)
    assert paused is not None and paused[0] == ready[0]
    assert _condition(paused) == {
        "type": CONDITION,
        "status": "True",
        "reason": "Rollout",
        "lastTransitionTime": "t1",
        "observedGeneration": 2,
        "message": "model smol rolls a new revision (smol-prefill: 1 of 3 pods updated): its pools' "
        "scale-downs wait for the rollout, scale-ups go on",
    }
    assert paused_condition(paused, rolling, "t2", 2) is None  # unchanged: no status write
    further = paused_condition(paused, {"smol": "smol-prefill: 2 of 3 pods updated"}, "t2", 2)
    assert further is not None and _condition(further)["lastTransitionTime"] == "t1"  # still True
    done = paused_condition(paused, {}, "t3", 2)
    assert done is not None and _condition(done)["status"] == "False" and _condition(done)["reason"] == "NoRollout"
    assert _condition(done)["lastTransitionTime"] == "t3"
    assert paused_condition(done, {}, "t4", 2) is None
