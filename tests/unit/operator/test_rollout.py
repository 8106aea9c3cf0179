"""Prefill and decode of a new revision roll together (tandem_operator.rollout): the operator sees a
revision change (image, model, dtype), gates the pools' new pods, and marks them Ready only once the
other role's of the same revision serve, so at every step of a rollout some revision has a prefill and
a decode worker serving. Checked by simulating the Deployment controller's rolling update step by step
over random model-load orders: with the gate the invariant holds in every run, without it it breaks."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, replace
from typing import Any

import pytest
from tandem_operator.reconcile import Owner, desired_objects
from tandem_operator.rollout import (
    PAIRED_CONDITION,
    PodState,
    paired_status_patch,
    pod_revision,
    pod_state,
    pods_to_pair,
    revision_changed,
    with_pairing_gate,
)
from tandem_operator.spec import parse_spec

OWNER = Owner(name="chat", namespace="ns", uid="u", labels={}, generation=1)
SPEC: dict[str, Any] = {
    "model": {"servedModelName": "smol", "pvc": {"claimName": "models"}},
    "image": {"repository": "ghcr.io/tandem-llm/tandem-worker-gpu", "tag": "0.1.0"},
    "redis": {"url": "redis://r:6379/0"},
    "pools": {"prefill": {"replicas": 2, "maxReplicas": 4}, "decode": {"replicas": 2, "maxReplicas": 4}},
}


def deployments(spec: dict[str, Any], live: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    objects = desired_objects(OWNER, parse_spec(spec), {"prefill": 2, "decode": 2}, live)
    return {o["metadata"]["name"].rsplit("-", 1)[1]: o for o in objects if o["kind"] == "Deployment"}


def _with(spec: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    out = json_copy(spec)
    node = out
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    return out


def json_copy(value: Any) -> Any:
    import json

    return json.loads(json.dumps(value))


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("image", "tag"), "0.2.0"),
        (("pools", "prefill", "engineArgs"), {"dtype": "float16"}),
        (("pools", "prefill", "engineArgs"), {"tensorParallelSize": 2}),
        (("pools", "prefill", "engineArgs"), {"extraEnv": {"TANDEM_WORKER_ENGINE__MODEL_REVISION": "ревизия-2"}}),
        (("model", "pvc"), {"claimName": "models-v2"}),
        (("model", "path"), "/models/other"),
    ],
)
def test_a_change_of_what_decides_the_kv_fingerprint_is_a_new_revision(path: tuple[str, ...], value: Any) -> None:
    live = deployments(SPEC)
    new = _with(SPEC, path, value)
    if path[:2] == ("pools", "prefill"):  # declared for both pools, as a rollout does (else they never pair)
        new = _with(new, ("pools", "decode", *path[2:]), value)
    changed = deployments(new, {"prefill": live["prefill"], "decode": live["decode"]})
    assert revision_changed(changed["prefill"], live["prefill"])
    gates = changed["prefill"]["spec"]["template"]["spec"]["readinessGates"]
    assert gates == [{"conditionType": PAIRED_CONDITION}]


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("pools", "prefill", "replicas"), 3),
        (("pools", "prefill", "resources"), {"limits": {"cpu": "4"}}),
        (("pools", "prefill", "rollout"), {"maxSurge": 0, "maxUnavailable": 1}),
        (("pools", "prefill", "drainTimeoutSeconds"), 30),
    ],
)
def test_other_changes_are_no_new_revision_and_add_no_gate(path: tuple[str, ...], value: Any) -> None:
    live = deployments(SPEC)
    changed = deployments(_with(SPEC, path, value), {"prefill": live["prefill"], "decode": live["decode"]})
    assert not revision_changed(changed["prefill"], live["prefill"])
    assert "readinessGates" not in changed["prefill"]["spec"]["template"]["spec"]


def test_a_new_pool_gets_no_gate_and_a_gated_pool_keeps_it() -> None:
    fresh = deployments(SPEC)
    assert all("readinessGates" not in d["spec"]["template"]["spec"] for d in fresh.values())
    rolled = deployments(_with(SPEC, ("image", "tag"), "0.2.0"), {"prefill": fresh["prefill"]})
    assert "readinessGates" in rolled["prefill"]["spec"]["template"]["spec"]
    # Once there, the gate stays on later reconciles of the same revision (removing it would roll again).
    again = with_pairing_gate(rolled["prefill"], rolled["prefill"])
    assert again["spec"]["template"]["spec"]["readinessGates"] == [{"conditionType": PAIRED_CONDITION}]
    assert not revision_changed(again, rolled["prefill"])


def test_pod_state_and_the_status_patch_keep_the_kubelets_conditions() -> None:
    template = deployments(_with(SPEC, ("image", "tag"), "0.2.0"), {"prefill": deployments(SPEC)["prefill"]})
    pod_spec = template["prefill"]["spec"]["template"]["spec"]
    pod = {
        "metadata": {"name": "chat-prefill-x", "labels": {"tandem.dev/pool": "prefill"}},
        "spec": pod_spec,
        "status": {"conditions": [{"type": "ContainersReady", "status": "True"}, {"type": "Ready", "status": "False"}]},
    }
    state = pod_state(pod)
    assert (state.role, state.containers_ready, state.ready, state.waiting) == ("prefill", True, False, True)
    assert state.revision == pod_revision(pod_spec)
    patched = paired_status_patch(pod, "2026-12-07T06:00:00Z")["status"]["conditions"]
    assert [c["type"] for c in patched] == ["ContainersReady", "Ready", PAIRED_CONDITION]
    done = {**pod, "status": {"conditions": patched}}
    assert not pod_state(done).waiting


# -- a rollout, step by step ----------------------------------------------------------------------

OLD, NEW = "rev-a", "rev-b"


@dataclass
class Pod:
    name: str
    role: str
    revision: str
    containers_ready: bool
    gated: bool
    paired: bool = False

    @property
    def ready(self) -> bool:
        return self.containers_ready and (not self.gated or self.paired)

    def state(self) -> PodState:
        return PodState(
            self.name,
            self.role,
            self.revision,
            self.containers_ready,
            self.ready,
            waiting=self.gated and not self.paired,
        )


@dataclass
class Pool:
    role: str
    replicas: int
    max_surge: int
    max_unavailable: int
    pods: list[Pod]

    def step(self, names: itertools.count[int], gated: bool) -> None:
        """The Deployment controller's rolling update, reduced to counts: create new pods up to
        replicas + maxSurge, remove old ones while replicas - maxUnavailable stay available."""
        new = [p for p in self.pods if p.revision == NEW]
        old = [p for p in self.pods if p.revision != NEW]
        available = sum(p.ready for p in self.pods)
        removable = available - (self.replicas - self.max_unavailable)
        for pod in sorted(old, key=lambda p: p.ready):  # not-ready old pods go first
            if not pod.ready:
                self.pods.remove(pod)
            elif removable > 0:
                self.pods.remove(pod)
                removable -= 1
        while len(self.pods) < self.replicas + self.max_surge and len(new) < self.replicas:
            pod = Pod(f"{self.role}-{next(names)}", self.role, NEW, containers_ready=False, gated=gated)
            self.pods.append(pod)
            new.append(pod)

    @property
    def done(self) -> bool:
        return len(self.pods) == self.replicas and all(p.revision == NEW and p.ready for p in self.pods)


def serving_pair(pools: list[Pool]) -> bool:
    """Some revision has a prefill and a decode worker serving (registered: containers ready)."""
    by_role = [{p.revision for p in pool.pods if p.containers_ready} for pool in pools]
    return bool(by_role[0] & by_role[1])


def roll(
    seed: int, replicas: tuple[int, int], surge: tuple[int, int], unavailable: tuple[int, int], gated: bool
) -> list[int]:
    """Steps (of at most 500) at which no revision had a serving pair."""
    rng = random.Random(seed)
    names = itertools.count()
    pools = [
        Pool(role, n, s, u, [Pod(f"{role}-{next(names)}", role, OLD, True, False) for _ in range(n)])
        for role, n, s, u in zip(("prefill", "decode"), replicas, surge, unavailable, strict=True)
    ]
    broken = []
    for step in range(500):
        loading = [p for pool in pools for p in pool.pods if not p.containers_ready]
        if loading:  # one engine finishes loading its model, in a random order
            rng.choice(loading).containers_ready = True
        if gated:
            states = [p.state() for pool in pools for p in pool.pods]
            for name in pods_to_pair(states):
                next(p for pool in pools for p in pool.pods if p.name == name).paired = True
        for pool in rng.sample(pools, 2):
            pool.step(names, gated)
            if not serving_pair(pools):
                broken.append(step)
        if all(pool.done for pool in pools):
            return broken
    raise AssertionError("the rollout did not finish")


SHAPES = [
    ((1, 1), (1, 1), (0, 0)),
    ((2, 1), (1, 1), (0, 0)),
    ((3, 2), (1, 1), (0, 0)),
    ((4, 2), (2, 1), (0, 0)),
    ((2, 2), (0, 0), (1, 1)),
    ((3, 3), (1, 0), (0, 1)),
]


@pytest.mark.parametrize(("replicas", "surge", "unavailable"), SHAPES)
def test_with_the_gate_a_revision_keeps_a_serving_pair_at_every_step(
    replicas: tuple[int, int], surge: tuple[int, int], unavailable: tuple[int, int]
) -> None:
    for seed in range(60):
        assert roll(seed, replicas, surge, unavailable, gated=True) == [], (seed, replicas)


def test_without_the_gate_the_pools_roll_apart() -> None:
    """The same simulation without the gate: the faster pool finishes first and no pair serves."""
    broken = [seed for seed in range(60) if roll(seed, (1, 1), (1, 1), (0, 0), gated=False)]
    assert len(broken) > 10


def test_pools_that_never_share_a_revision_are_not_held() -> None:
    """Prefill and decode of other dtypes (they never pair, the router prefills locally): the gate
    must not hold either pool's new pods forever."""
    pods = [
        PodState("p-old", "prefill", "x1", True, True, False),
        PodState("d", "decode", "y", True, True, False),
        PodState("p-new", "prefill", "x2", True, False, True),
    ]
    assert pods_to_pair(pods) == ["p-new"]
    held = [*pods[:2], PodState("d-old-x1", "decode", "x1", True, True, False), pods[2]]
    assert pods_to_pair(held) == []  # a serving x1 pair exists and no x2 decode worker yet
    assert pods_to_pair([*held, replace(held[1], name="d-new", revision="x2", ready=False, waiting=True)]) == [
        "d-new",
        "p-new",
    ]
