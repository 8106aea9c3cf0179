"""kopf handlers for ``TandemDeployment``; loaded by ``kopf run -m tandem_operator.handlers``.

Thin on purpose: each handler parses the spec (:mod:`.spec`), asks a pure
function what should be (:mod:`.reconcile`, :mod:`.autoscale`), applies it
through :class:`.kube.KubeClient` and writes the answer into ``status``.

* create / update / resume → every pool's Deployment and Service applied (each
  model's prefill and decode pools), pools of a model no longer in the spec
  deleted, ``spec.adapters`` synced into the adapter catalog
  (:mod:`.adapters`), status ``pools``, ``adapters`` and conditions
  ``SpecValid``, ``Reconciled``, ``Ready`` (and ``AdaptersReconciled`` when the
  resource has adapters). A malformed resource (also: duplicate model names, an
  adapter of an unknown model, a hostile name) gets ``SpecValid=False`` with
  the reason and is left alone until it changes (no retry loop, no crash); so
  does one whose pool names are taken by Deployments it does not own
  (``Reconciled=False``, ``NameConflict``: nothing of the other is touched).
* timer → every ``STATUS_REFRESH_S`` the pools' ready counts and the ``Ready``
  condition are refreshed in ``status`` (``kubectl get tandemdeployment`` shows
  what is ready now, not what was at the last change); every
  ``adapter_resync_s`` (settings) the adapters are synced again (Redis back after an
  outage, an admin's unload of a managed adapter undone); every
  ``autoscaling.intervalSeconds`` each pool's signals (its model's) are read and the decision
  applied to its Deployment's replicas; every decision is logged as one JSON
  line (``tandem.autoscale``). While a model's pools roll a new revision, their
  scale-downs wait (:mod:`.rollout_pause`, condition ``ScaleDownPaused``).
* timer → every ``PAIRING_INTERVAL_S`` the pools' new pods of a revision being rolled out are marked
  paired once the other role's of the same revision serve (:mod:`.rollout`): prefill and decode roll
  together.
* delete → the pools' Deployments and Services are deleted (the owner
  references would let the garbage collector do it too; this makes it
  immediate), and the adapters the resource managed are removed from the
  catalog (best effort: with Redis down they stay, and the deletion is not
  held up). Deleting a Deployment sends SIGTERM to its workers, which
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

from tandem.common import redis_retry
from tandem.common.adapters import AdapterCatalog
from tandem.common.errors import BackendUnavailableError
from tandem_operator.adapters import remove_managed, sync_adapters
from tandem_operator.autoscale import Recommendation, decide
from tandem_operator.kube import KubeClient, KubeError
from tandem_operator.reconcile import (
    Owner,
    conflict_status,
    decision_status,
    desired_objects,
    foreign_pools,
    invalid_status,
    observed_pools,
    owned_names,
    ready_condition,
    reconciled_status,
    set_condition,
    stale_names,
)
from tandem_operator.resources import LABEL_DEPLOYMENT, LABEL_MODEL
from tandem_operator.rollout import paired_status_patch, pod_state, pods_to_pair, revision_changed
from tandem_operator.rollout_pause import CONDITION as PAUSED
from tandem_operator.rollout_pause import hold_scale_down, paused_condition, rolling_models
from tandem_operator.settings import OperatorSettings
from tandem_operator.signals import (
    CounterRates,
    PrometheusSource,
    QueryScope,
    RouterService,
    RouterSource,
    SignalSource,
)
from tandem_operator.spec import GROUP, PLURAL, VERSION, Pool, SpecError, TandemSpec, parse_spec

FINALIZER = "tandem.dev/cleanup"
_Logger = logging.Logger | logging.LoggerAdapter[Any]
decision_logger = logging.getLogger("tandem.autoscale")

# kopf decorators are evaluated at import, so the timer's tick is read then;
# each resource's own interval is enforced inside the handler. Everything else
# is read once per operator run, at login/startup, into ``memo.settings``.
_TICK_S = OperatorSettings().tick_s
#: How often the timer refreshes a resource's status.pools and Ready condition.
STATUS_REFRESH_S = 5.0
#: How often the pairing timer looks at the pools' pods (a new worker waits at most this long to be Ready).
PAIRING_INTERVAL_S = 2.0


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
    memo.redis = redis_retry.connect(cfg.redis_url, timeout_s=2.0) if cfg.redis_url else None
    memo.history = {}
    memo.last_decision_s = {}
    memo.last_status_s = {}
    memo.last_adapter_sync_s = {}
    # The router source's counter readings (the prefill demand's rate), across the ticks' sources.
    memo.counter_rates = CounterRates()


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    await memo.kube.close()
    await memo.http.close()
    if memo.redis is not None:
        await memo.redis.aclose()


async def _deployments(kube: KubeClient, namespace: str, name: str, td: TandemSpec) -> dict[str, dict[str, Any] | None]:
    """Each pool's Deployment (None where there is none yet), by pool key."""
    return {pool.key: await kube.get("apps/v1", "Deployment", namespace, pool.name(name)) for pool in td.pools_of()}


async def _delete_stale_pools(kube: KubeClient, owner: Owner, td: TandemSpec, logger: _Logger) -> None:
    """Delete the pools of models the spec no longer has (only Deployments this resource owns)."""
    listed = await kube.list("apps/v1", "Deployment", owner.namespace, f"{LABEL_DEPLOYMENT}={owner.name}")
    owned = [
        d for d in listed
        if (d.get("metadata", {}).get("labels") or {}).get(LABEL_DEPLOYMENT) == owner.name
        and any(ref.get("uid") == owner.uid for ref in d.get("metadata", {}).get("ownerReferences") or [])
    ]
    for stale in stale_names(owner.name, owned, td.pools_of()):
        for api_version, kind in (("apps/v1", "Deployment"), ("v1", "Service")):
            if await kube.delete(api_version, kind, owner.namespace, stale):
                logger.info("deleted %s %s/%s: its model is no longer in the spec", kind, owner.namespace, stale)


def _owned(dep: dict[str, Any] | None, uid: str) -> dict[str, Any] | None:
    """``dep`` when this resource owns it, else None (a pool name taken by something else is not ours)."""
    if dep is None:
        return None
    refs = dep.get("metadata", {}).get("ownerReferences") or []
    return dep if any(ref.get("uid") == uid for ref in refs) else None


def _managed_adapters(status: Any) -> list[str]:
    managed = (status.get("adapters") or {}).get("managed") or []
    return [str(n) for n in managed if isinstance(n, str)]


async def _sync_adapters(
    td: TandemSpec, status: Any, patch: kopf.Patch, memo: Any, generation: int, logger: _Logger
) -> None:
    """Sync ``spec.adapters`` into the catalog; status ``adapters`` and the AdaptersReconciled condition.
    A resource that never had adapters is left without either."""
    managed = _managed_adapters(status)
    if not td.adapters and not managed:
        return
    conditions = list(patch.status.get("conditions") or status.get("conditions", []))
    if memo.redis is None:
        ok, reason, message = False, "NoRedis", "the operator has no Redis URL (TANDEM_OPERATOR_REDIS_URL)"
    else:
        catalog = AdapterCatalog(memo.redis, key_prefix=td.redis.key_prefix)
        try:
            done = await sync_adapters(catalog, td.adapters, managed, now_unix_s=time.time())
        except BackendUnavailableError as exc:
            ok, reason, message = False, "CatalogUnavailable", str(exc)
        else:
            ok, reason = True, "Synced"
            message = f"{len(done.versions)} adapters in the catalog"
            if done.put or done.removed:
                logger.info("adapters put %s, removed %s", done.put, done.removed)
            old_versions = dict((status.get("adapters") or {}).get("versions") or {})
            if done.managed != managed or done.versions != old_versions:
                # A merge patch: a name gone from the versions is removed by writing it as null.
                gone: dict[str, int | None] = {name: None for name in old_versions if name not in done.versions}
                patch.status["adapters"] = {"managed": done.managed, "versions": {**gone, **done.versions}}
    previous: dict[str, Any] = next((c for c in conditions if c.get("type") == "AdaptersReconciled"), {})
    if previous.get("status") == ("True" if ok else "False") and previous.get("message") == message:
        return
    if not ok:
        logger.warning("adapters not reconciled: %s", message)
    patch.status["conditions"] = set_condition(conditions, type_="AdaptersReconciled", status=ok, reason=reason,
                                               message=message, now=_now(), generation=generation)


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
        existing = await _deployments(kube, namespace, name, td)
        taken = foreign_pools(owner, existing)
        if taken:
            logger.error("not reconciling %s/%s: pool names taken: %s", namespace, name, taken)
            patch.status.update(conflict_status(owner, taken, conditions, _now()))
            return  # like an invalid spec: until the resource changes
        current = {
            key: None if dep is None else int((dep.get("spec") or {}).get("replicas", 0))
            for key, dep in existing.items()
        }
        keys = {pool.name(name): pool.key for pool in td.pools_of()}
        for obj in desired_objects(owner, td, current, existing):
            key = keys.get(obj["metadata"]["name"]) if obj["kind"] == "Deployment" else None
            if key is not None and revision_changed(obj, existing.get(key)):
                logger.info("pool %s rolls to a new revision (image, model, dtype or TP size): its new workers "
                            "turn Ready once the other role's of the same revision serve", key)
            await kube.apply(obj)
        await _delete_stale_pools(kube, owner, td, logger)
        deployments = await _deployments(kube, namespace, name, td)
    except KubeError as exc:
        raise kopf.TemporaryError(str(exc), delay=memo.settings.retry_delay_s) from exc
    patch.status.update(reconciled_status(owner, td, deployments, conditions, _now()))
    await _sync_adapters(td, status, patch, memo, owner.generation, logger)
    memo.last_adapter_sync_s[(namespace, name)] = time.monotonic()


def _source(
    td: TandemSpec, namespace: str, name: str, http: aiohttp.ClientSession, kube: KubeClient, rates: CounterRates
) -> SignalSource:
    """The resource's signal source; its ``read(pool)`` selects that pool's model and pods, and only this
    resource's router and gateway series (their Services)."""
    spec = td.autoscaling
    if spec.source == "router":
        service = RouterService(kube, namespace, spec.router_metrics_service) if spec.router_metrics_service else None
        return RouterSource(spec.router_metrics_url, http, service, rates=rates, rates_key=f"{namespace}/{name}")
    scope = QueryScope(namespace, name, router_service=spec.router_metrics_service,
                       gateway_service=spec.gateway_metrics_service)
    return PrometheusSource(spec.prometheus_url, scope, http)


@kopf.timer(GROUP, VERSION, PLURAL, interval=_TICK_S, idle=0)
async def autoscale_handler(
    *, name: str, namespace: str | None, uid: str, meta: Any, spec: Any, status: Any, patch: kopf.Patch, memo: Any,
    logger: _Logger, **_: Any,
) -> None:
    assert namespace is not None
    try:
        td = parse_spec(spec)
    except SpecError:
        return  # the reconcile handler reports it
    reconciled: dict[str, Any] = next((c for c in status.get("conditions", []) if c.get("type") == "Reconciled"), {})
    if reconciled.get("reason") == "NameConflict":
        return  # the pools of that name are not this resource's: neither report nor scale them
    key = (namespace, name)
    now_s = time.monotonic()
    if now_s - memo.last_status_s.get(key, -1e9) >= STATUS_REFRESH_S:
        memo.last_status_s[key] = now_s
        await _refresh_status(memo.kube, namespace, name, uid, td, meta, status, patch)
    # The first sync is the reconcile handler's (the timer's view of the conditions may predate it).
    resync_s = memo.settings.adapter_resync_s
    if reconciled.get("status") == "True" and now_s - memo.last_adapter_sync_s.get(key, -1e9) >= resync_s:
        memo.last_adapter_sync_s[key] = now_s
        await _sync_adapters(td, status, patch, memo, int(meta.get("generation") or 0), logger)
    if td.autoscaling.external or not td.autoscaling.enabled:
        return  # HPA/KEDA or nobody: the status above is all this timer does
    if now_s - memo.last_decision_s.get(key, -1e9) < td.autoscaling.interval_seconds:
        return
    memo.last_decision_s[key] = now_s
    kube: KubeClient = memo.kube
    source = _source(td, namespace, name, memo.http, kube, memo.counter_rates)
    entries: dict[str, Any] = {}
    num_with_metrics = 0
    without_metrics: list[str] = []
    unread: set[str] = set()
    try:
        deps = {p.key: _owned(await kube.get("apps/v1", "Deployment", namespace, p.name(name)), uid)
                for p in td.pools_of()}
        rolling = rolling_models(td.pools_of(), deps)  # scale-downs of a rolling model's pools wait
        for pool in td.pools_of():
            role = pool.role
            dep_name = pool.name(name)
            dep = deps[pool.key]
            if dep is None:
                continue  # not reconciled yet, or the name is taken by something else
            current = int((dep.get("spec") or {}).get("replicas", 0))
            ready = int((dep.get("status") or {}).get("readyReplicas", 0) or 0)
            signals = await source.read(pool, dep_name)
            unread.update(signals.unread_from)
            history: tuple[Recommendation, ...] = memo.history.get((namespace, name, pool.key), ())
            decision, history = decide(
                role=role, current_replicas=current, signals=signals, pool=pool.spec,
                policy=td.autoscaling, slo=td.slo, history=history, now_s=now_s, ready_replicas=ready,
            )
            memo.history[(namespace, name, pool.key)] = history
            decision = hold_scale_down(decision, rolling.get(pool.model.name))
            num_with_metrics += bool(decision.votes)
            if not decision.votes:
                without_metrics.append(pool.key)
            decision_logger.info(json.dumps({
                "event": "autoscale_decision", "namespace": namespace, "name": name, "role": role,
                "model": pool.model.name, "pool": dep_name,
                "current": decision.current_replicas, "desired": decision.desired_replicas,
                "raw": decision.raw_replicas, "votes": decision.votes, "reason": decision.reason,
                "step": decision.step,
                "signals": {k: v for k, v in vars(signals).items() if v is not None and v != ()},
            }))
            if decision.changed:
                await kube.patch("apps/v1", "Deployment", namespace, dep_name,
                                 {"spec": {"replicas": decision.desired_replicas}})
                logger.info("%s pool %s: %s", pool.key, decision.step, decision.reason)
            previous = (status.get("autoscaling") or {}).get(pool.key) or {}
            entry = decision_status(decision, _now())
            if all(previous.get(k) == entry[k] for k in ("currentReplicas", "desiredReplicas", "reason")):
                continue  # nothing new: keep status writes rare
            entries[pool.key] = entry
    except KubeError as exc:
        raise kopf.TemporaryError(str(exc), delay=memo.settings.retry_delay_s) from exc
    _set_metrics_condition(td, status, patch, without_metrics, sorted(unread), int(meta.get("generation") or 0))
    _set_paused_condition(rolling, status, patch, int(meta.get("generation") or 0), logger)
    if entries:
        entries["metricsAvailable"] = num_with_metrics > 0
        entries["source"] = td.autoscaling.source
        patch.status["autoscaling"] = entries


@kopf.timer(GROUP, VERSION, PLURAL, interval=PAIRING_INTERVAL_S, idle=0)
async def pairing_handler(*, name: str, namespace: str | None, memo: Any, logger: _Logger, **_: Any) -> None:
    """Sets the pairing condition on the pools' new pods whose partner of the other role serves
    (:func:`tandem_operator.rollout.pods_to_pair`, per model), so a rollout takes an old worker away only
    once a pair of the new revision serves."""
    assert namespace is not None
    kube: KubeClient = memo.kube
    try:
        pods = await kube.list("v1", "Pod", namespace, f"{LABEL_DEPLOYMENT}={name}")
        by_model: dict[str, list[dict[str, Any]]] = {}
        for pod in pods:
            by_model.setdefault(((pod.get("metadata") or {}).get("labels") or {}).get(LABEL_MODEL, ""), []).append(pod)
        for model_pods in by_model.values():
            by_name = {str(p["metadata"]["name"]): p for p in model_pods}
            for pod_name in pods_to_pair([pod_state(p) for p in model_pods]):
                changes = paired_status_patch(by_name[pod_name], _now())
                await kube.patch_status("v1", "Pod", namespace, pod_name, changes)
                logger.info("pod %s paired: a worker of the other role with its revision serves", pod_name)
    except KubeError as exc:
        raise kopf.TemporaryError(str(exc), delay=memo.settings.retry_delay_s) from exc


async def _refresh_status(
    kube: KubeClient, namespace: str, name: str, uid: str, td: TandemSpec, meta: Any, status: Any,
    patch: kopf.Patch,
) -> None:
    """Write status.pools and the Ready condition when what is ready has changed."""
    try:
        deployments = {k: _owned(d, uid) for k, d in (await _deployments(kube, namespace, name, td)).items()}
    except KubeError:
        return  # the next tick tries again; the autoscaler below reports API trouble
    if any(dep is None for dep in deployments.values()):
        return  # not reconciled yet: the reconcile handler writes the first status
    pools = observed_pools(td.pools_of(), deployments)
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
    td: TandemSpec, status: Any, patch: kopf.Patch, without_metrics: list[str], unread: list[str], generation: int
) -> None:
    """MetricsAvailable=False, with the reason, while a pool's source gives no signal at all (its
    replicas then hold) or only part of one (``unread``: router pods that did not answer; reason
    ``PartialSignals``): visible in `kubectl describe`, not only in the operator's log. Written only
    when it changes (the reconcile handler writes the same list)."""
    available = not without_metrics and not unread
    spec = td.autoscaling
    if spec.source == "prometheus":
        where = f"Prometheus at {spec.prometheus_url}"
    elif spec.router_metrics_service:
        where = f"every router pod of the Service {spec.router_metrics_service}"
    else:
        where = f"the router's metrics at {spec.router_metrics_url or '(no URL)'}"
    if available:
        reason, message = "SignalsRead", f"signals from {where}"
    elif unread:
        reason = "PartialSignals"
        message = f"router pods {', '.join(unread)} did not answer: signals from {where} are partial, the pools hold"
    else:
        reason = "NoSignals"
        message = f"no signal for the {' and '.join(without_metrics)} pool from {where}: its replicas hold"
    conditions = list(patch.status.get("conditions") or status.get("conditions", []))
    if not _reconciled(conditions):
        return
    current: dict[str, Any] = next((c for c in conditions if c.get("type") == "MetricsAvailable"), {})
    if current.get("status") == ("True" if available else "False") and current.get("message") == message:
        return
    patch.status["conditions"] = set_condition(
        conditions, type_="MetricsAvailable", status=available,
        reason=reason, message=message, now=_now(), generation=generation,
    )


def _set_paused_condition(
    rolling: dict[str, str], status: Any, patch: kopf.Patch, generation: int, logger: _Logger
) -> None:
    """ScaleDownPaused (:mod:`.rollout_pause`) when it changes; logged when a pause starts and ends."""
    conditions = list(patch.status.get("conditions") or status.get("conditions", []))
    updated = paused_condition(conditions, rolling, _now(), generation) if _reconciled(conditions) else None
    if updated is None:
        return
    was = any(c.get("type") == PAUSED and c.get("status") == "True" for c in conditions)
    if rolling and not was:
        logger.info("autoscaling paused: rollout (scale-downs wait, scale-ups go on): %s", updated[-1]["message"])
    elif was and not rolling:
        logger.info("autoscaling resumed: no pool is rolling, scale-downs allowed again")
    patch.status["conditions"] = updated


def _condition_status(conditions: list[dict[str, Any]]) -> tuple[str, str]:
    ready = next((c for c in conditions if c.get("type") == "Ready"), {})
    return str(ready.get("status", "")), str(ready.get("message", ""))


def _pools_to_delete(spec: Any) -> list[Pool]:
    """The pools of the spec being deleted; a spec that no longer parses still had the single-model
    form's two pools or none (the models form always parses: the API server checked it)."""
    try:
        return parse_spec(spec).pools_of()
    except SpecError:
        return parse_spec(_FALLBACK_SPEC).pools_of()


#: What a resource whose spec no longer parses is deleted as: the single-model form's two pools.
_FALLBACK_SPEC: dict[str, Any] = {
    "model": {"servedModelName": "x", "pvc": {"claimName": "x"}},
    "image": {"repository": "x", "tag": "x"},
    "redis": {"url": "redis://x"},
}


@kopf.on.delete(GROUP, VERSION, PLURAL)
async def delete_handler(
    *, name: str, namespace: str | None, spec: Any, status: Any, memo: Any, logger: _Logger, **_: Any
) -> None:
    assert namespace is not None
    kube: KubeClient = memo.kube
    pools = _pools_to_delete(spec)
    try:
        for api_version, kind, obj_name in owned_names(name, pools):
            if await kube.delete(api_version, kind, namespace, obj_name):
                logger.info("deleted %s %s/%s", kind, namespace, obj_name)
    except KubeError as exc:
        raise kopf.TemporaryError(str(exc), delay=memo.settings.retry_delay_s) from exc
    managed = _managed_adapters(status)
    if managed and memo.redis is not None:
        key_prefix = str((spec.get("redis") or {}).get("keyPrefix") or "tandem")
        try:
            removed = await remove_managed(AdapterCatalog(memo.redis, key_prefix=key_prefix), managed)
            logger.info("removed adapters %s from the catalog", removed)
        except BackendUnavailableError as exc:
            logger.warning("adapters %s left in the catalog (Redis unreachable: %s)", managed, exc)
    for pool in pools:
        memo.history.pop((namespace, name, pool.key), None)
    memo.last_decision_s.pop((namespace, name), None)
    memo.last_status_s.pop((namespace, name), None)
    memo.last_adapter_sync_s.pop((namespace, name), None)
