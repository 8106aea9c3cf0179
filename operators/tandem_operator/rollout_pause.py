"""While a model's pools roll a new revision, the autoscaler grows them but does not shrink them.

The rule, for every pool of a model one of whose pools is rolling (its Deployment still has pods of an
older template: ``status.replicas > status.updatedReplicas``):

* **scale-downs wait** for the rollout to finish (the decision says ``scale down paused: rollout``, the
  resource gets ``ScaleDownPaused=True`` naming the pools and how far they are, the operator logs
  ``autoscaling paused: rollout`` once when it starts and ``autoscaling resumed`` once it is over);
* **scale-ups go on**, within ``maxReplicas`` as always (the surge is the rollout's, on top, as it is
  without an autoscaler).

Why not shrink: the Deployment controller splits a change of a rolling Deployment's replicas between its
old and new ReplicaSets, and a ReplicaSet removes its pods that are not Ready first. Under the pairing gate
(:mod:`.rollout`) those are the new workers that have loaded their model and wait for a partner of the
other role: a scale-down mid-rollout throws that progress away (a model load, minutes on a GPU), or the
partner the other pool's new worker waits for, and in a pool taken to zero leaves the model no serving
pair at all. It would also be read from signals the rollout disturbs (new workers start with cold
caches). The autoscaler's history keeps its recommendations meanwhile, so the scale-down happens at the
first decision after the rollout if the load asked for it for the whole scale-down window.

Why not a full pause: a GPU rollout takes a model load per surge step, tens of minutes for a large pool,
and refusing capacity under a rising load for that long is what a platform team would not accept (the
HPA, KEDA and Argo Rollouts all keep scaling a rolling workload up). A scale-up keeps the gate's promise:
the new old-revision pods are Ready at once, the new new-revision ones pass the gate like the others.

Pure functions; :mod:`.handlers` applies them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from tandem_operator.autoscale import Decision
from tandem_operator.reconcile import set_condition
from tandem_operator.spec import Pool

#: The resource's condition while scale-downs wait for a rollout.
CONDITION = "ScaleDownPaused"


def rollout_progress(deployment: Mapping[str, Any] | None) -> str | None:
    """How far the Deployment's rollout is (``1 of 3 pods updated``), or None when all its pods are of its
    current template. From the Deployment controller's status: ``replicas`` counts the pods of every
    ReplicaSet, ``updatedReplicas`` those of the current template's (left out when 0, as the API does)."""
    if deployment is None:
        return None
    status = deployment.get("status") or {}
    total = int(status.get("replicas") or 0)
    updated = int(status.get("updatedReplicas") or 0)
    if total <= updated:
        return None
    progress = f"{updated} of {total} pods updated"
    for condition in status.get("conditions") or []:
        if condition.get("type") == "Progressing" and condition.get("reason") == "ProgressDeadlineExceeded":
            progress += ", stalled (ProgressDeadlineExceeded)"
    return progress


def rolling_models(pools: Sequence[Pool], deployments: Mapping[str, Mapping[str, Any] | None]) -> dict[str, str]:
    """Per model with a rolling pool, what is rolling (``prefill: 1 of 3 pods updated``, pools joined by
    ``; ``); ``deployments`` by pool key (None where there is none)."""
    out: dict[str, list[str]] = {}
    for pool in pools:
        progress = rollout_progress(deployments.get(pool.key))
        if progress is not None:
            out.setdefault(pool.model.name, []).append(f"{pool.key}: {progress}")
    return {model: "; ".join(parts) for model, parts in out.items()}


def hold_scale_down(decision: Decision, rollout: str | None) -> Decision:
    """``decision`` unchanged, unless it shrinks the pool while ``rollout`` (its model's, from
    :func:`rolling_models`) is going on: then it holds the pool, saying why and what it would have done."""
    if rollout is None or decision.desired_replicas >= decision.current_replicas:
        return decision
    reason = f"scale down paused: rollout ({rollout}); would go to {decision.desired_replicas}: {decision.reason}"
    return replace(decision, desired_replicas=decision.current_replicas, reason=reason, drivers=())


def paused_condition(
    conditions: list[dict[str, Any]], rolling: Mapping[str, str], now: str, generation: int
) -> list[dict[str, Any]] | None:
    """``conditions`` with :data:`CONDITION` set from ``rolling`` (:func:`rolling_models`), or None when
    it would not change. The condition appears with the first rollout (absent: none seen yet); after one,
    it stays, False."""
    previous = next((c for c in conditions if c.get("type") == CONDITION), None)
    if rolling:
        status, reason = True, "Rollout"
        message = "; ".join(
            f"model {model} rolls a new revision ({what}): its pools' scale-downs wait for the rollout, scale-ups go on"
            for model, what in sorted(rolling.items())
        )
    elif previous is None:
        return None
    else:
        status, reason, message = False, "NoRollout", "no pool is rolling: the autoscaler scales both ways"
    if previous is not None and previous.get("status") == str(status) and previous.get("message") == message:
        return None
    return set_condition(
        conditions, type_=CONDITION, status=status, reason=reason, message=message, now=now, generation=generation
    )
