"""kopf handlers for ``TandemDeployment``; loaded by ``kopf run -m tandem_operator.handlers``.

Thin on purpose: each handler parses the spec (:mod:`.spec`), asks a pure
function what should be (:mod:`.reconcile`, :mod:`.autoscale`), applies it
through :class:`.kube.KubeClient` and writes the answer into ``status``.

* create / update / resume → both pools' Deployment and Service applied,
  status ``pools`` and conditions ``SpecValid``, ``Reconciled``, ``Ready``.
  A malformed resource gets ``SpecValid=False`` with the reason and is left
  alone until it changes (no retry loop, no crash).
* timer → every ``STATUS_REFRESH_S`` the pools' ready counts and the ``Ready``
  condition are refreshed in ``status`` (``kubectl get tandemdeployment`` shows
  what is ready now, not what was at the last change); every
  ``autoscaling.intervalSeconds`` each pool's signals are read and the decision
  applied to its Deployment's replicas; every decision is logged as one JSON
  line (``tandem.autoscale``).
* delete → the pools' Deployments and Services are deleted (the owner
  references would let the garbage collector do it too; this makes it
  immediate). Deleting a Deployment sends SIGTERM to its workers, which
  drain before they exit.
"""

from __future__ import annotations

import datetime
import json
import logging
import time
from typing import Any

import aiohttp
import kopf

from tandem_operator.autoscale import Recommendation, decide
from tandem_operator.kube import KubeClient, KubeError
from tandem_operator.reconcile import (
    Owner,
    decision_status,
    desired_objects,
    invalid_status,
    observed_pool,
    owned_names,
    ready_condition,
    reconciled_status,
    set_condition,
)
from tandem_operator.resources import pool_name
from tandem_operator.settings import OperatorSettings
from tandem_operator.signals import PrometheusSource, QueryScope, RouterSource, SignalSource
from tandem_operator.spec import GROUP, PLURAL, ROLES, VERSION, Role, SpecError, TandemSpec, parse_spec

FINALIZER = "tandem.dev/cleanup"
_Logger = logging.Logger | logging.LoggerAdapter[Any]
decision_logger = logging.getLogger("tandem.autoscale")

# kopf decorators are evaluated at import, so the timer's tick is read then;
# each resource's own interval is enforced inside the handler. Everything else
# is read once per operator run, at login/startup, into ``memo.settings``.
_TICK_S = OperatorSettings().tick_s
#: How often the timer refreshes a resource's status.pools and Ready condition.
STATUS_REFRESH_S = 5.0


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _owner(name: str, namespace: str, uid: str, labels: Any, meta: Any) -> Owner:
    return Owner(name=name, namespace=namespace, uid=uid, labels=dict(labels),
                 generation=int(meta.get("generation") or 0))


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    settings = OperatorSettings()
    if settings.api_server_url:
        return kopf.ConnectionInfo(server=settings.api_server_url, insecure=True)
    if settings.kubernetes_service_host:
        return kopf.login_with_service_account(**kwargs)
    return kopf.login_with_kubeconfig(**kwargs)


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.finalizer = FINALIZER
    settings.posting.level = logging.WARNING
    cfg = OperatorSettings()
    memo.settings = cfg
    if cfg.api_server_url:
        memo.kube = KubeClient(cfg.api_server_url, insecure=True)
    else:
        memo.kube = KubeClient.in_cluster(cfg.kubernetes_service_host, cfg.kubernetes_service_port)
    memo.http = aiohttp.ClientSession()
    memo.history = {}
    memo.last_decision_s = {}
    memo.last_status_s = {}


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    await memo.kube.close()
    await memo.http.close()


async def _current_replicas(kube: KubeClient, owner: Owner) -> dict[Role, int | None]:
    current: dict[Role, int | None] = {}
    for role in ROLES:
        dep = await kube.get("apps/v1", "Deployment", owner.namespace, pool_name(owner.name, role))
        current[role] = None if dep is None else int((dep.get("spec") or {}).get("replicas", 0))
    return current


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
async def reconcile_handler(
    *, name: str, namespace: str | None, uid: str, labels: Any, meta: Any, spec: Any, status: Any,
    patch: kopf.Patch, memo: Any, logger: _Logger, **_: Any,
) -> None:
    assert namespace is not None  # the resource is namespaced
    owner = _owner(name, namespace, uid, labels, meta)
    conditions = list(status.get("conditions", []))
    try:
        td = parse_spec(spec)
    except SpecError as exc:
        logger.error("not reconciling %s/%s: %s", namespace, name, exc)
        patch.status.update(invalid_status(owner, str(exc), conditions, _now()))
        return  # permanent until the resource changes: no retry, no crash loop
    kube: KubeClient = memo.kube
    try:
        current = await _current_replicas(kube, owner)
        for obj in desired_objects(owner, td, current):
            await kube.apply(obj)
        deployments = {
            role: await kube.get("apps/v1", "Deployment", namespace, pool_name(name, role)) for role in ROLES
        }
    except KubeError as exc:
        raise kopf.TemporaryError(str(exc), delay=memo.settings.retry_delay_s) from exc
    patch.status.update(reconciled_status(owner, deployments, conditions, _now()))


def _source(td: TandemSpec, namespace: str, name: str, http: aiohttp.ClientSession) -> SignalSource:
    if td.autoscaling.source == "router":
        return RouterSource(td.autoscaling.router_metrics_url, http)
    return PrometheusSource(td.autoscaling.prometheus_url, QueryScope(namespace, name), http)


@kopf.timer(GROUP, VERSION, PLURAL, interval=_TICK_S, idle=0)
async def autoscale_handler(
    *, name: str, namespace: str | None, meta: Any, spec: Any, status: Any, patch: kopf.Patch, memo: Any,
    logger: _Logger, **_: Any,
) -> None:
    assert namespace is not None
    try:
        td = parse_spec(spec)
    except SpecError:
        return  # the reconcile handler reports it
    key = (namespace, name)
    now_s = time.monotonic()
    if now_s - memo.last_status_s.get(key, -1e9) >= STATUS_REFRESH_S:
        memo.last_status_s[key] = now_s
        await _refresh_status(memo.kube, namespace, name, meta, status, patch)
    if td.autoscaling.external or not td.autoscaling.enabled:
        return  # HPA/KEDA or nobody: the status above is all this timer does
    if now_s - memo.last_decision_s.get(key, -1e9) < td.autoscaling.interval_seconds:
        return
    memo.last_decision_s[key] = now_s
    kube: KubeClient = memo.kube
    source = _source(td, namespace, name, memo.http)
    entries: dict[str, Any] = {}
    num_with_metrics = 0
    without_metrics: list[str] = []
    try:
        for role in ROLES:
            dep_name = pool_name(name, role)
            dep = await kube.get("apps/v1", "Deployment", namespace, dep_name)
            if dep is None:
                continue  # not reconciled yet
            current = int((dep.get("spec") or {}).get("replicas", 0))
            ready = int((dep.get("status") or {}).get("readyReplicas", 0) or 0)
            signals = await source.read(role)
            history: tuple[Recommendation, ...] = memo.history.get((namespace, name, role), ())
            decision, history = decide(
                role=role, current_replicas=current, signals=signals, pool=td.pools.get(role),
                policy=td.autoscaling, slo=td.slo, history=history, now_s=now_s, ready_replicas=ready,
            )
            memo.history[(namespace, name, role)] = history
            num_with_metrics += bool(decision.votes)
            if not decision.votes:
                without_metrics.append(role)
            decision_logger.info(json.dumps({
                "event": "autoscale_decision", "namespace": namespace, "name": name, "role": role,
                "current": decision.current_replicas, "desired": decision.desired_replicas,
                "raw": decision.raw_replicas, "votes": decision.votes, "reason": decision.reason,
                "signals": {k: v for k, v in vars(signals).items() if v is not None},
            }))
            if decision.changed:
                await kube.patch("apps/v1", "Deployment", namespace, dep_name,
                                 {"spec": {"replicas": decision.desired_replicas}})
                logger.info("%s pool %s → %s replicas: %s", role, decision.current_replicas,
                            decision.desired_replicas, decision.reason)
            previous = (status.get("autoscaling") or {}).get(role) or {}
            entry = decision_status(decision, _now())
            if all(previous.get(k) == entry[k] for k in ("currentReplicas", "desiredReplicas", "reason")):
                continue  # nothing new: keep status writes rare
            entries[role] = entry
    except KubeError as exc:
        raise kopf.TemporaryError(str(exc), delay=memo.settings.retry_delay_s) from exc
    _set_metrics_condition(td, status, patch, without_metrics, int(meta.get("generation") or 0))
    if entries:
        entries["metricsAvailable"] = num_with_metrics > 0
        entries["source"] = td.autoscaling.source
        patch.status["autoscaling"] = entries


async def _refresh_status(
    kube: KubeClient, namespace: str, name: str, meta: Any, status: Any, patch: kopf.Patch
) -> None:
    """Write status.pools and the Ready condition when what is ready has changed."""
    try:
        deployments = {role: await kube.get("apps/v1", "Deployment", namespace, pool_name(name, role))
                       for role in ROLES}
    except KubeError:
        return  # the next tick tries again; the autoscaler below reports API trouble
    if any(dep is None for dep in deployments.values()):
        return  # not reconciled yet: the reconcile handler writes the first status
    pools = {role: observed_pool(dep) for role, dep in deployments.items()}
    conditions = list(status.get("conditions", []))
    if pools != status.get("pools"):
        patch.status["pools"] = pools
    if not _reconciled(conditions):
        return  # the list is the reconcile handler's to start; writing it from an older view would lose its
    updated = ready_condition(conditions, pools, _now(), int(meta.get("generation") or 0))
    if _condition_status(updated) != _condition_status(conditions):
        patch.status["conditions"] = updated


def _reconciled(conditions: list[dict[str, Any]]) -> bool:
    """The reconcile handler has written its conditions (the timer only updates a list it has seen)."""
    return any(c.get("type") == "SpecValid" for c in conditions)


def _set_metrics_condition(
    td: TandemSpec, status: Any, patch: kopf.Patch, without_metrics: list[str], generation: int
) -> None:
    """MetricsAvailable=False, with the reason, while a pool's source gives no signal at all (its
    replicas then hold): visible in `kubectl describe`, not only in the operator's log. Written only
    when it changes (the reconcile handler writes the same list)."""
    available = not without_metrics
    if td.autoscaling.source == "prometheus":
        where = f"Prometheus at {td.autoscaling.prometheus_url}"
    else:
        where = f"the router's metrics at {td.autoscaling.router_metrics_url or '(no URL)'}"
    message = (
        f"signals from {where}"
        if available
        else f"no signal for the {' and '.join(without_metrics)} pool from {where}: its replicas hold"
    )
    conditions = list(patch.status.get("conditions") or status.get("conditions", []))
    if not _reconciled(conditions):
        return
    current: dict[str, Any] = next((c for c in conditions if c.get("type") == "MetricsAvailable"), {})
    if current.get("status") == ("True" if available else "False") and current.get("message") == message:
        return
    patch.status["conditions"] = set_condition(
        conditions, type_="MetricsAvailable", status=available,
        reason="SignalsRead" if available else "NoSignals", message=message, now=_now(), generation=generation,
    )


def _condition_status(conditions: list[dict[str, Any]]) -> tuple[str, str]:
    ready = next((c for c in conditions if c.get("type") == "Ready"), {})
    return str(ready.get("status", "")), str(ready.get("message", ""))


@kopf.on.delete(GROUP, VERSION, PLURAL)
async def delete_handler(*, name: str, namespace: str | None, memo: Any, logger: _Logger, **_: Any) -> None:
    assert namespace is not None
    kube: KubeClient = memo.kube
    try:
        for api_version, kind, obj_name in owned_names(name):
            if await kube.delete(api_version, kind, namespace, obj_name):
                logger.info("deleted %s %s/%s", kind, namespace, obj_name)
    except KubeError as exc:
        raise kopf.TemporaryError(str(exc), delay=memo.settings.retry_delay_s) from exc
    for role in ROLES:
        memo.history.pop((namespace, name, role), None)
    memo.last_decision_s.pop((namespace, name), None)
    memo.last_status_s.pop((namespace, name), None)
