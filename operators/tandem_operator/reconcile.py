"""Pure reconcile logic: from a TandemDeployment and what exists, to what should exist and its status.

:mod:`tandem_operator.handlers` calls these with plain dicts read from the
API and applies the results; tests call them directly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tandem_operator.autoscale import Decision
from tandem_operator.resources import build_pool_deployment, build_pool_service
from tandem_operator.rollout import with_pairing_gate
from tandem_operator.spec import Pool, PoolSpec, TandemSpec


@dataclass(frozen=True)
class Owner:
    """The TandemDeployment being reconciled."""

    name: str
    namespace: str
    uid: str
    labels: dict[str, str]
    generation: int


def replicas_to_apply(
    pool: PoolSpec, *, autoscaling_enabled: bool, current: int | None, external: bool = False
) -> int:
    """With autoscaling on, the autoscaler owns the count (kept within min/max); with an external
    autoscaler (HPA, KEDA), whatever it set; otherwise the spec does."""
    if current is None:
        return pool.replicas
    if external:
        return current
    if not autoscaling_enabled:
        return pool.replicas
    return min(max(current, pool.min_replicas), pool.max_replicas)


def desired_objects(
    owner: Owner,
    spec: TandemSpec,
    current_replicas: Mapping[str, int | None],
    live: Mapping[str, dict[str, Any] | None] | None = None,
) -> list[dict[str, Any]]:
    """The Deployment and Service of every pool; ``current_replicas`` and the ``live`` Deployments by pool
    key (:attr:`Pool.key`): a pool whose revision changes gets the pairing gate (tandem_operator.rollout)."""
    objects: list[dict[str, Any]] = []
    for pool in spec.pools_of():
        replicas = replicas_to_apply(
            pool.spec,
            autoscaling_enabled=spec.autoscaling.enabled,
            current=current_replicas.get(pool.key),
            external=spec.autoscaling.external,
        )
        deployment = build_pool_deployment(name=owner.name, namespace=owner.namespace, uid=owner.uid,
                                           cr_labels=owner.labels, spec=spec, pool=pool, replicas=replicas)
        objects.append(with_pairing_gate(deployment, (live or {}).get(pool.key)))
        objects.append(build_pool_service(name=owner.name, namespace=owner.namespace, uid=owner.uid,
                                          cr_labels=owner.labels, spec=spec, pool=pool))
    return objects


def owned_names(owner_name: str, pools: list[Pool]) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of what the operator creates for ``owner_name``'s ``pools``."""
    return [
        (api, kind, pool.name(owner_name))
        for pool in pools
        for api, kind in (("apps/v1", "Deployment"), ("v1", "Service"))
    ]


def stale_names(owner_name: str, owned: list[dict[str, Any]], pools: list[Pool]) -> list[str]:
    """Names of pool Deployments the operator made for ``owner_name`` (``owned``: those carrying its
    ``tandem.dev/deployment`` label) that no pool of the spec has now: a model removed from
    ``spec.models``, or the form changed. Their Deployment and Service are deleted."""
    wanted = {pool.name(owner_name) for pool in pools}
    names = {str(obj.get("metadata", {}).get("name", "")) for obj in owned}
    return sorted(n for n in names if n and n not in wanted)


def foreign_pools(owner: Owner, deployments: Mapping[str, dict[str, Any] | None]) -> list[str]:
    """Names of pool Deployments that exist but are not this resource's (another TandemDeployment's pool
    of the same name, e.g. ``chat`` with model ``smol`` and ``chat-smol``'s single-model pool, or an
    object made by hand). The operator applies nothing over them."""
    return sorted(
        str(dep["metadata"].get("name"))
        for dep in deployments.values()
        if dep is not None
        and not any(ref.get("uid") == owner.uid for ref in dep.get("metadata", {}).get("ownerReferences") or [])
    )


def conflict_status(owner: Owner, names: list[str], conditions: list[dict[str, Any]], now: str) -> dict[str, Any]:
    """Status for a resource whose pool names are taken by objects it does not own."""
    message = (f"Deployments {', '.join(names)} exist and belong to something else: rename this resource "
               "or a model, or delete them; then change this resource to reconcile it again")
    conditions = set_condition(conditions, type_="SpecValid", status=True, reason="Valid", message="",
                               now=now, generation=owner.generation)
    conditions = set_condition(conditions, type_="Reconciled", status=False, reason="NameConflict", message=message,
                               now=now, generation=owner.generation)
    conditions = set_condition(conditions, type_="Ready", status=False, reason="NameConflict", message=message,
                               now=now, generation=owner.generation)
    return {"observedGeneration": owner.generation, "conditions": conditions}


def observed_pool(deployment: dict[str, Any] | None) -> dict[str, Any]:
    if deployment is None:
        return {"replicas": 0, "readyReplicas": 0, "desiredReplicas": 0}
    status = deployment.get("status") or {}
    return {
        "replicas": int(status.get("replicas", 0) or 0),
        "readyReplicas": int(status.get("readyReplicas", 0) or 0),
        "desiredReplicas": int((deployment.get("spec") or {}).get("replicas", 0) or 0),
    }


def set_condition(
    conditions: list[dict[str, Any]],
    *,
    type_: str,
    status: bool,
    reason: str,
    message: str,
    now: str,
    generation: int,
) -> list[dict[str, Any]]:
    """``conditions`` with ``type_`` replaced; ``lastTransitionTime`` moves only when the status flips."""
    status_str = "True" if status else "False"
    previous = next((c for c in conditions if c.get("type") == type_), None)
    transition = previous["lastTransitionTime"] if previous and previous.get("status") == status_str else now
    new = {
        "type": type_,
        "status": status_str,
        "reason": reason,
        "message": message,
        "lastTransitionTime": transition,
        "observedGeneration": generation,
    }
    return [c for c in conditions if c.get("type") != type_] + [new]


def observed_pools(pools: list[Pool], deployments: Mapping[str, dict[str, Any] | None]) -> dict[str, Any]:
    """``status.pools``: per pool key, its replica counts (and, in the models form, its model and role)."""
    out: dict[str, Any] = {}
    for pool in pools:
        entry = observed_pool(deployments.get(pool.key))
        if pool.model.slug is not None:
            entry.update(model=pool.model.name, role=pool.role)
        out[pool.key] = entry
    return out


def reconciled_status(
    owner: Owner, spec: TandemSpec, deployments: Mapping[str, dict[str, Any] | None],
    conditions: list[dict[str, Any]], now: str,
) -> dict[str, Any]:
    pools = observed_pools(spec.pools_of(), deployments)
    conditions = set_condition(conditions, type_="SpecValid", status=True, reason="Valid", message="",
                               now=now, generation=owner.generation)
    conditions = set_condition(conditions, type_="Reconciled", status=True, reason="Applied",
                               message="Deployments and Services of every pool applied", now=now,
                               generation=owner.generation)
    conditions = ready_condition(conditions, pools, now, owner.generation)
    return {"observedGeneration": owner.generation, "pools": pools, "conditions": conditions}


def ready_condition(
    conditions: list[dict[str, Any]], pools: Mapping[str, dict[str, Any]], now: str, generation: int
) -> list[dict[str, Any]]:
    """``conditions`` with Ready set from the pools: every pool has a ready replica."""
    ready = all(p["readyReplicas"] > 0 for p in pools.values())
    return set_condition(
        conditions, type_="Ready", status=ready, reason="PoolsReady" if ready else "PoolsNotReady",
        message=", ".join(f"{r}: {p['readyReplicas']}/{p['desiredReplicas']} ready" for r, p in pools.items()),
        now=now, generation=generation,
    )


def invalid_status(owner: Owner, message: str, conditions: list[dict[str, Any]], now: str) -> dict[str, Any]:
    """Status for a resource the operator will not act on until it is fixed."""
    conditions = set_condition(conditions, type_="SpecValid", status=False, reason="InvalidSpec", message=message,
                               now=now, generation=owner.generation)
    conditions = set_condition(conditions, type_="Ready", status=False, reason="InvalidSpec", message=message,
                               now=now, generation=owner.generation)
    return {"observedGeneration": owner.generation, "conditions": conditions}


def decision_status(decision: Decision, now: str) -> dict[str, Any]:
    """The ``status.autoscaling.<role>`` entry for a decision."""
    signals = {k: v for k, v in vars(decision.signals).items() if isinstance(v, float | int)}
    entry: dict[str, Any] = {
        "currentReplicas": decision.current_replicas,
        "desiredReplicas": decision.desired_replicas,
        "reason": decision.reason,
        "signals": {k: round(v, 6) for k, v in signals.items()},
        "lastDecisionTime": now,
    }
    if decision.signals.unread_from:
        entry["unreadFrom"] = list(decision.signals.unread_from)  # router pods that did not answer: a partial read
    return entry
