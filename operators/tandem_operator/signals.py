"""Where the autoscaler's :class:`~tandem_operator.autoscale.PoolSignals` come from.

:mod:`tandem_operator.handlers` picks a :class:`SignalSource` by the
resource's ``autoscaling.source`` and calls :meth:`SignalSource.read` on every
autoscaling tick. Two implementations:

* :class:`PrometheusSource` — instant PromQL queries against Prometheus's HTTP
  API (the metrics of the gateway, the router and the workers scraped by the
  chart's ServiceMonitor/PodMonitor);
* :class:`RouterSource` — reads the router's Prometheus text endpoint directly
  (the router's queue and token backlog, and the prefill demand's rate from its
  counter's readings over the last minute, :class:`CounterRates`; no latency, no
  KV usage, no decode token rate: those are the gateway's and the workers'), for
  clusters without Prometheus: with ``autoscaling.routerMetricsService`` set,
  every ready router pod listed in that Service's EndpointSlices
  (:mod:`tandem_operator.endpoints`), summed; without it, the one
  ``routerMetricsUrl`` (local mode, tests).

Every router pod, summed: each Ray node exports only its own router replicas'
series, and a request is counted by the one replica that holds it, so queue
depths, queued and in-flight token backlogs and requests in flight are
additive over pods and replicas. The one gauge that is not, the pool's budget
in use, is every replica's view of the whole pool: it is averaged over all
replicas of all pods (summing would count the pool once per replica). A pod
that does not answer makes the read *partial*: the pool's router signals are
then ``None`` (its replicas hold; ``MetricsAvailable=False`` names the pod, and
a warning is logged) rather than a sum short of that pod's queue, which would
read as less load than there is and could shrink a busy pool.

Per release: two releases in one namespace each see only their own series.
Prometheus labels what a ServiceMonitor scrapes with ``service`` (the Service's
name): the router's and the gateway's series are selected by
``autoscaling.routerMetricsService`` / ``gatewayMetricsService`` (the chart sets
both to the release's Services; unset, by namespace alone). The workers' (a
PodMonitor's) by their pod names, which begin with the pool Deployment's name.

Names are the real exported ones: Ray prefixes the router's application
metrics with ``ray_`` (a test reads them from a real Ray Serve router and
parses them here). Both pools read their pending demand: requests the router
refused because the pool had no worker at all (it is at zero), which starts
it. Each pool reads its own quantities: prefill the uncached
prompt tokens on prefill workers, the requests placed on them and those waiting
for prefill budget, and the rate at which uncached prompt tokens headed for it
arrive (``token_rate``: the router counts each request once as it arrives, placed
at once or queued; the tokens *placed* run at most at the pool's capacity, so a
vote from them asked for exactly the replicas there were); decode the budget in use on decode workers (what the
router's admission check counts), the requests placed on them, those waiting for
decode budget or in the decode engines' own queues, and their KV usage. Nothing
of one pool feeds the other's vote.

Per model: a pool of the models form reads only its model's series. The
workers' (vLLM's) series are selected by the pool's pod names; the router's
and the gateway's by their ``model`` label (the served model name), so a
router or gateway that does not label a series by model gives that model's
pools no signal from it (they hold on the others; ``MetricsAvailable`` says
which pool has none) rather than every model's load. The single-model form
reads the series unlabelled, as it always has.

A signal that cannot be read is ``None``; the decision then rests on the
others (and holds when none is left). Network errors are logged here, not
raised: a flaky Prometheus must not crash-loop the operator.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tandem_operator.autoscale import PoolSignals
from tandem_operator.endpoints import SERVICE_NAME_LABEL, MetricsEndpoint, ready_metrics_urls
from tandem_operator.kube import KubeError
from tandem_operator.spec import Pool, Role

logger = logging.getLogger(__name__)

_TIMEOUT = aiohttp.ClientTimeout(total=5.0)

#: The router's series as Prometheus stores them (Ray's export adds the ``ray_`` prefix).
PREFILL_TOKENS_IN_FLIGHT = "ray_tandem_router_prefill_tokens_in_flight"
QUEUED_REQUESTS = "ray_tandem_router_queued_requests"
QUEUED_UNCACHED_TOKENS = "ray_tandem_router_queued_uncached_tokens"
POOL_BUDGET_USED = "ray_tandem_router_pool_budget_used_fraction"
POOL_IN_FLIGHT = "ray_tandem_router_pool_in_flight_requests"
#: Requests refused because the pool had no worker (it is at zero), within the router's window.
PENDING_DEMAND = "ray_tandem_router_pending_demand"
#: Uncached prompt tokens placed on prefill workers (a counter; absent until the first such placement): the
#: pool's throughput, at most its capacity. Not read by the autoscaler (it is no demand once the pool is full).
PREFILL_UNCACHED_TOKENS = "ray_tandem_router_prefill_uncached_tokens_total"
#: Uncached prompt tokens of the requests headed for prefill workers, counted as each arrives (placed at once or
#: queued; a counter, absent until the first): the prefill pool's demand, the ``token_rate`` signal.
PREFILL_ARRIVED_UNCACHED_TOKENS = "ray_tandem_router_prefill_arrived_uncached_tokens_total"
#: The window of the demand's rate: PromQL's ``rate(...[1m])``, and the router source's readings alike.
TOKEN_RATE_WINDOW_S = 60.0
#: The label of the router's and the gateway's series that names the model (the served model name).
MODEL_LABEL = "model"
#: The label Prometheus puts on every series a ServiceMonitor scrapes: the Service's name.
SERVICE_LABEL = "service"
#: A pool Deployment's pods: ``<deployment>-<pod-template-hash>-<suffix>`` (neither part holds a dash), so
#: the pods of a pool whose name merely begins with this one's (``a-prefill-b-decode``) are not its own.
_POD_SUFFIX = "-[a-z0-9]+-[a-z0-9]+"


def _model_of(pool: Pool) -> str | None:
    """The model label value to select, or None (single-model form: the series unlabelled)."""
    return None if pool.model.slug is None else pool.model.name


class SignalSource(Protocol):
    async def read(self, pool: Pool, pool_name: str) -> PoolSignals:
        """The current signals of ``pool`` (its Deployment is ``pool_name``); fields it cannot read stay ``None``."""
        ...


@dataclass(frozen=True)
class QueryScope:
    """Which series belong to this TandemDeployment."""

    namespace: str
    deployment_name: str
    #: The router's metrics Service (label ``service``); "" = every router series of the namespace.
    router_service: str = ""
    #: The gateway's metrics Service (label ``service``); "" = every gateway series of the namespace.
    gateway_service: str = ""

    def queries(self, role: Role, *, model: str | None = None, pool_name: str | None = None) -> dict[str, str]:
        """PromQL per signal of one pool: ``pool_name`` (default ``<deployment>-<role>``) selects the
        workers' pods, ``model`` (None: no selection) the router's and the gateway's series."""
        pod_ns = f'namespace="{self.namespace}"'
        by_model = "" if model is None else f',{MODEL_LABEL}="{model}"'  # MODEL_NAME allows no quote or backslash
        ns = pod_ns + by_model + (f',{SERVICE_LABEL}="{self.router_service}"' if self.router_service else "")
        gateway = pod_ns + by_model + (f',{SERVICE_LABEL}="{self.gateway_service}"' if self.gateway_service else "")
        pods = f'pod=~"{pool_name or f"{self.deployment_name}-{role}"}{_POD_SUFFIX}"'
        waiting = f'{QUEUED_REQUESTS}{{{ns},waiting_for="{role}"}}'
        # Every router replica sees the whole pool's budget (its own and the others' reservations): the
        # average over replicas; each counts only the requests it placed itself: the sum.
        in_flight = f'sum({POOL_IN_FLIGHT}{{{ns},role="{role}"}})'
        # Absent (no refusal lately, Ray dropped the series) reads as no signal, not as zero.
        pending = f'sum({PENDING_DEMAND}{{{ns},role="{role}"}})'
        if role == "prefill":
            return {
                "pending_demand": pending,
                "queue_depth": f"sum({waiting})",
                "in_flight": in_flight,
                # A router at rest publishes zeros, so the in-flight sum exists whenever a router runs.
                "uncached_tokens": (
                    f"sum({PREFILL_TOKENS_IN_FLIGHT}{{{ns}}}) "
                    f'+ (sum({QUEUED_UNCACHED_TOKENS}{{{ns},waiting_for="prefill"}}) or vector(0))'
                ),
                "ttft_p90_s": (
                    "histogram_quantile(0.9, sum by (le) "
                    f"(rate(tandem_gateway_time_to_first_token_seconds_bucket{{{gateway}}}[1m])))"
                ),
                # What arrives, not what was placed: a saturated pool places at its capacity, and a vote
                # from placements asked for exactly the replicas there were.
                "token_rate": f"sum(rate({PREFILL_ARRIVED_UNCACHED_TOKENS}{{{ns}}}[1m]))",
            }
        return {
            "pending_demand": pending,
            "budget_usage": f'avg({POOL_BUDGET_USED}{{{ns},role="decode"}})',
            "in_flight": in_flight,
            "kv_usage": f"avg(vllm:kv_cache_usage_perc{{{pod_ns},{pods}}})",
            "waiting": f"sum({waiting}) + (sum(vllm:num_requests_waiting{{{pod_ns},{pods}}}) or vector(0))",
            "itl_p90_s": (
                "histogram_quantile(0.9, sum by (le) "
                f"(rate(tandem_gateway_inter_token_latency_seconds_bucket{{{gateway}}}[1m])))"
            ),
            # Output tokens handed to clients: what the decode pool generates (by model in the models form).
            "token_rate": f"sum(rate(tandem_gateway_generated_tokens_total{{{gateway}}}[1m]))",
        }


def parse_instant_value(payload: object) -> float | None:
    """The scalar of a Prometheus ``/api/v1/query`` answer with at most one series; ``None`` if empty or NaN."""
    if not isinstance(payload, dict) or payload.get("status") != "success":
        return None
    data = payload.get("data") or {}
    result = data.get("result") or []
    if data.get("resultType") == "scalar":
        raw = result[1] if isinstance(result, list) and len(result) == 2 else None
    elif isinstance(result, list) and result:
        raw = result[0].get("value", [None, None])[1]
    else:
        return None
    try:
        value = float(str(raw))
    except ValueError:
        return None
    return None if math.isnan(value) or math.isinf(value) else value


class PrometheusSource:
    def __init__(self, url: str, scope: QueryScope, session: aiohttp.ClientSession) -> None:
        self._url = url.rstrip("/") + "/api/v1/query"
        self._scope = scope
        self._session = session

    async def _query(self, promql: str) -> float | None:
        try:
            async with self._session.get(self._url, params={"query": promql}, timeout=_TIMEOUT) as resp:
                if resp.status != 200:
                    logger.warning("prometheus answered %s for %s", resp.status, promql)
                    return None
                return parse_instant_value(await resp.json(content_type=None))
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            logger.warning("prometheus query failed (%s): %s", type(exc).__name__, promql)
            return None

    async def read(self, pool: Pool, pool_name: str) -> PoolSignals:
        queries = self._scope.queries(pool.role, model=_model_of(pool), pool_name=pool_name)
        values: dict[str, Any] = {name: await self._query(q) for name, q in queries.items()}
        return PoolSignals(**values)


def prefill_arrived_tokens(text: str, model: str | None = None) -> float:
    """One router pod's arrivals counter (:data:`PREFILL_ARRIVED_UNCACHED_TOKENS`), summed over its replicas;
    with ``model``, that model's. 0 when absent: Ray exports a counter from its first increment on, so a
    pod that answered without it has counted nothing yet."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == PREFILL_ARRIVED_UNCACHED_TOKENS and (model is None or sample.labels.get(MODEL_LABEL) == model)
    )


class CounterRates:
    """Per-second rates of a counter read from several router pods, as Prometheus's ``rate(...[1m])`` takes
    them from its scrapes, for :class:`RouterSource` (no Prometheus). Each pod's readings of the last
    ``window_s`` and the last one before them (so that the rate spans about a window at any tick interval):
    its increase from the oldest to the newest (a reading below the one before is a restart, counted from
    zero, as ``rate()`` does) over their time apart, summed over pods. ``None`` until every
    pod read has a reading before this one (the first tick, a pod new since the last): a rate from some pods
    only would read as less demand than there is. Pods no longer read are forgotten.

    Owned by the operator's memo, not by a source: the handlers build a source per tick, and a rate needs
    the readings of earlier ticks. Nothing here reads a clock; ``now_s`` comes in."""

    def __init__(self, window_s: float = TOKEN_RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self._readings: dict[tuple[str, str], list[tuple[float, float]]] = {}

    def rate(self, key: str, values: dict[str, float], now_s: float) -> float | None:
        """Add ``values`` (per pod name, read at ``now_s``) to ``key``'s readings and return their rate."""
        for stale in [k for k in self._readings if k[0] == key and k[1] not in values]:
            del self._readings[stale]
        total = 0.0
        complete = True
        for pod, value in values.items():
            readings = self._readings.setdefault((key, pod), [])
            readings.append((now_s, value))
            # Keep the window, and the last reading before it (so a window always spans ~window_s).
            while len(readings) > 2 and readings[1][0] <= now_s - self.window_s:
                readings.pop(0)
            if len(readings) < 2 or readings[-1][0] <= readings[0][0]:
                complete = False
                continue
            increase = sum(b - a if b >= a else b for (_, a), (_, b) in itertools.pairwise(readings))
            total += increase / (readings[-1][0] - readings[0][0])
        return total if complete and values else None


def parse_router_metrics(text: str | Iterable[str], role: Role, model: str | None = None) -> PoolSignals:
    """``role``'s signals from the router's Prometheus text (Ray's export), one text or one per router pod:
    summed over pods and replicas, the budget in use averaged (the module docstring says why); with
    ``model``, only the samples labelled with that model."""
    totals: dict[str, float] = {}
    budget_used: list[float] = []  # one per router replica: averaged, as the PromQL does
    for one_text in [text] if isinstance(text, str) else text:
        for family in text_string_to_metric_families(one_text):
            for sample in family.samples:
                if model is not None and sample.labels.get(MODEL_LABEL) != model:
                    continue
                name = sample.name
                if name in (QUEUED_REQUESTS, QUEUED_UNCACHED_TOKENS):
                    name = f"{name}/{sample.labels.get('waiting_for', '')}"
                elif name in (POOL_BUDGET_USED, POOL_IN_FLIGHT, PENDING_DEMAND):
                    if sample.labels.get("role") != role:
                        continue
                    if name == POOL_BUDGET_USED:
                        budget_used.append(sample.value)
                        continue
                elif name != PREFILL_TOKENS_IN_FLIGHT:
                    continue
                totals[name] = totals.get(name, 0.0) + sample.value
    waiting = totals.get(f"{QUEUED_REQUESTS}/{role}")
    requests_in_flight = totals.get(POOL_IN_FLIGHT)
    pending_demand = totals.get(PENDING_DEMAND)
    if role == "decode":
        return PoolSignals(
            pending_demand=pending_demand,
            waiting=waiting,
            in_flight=requests_in_flight,
            budget_usage=sum(budget_used) / len(budget_used) if budget_used else None,
        )
    tokens_in_flight = totals.get(PREFILL_TOKENS_IN_FLIGHT)
    queued_tokens = totals.get(f"{QUEUED_UNCACHED_TOKENS}/prefill", 0.0)
    return PoolSignals(
        pending_demand=pending_demand,
        queue_depth=waiting,
        uncached_tokens=None if tokens_in_flight is None else tokens_in_flight + queued_tokens,
        in_flight=requests_in_flight,
    )


class EndpointSliceLister(Protocol):
    """What :class:`RouterSource` needs of :class:`tandem_operator.kube.KubeClient`."""

    async def list(self, api_version: str, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]: ...


@dataclass(frozen=True)
class RouterService:
    """The router's metrics Service whose EndpointSlices list the router pods to scrape."""

    kube: EndpointSliceLister
    namespace: str
    name: str


class RouterSource:
    """The router's own metrics: every ready pod of ``service`` (EndpointSlices), else the one ``url``."""

    def __init__(
        self,
        url: str,
        session: aiohttp.ClientSession,
        service: RouterService | None = None,
        rates: CounterRates | None = None,
        rates_key: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._url = url
        self._session = session
        self._service = service
        #: The prefill demand's readings (the operator's memo keeps them across ticks); None: no token_rate.
        self._rates = rates
        #: Whose readings (the TandemDeployment's namespace/name): one CounterRates serves every resource.
        self._rates_key = rates_key
        self._clock = clock

    async def _endpoints(self) -> list[MetricsEndpoint]:
        if self._service is None:
            return [MetricsEndpoint(url=self._url, name=self._url)] if self._url else []
        svc = self._service
        try:
            slices = await svc.kube.list(
                "discovery.k8s.io/v1", "EndpointSlice", svc.namespace, f"{SERVICE_NAME_LABEL}={svc.name}"
            )
        except KubeError as exc:  # the API server refused (RBAC missing) or is away: no pod to read
            logger.warning("router metrics: cannot list the EndpointSlices of %s/%s: %s", svc.namespace, svc.name, exc)
            return []
        return ready_metrics_urls(slices, svc.name)

    async def _scrape(self, endpoint: MetricsEndpoint) -> str | None:
        try:
            async with self._session.get(endpoint.url, timeout=_TIMEOUT) as resp:
                if resp.status != 200:
                    logger.warning("router metrics at %s answered %s", endpoint.name, resp.status)
                    return None
                text = await resp.text()
                # Parsed here too, so that garbage is charged to the pod that sent it.
                for _ in text_string_to_metric_families(text):
                    pass
                return text
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            logger.warning("router metrics unreadable (%s) at %s", type(exc).__name__, endpoint.name)
            return None

    async def read(self, pool: Pool, pool_name: str) -> PoolSignals:
        endpoints = await self._endpoints()
        texts = await asyncio.gather(*(self._scrape(e) for e in endpoints))
        unread = tuple(e.name for e, text in zip(endpoints, texts, strict=True) if text is None)
        if unread:
            logger.warning(
                "router metrics partial: %d of %d router pods did not answer (%s); the %s pool holds",
                len(unread),
                len(endpoints),
                ", ".join(unread),
                pool.key,
            )
            return PoolSignals(unread_from=unread)
        read = [t for t in texts if t is not None]
        signals = parse_router_metrics(read, pool.role, _model_of(pool))
        if pool.role != "prefill" or self._rates is None or not endpoints:
            return signals
        arrived = {e.name: prefill_arrived_tokens(t, _model_of(pool)) for e, t in zip(endpoints, read, strict=True)}
        rate = self._rates.rate(f"{self._rates_key}/{pool.key}", arrived, self._clock())
        return replace(signals, token_rate=rate)
