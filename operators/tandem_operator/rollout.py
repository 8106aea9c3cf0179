"""Prefill and decode of a new revision roll together: at every step some revision has a prefill and a
decode worker serving.

A worker's KV-layout fingerprint (``tandem.common.kv_fingerprint``) follows from its image, its model
(folder, declared revision, the volume or init container that fills it), its dtype and its
tensor-parallel size; the router pairs only workers of equal fingerprints (``tandem.router.pairing``).
Each pool is a Deployment that rolls on its own: with ``maxSurge 1 / maxUnavailable 0`` it takes an old
pod away as soon as one new pod is Ready. Left alone, the faster pool finishes first, and for as long
as the slower one's new workers take to load their model (minutes on a GPU) no revision has both roles:
the router then runs every request on decode workers alone (local prefills), correct but slow.

So the operator holds the step that removes an old worker. :func:`pod_revision` reads a pod's revision
from what its template says (the same function for a Deployment's template, so the operator sees a
revision change, :func:`revision_changed`). When a pool's template changes revision, the Deployment
gets a readiness gate (:data:`PAIRED_CONDITION`, :func:`with_pairing_gate`): its new pods are not Ready,
and the Deployment controller removes no old pod, until the operator sets that condition. It sets it
(:func:`pods_to_pair`, run by the operator's timer) on a pod whose containers are ready once the other
role has a pod of the same revision whose containers are ready too, or when no Ready pair of another
revision is left to protect (a pool at zero, a fresh scale-up). Both pools roll at once, each with its own
``rollout.maxSurge`` / ``maxUnavailable`` and at its own replica count, so the P:D ratio stays what the
autoscaler set; the gate only orders the step that removes old workers.

The gate is added only when a revision changes (and kept once there), so an operator upgrade rolls no
pod of an unchanged pool. With ``maxSurge 0`` on a pool of one replica nothing can keep an old worker of
that pool: the router's local prefills carry the requests while it is replaced (see docs/kubernetes.md).
Pure functions over plain dicts; :mod:`tandem_operator.handlers` reads and patches the objects.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: The pod condition the operator sets (and the readiness gate waits for).
PAIRED_CONDITION = "tandem.dev/paired"
#: Pod label with the pool's role (``tandem_operator.resources.LABEL_POOL``).
LABEL_ROLE = "tandem.dev/pool"
#: Worker settings that change a worker's KV fingerprint, besides the image and the model's source.
REVISION_ENV = (
    "TANDEM_WORKER_ENGINE__MODEL_DIR",
    "TANDEM_WORKER_ENGINE__MODEL_REVISION",
    "TANDEM_WORKER_ENGINE__SERVED_MODEL_NAME",
    "TANDEM_WORKER_ENGINE__DTYPE",
    "TANDEM_WORKER_ENGINE__TENSOR_PARALLEL_SIZE",
)
#: The worker container's name (``tandem_operator.resources``).
WORKER_CONTAINER = "worker"


def pod_revision(pod_spec: Mapping[str, Any]) -> str:
    """A short digest of what, in a pod's spec, decides its workers' KV fingerprint: the worker image, the
    :data:`REVISION_ENV` values (the last of a name wins, as in Kubernetes), the init containers that
    fill the model folder and the model volume."""
    containers = list(pod_spec.get("containers") or [])
    worker = next((c for c in containers if c.get("name") == WORKER_CONTAINER), containers[0] if containers else {})
    env: dict[str, str] = {}
    for item in worker.get("env") or []:
        env[str(item.get("name"))] = str(item.get("value", ""))
    facts = {
        "image": worker.get("image", ""),
        "env": {name: env.get(name, "") for name in REVISION_ENV},
        "init": [[c.get("image", ""), c.get("command") or []] for c in pod_spec.get("initContainers") or []],
        "model_volume": next((v for v in pod_spec.get("volumes") or [] if v.get("name") == "model"), None),
    }
    canonical = json.dumps(facts, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]


def _template_spec(deployment: Mapping[str, Any]) -> Mapping[str, Any]:
    return ((deployment.get("spec") or {}).get("template") or {}).get("spec") or {}


def revision_changed(desired: Mapping[str, Any], live: Mapping[str, Any] | None) -> bool:
    """Whether applying ``desired`` over the ``live`` Deployment starts workers of another revision."""
    return live is not None and pod_revision(_template_spec(desired)) != pod_revision(_template_spec(live))


def _has_gate(pod_spec: Mapping[str, Any]) -> bool:
    return any(g.get("conditionType") == PAIRED_CONDITION for g in pod_spec.get("readinessGates") or [])


def with_pairing_gate(desired: dict[str, Any], live: Mapping[str, Any] | None) -> dict[str, Any]:
    """``desired`` with the pairing readiness gate in its pod template when its revision changes from
    ``live``'s or ``live`` has the gate already (kept: removing it would roll the pool again); else
    ``desired`` unchanged (a new pool, or an unchanged one: nothing to protect)."""
    if not (revision_changed(desired, live) or (live is not None and _has_gate(_template_spec(live)))):
        return desired
    gated = copy.deepcopy(desired)
    pod_spec = gated["spec"]["template"]["spec"]
    pod_spec["readinessGates"] = [{"conditionType": PAIRED_CONDITION}]
    return gated


@dataclass(frozen=True)
class PodState:
    """What pairing needs of one worker pod."""

    name: str
    role: str
    revision: str
    #: Its containers are ready (the worker's gRPC health is SERVING: its engine is up and registered).
    containers_ready: bool
    #: The pod is Ready (its readiness gates included).
    ready: bool
    #: Its template has the pairing gate, and the condition is not True yet.
    waiting: bool


def pod_state(pod: Mapping[str, Any]) -> PodState:
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    conditions = {c.get("type"): c.get("status") == "True" for c in status.get("conditions") or []}
    return PodState(
        name=str(meta.get("name", "")),
        role=str((meta.get("labels") or {}).get(LABEL_ROLE, "")),
        revision=pod_revision(spec),
        containers_ready=conditions.get("ContainersReady", False),
        ready=conditions.get("Ready", False),
        waiting=_has_gate(spec) and not conditions.get(PAIRED_CONDITION, False) and not meta.get("deletionTimestamp"),
    )


def pods_to_pair(pods: Sequence[PodState]) -> list[str]:
    """Names of the pods (one model's pools, both roles) whose :data:`PAIRED_CONDITION` the operator sets
    now: each waiting pod whose containers are ready, once the other role has a pod of its revision whose
    containers are ready, or when no Ready pair of another revision is left (nothing to keep serving)."""
    out = []
    for pod in pods:
        if not (pod.waiting and pod.containers_ready):
            continue
        others = [o for o in pods if o.role and o.role != pod.role]
        partner = any(o.revision == pod.revision and o.containers_ready for o in others)
        # A Ready pair of another revision that taking an old pod of this role away could break (pools
        # whose revisions never match, e.g. another dtype per role, have none: they are not held).
        own_ready = {o.revision for o in pods if o.role == pod.role and o.ready}
        old_pair_left = any(o.revision != pod.revision and o.ready and o.revision in own_ready for o in others)
        if partner or not old_pair_left:
            out.append(pod.name)
    return sorted(out)


def paired_status_patch(pod: Mapping[str, Any], now: str) -> dict[str, Any]:
    """A merge patch of ``pod``'s status that sets :data:`PAIRED_CONDITION` True (a merge patch replaces the
    whole list: the pod's other conditions are sent back as they were read)."""
    kept = [c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") != PAIRED_CONDITION]
    condition = {
        "type": PAIRED_CONDITION,
        "status": "True",
        "reason": "PartnerReady",
        "message": "a worker of the other role with this revision is serving (or no other revision is)",
        "lastTransitionTime": now,
    }
    return {"status": {"conditions": [*kept, condition]}}
