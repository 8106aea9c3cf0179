"""``autoscaling.source: router`` reads every router pod (issue 42 item 3): the router metrics Service's
EndpointSlices (discovery.k8s.io/v1) list the pods, each ready one is scraped and their series summed.

Router pods here are HTTP servers on 127.0.0.1-3 serving the real router's export
(tests/kit/router_export.py, checked against a live Ray Serve router) with their own queue; the
EndpointSlices live in the kmock API emulator, and the operator lists them through its own KubeClient.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from tandem_operator.autoscale import PoolSignals, decide
from tandem_operator.endpoints import SERVICE_NAME_LABEL, ready_metrics_urls
from tandem_operator.kube import KubeClient
from tandem_operator.signals import CounterRates, RouterService, RouterSource
from tandem_operator.spec import parse_spec

from tests.kit.router_export import recorded_router_export, with_prefill_arrivals, with_queued_requests
from tests.unit.operator.test_operator_kmock import (
    NAME,
    NS,
    TD_PATH,
    _deployment_controller,
    _obj,
    _runner,
    _until,
    operator_resources,
    td_body,
)

pytestmark = pytest.mark.timeout(120)
SERVICE = "rel-tandem-router-metrics"
OTHER_SERVICE = "other-tandem-router-metrics"  # a second release in the same namespace
SLICES_PATH = f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices"
#: The recorded export's in-flight figures, per pod: one request placed on prefill, 300 uncached tokens.
IN_FLIGHT_PER_POD, TOKENS_PER_POD = 1.0, 300.0


class RouterPod:
    """One router pod's metrics endpoint: the recorded export with ``num_queued`` waiting for prefill."""

    def __init__(self, name: str, host: str, num_queued: int) -> None:
        self.name, self.host = name, host
        self.text = with_queued_requests(recorded_router_export(), "prefill", num_queued)
        self._runner: web.AppRunner | None = None

    async def start(self, port: int) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, port).start()

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(text=self.text, content_type="text/plain")

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


def _free_port_on_all(hosts: list[str]) -> int:
    """A port free on every loopback address (a Service's port is the same on each of its pods)."""
    for _ in range(20):
        with socket.socket() as probe:
            probe.bind((hosts[0], 0))
            port = int(probe.getsockname()[1])
        try:
            for host in hosts:
                with socket.socket() as s:
                    s.bind((host, port))
            return port
        except OSError:
            continue
    raise RuntimeError("no port free on every loopback address")


def endpoint_slice(name: str, service: str, port: int, pods: Sequence[tuple[str, str, bool | None]]) -> dict[str, Any]:
    """An EndpointSlice as the controller writes it: (pod name, address, ready) per endpoint."""
    endpoints = []
    for pod, address, ready in pods:
        conditions = {} if ready is None else {"ready": ready}
        endpoints.append(
            {
                "addresses": [address],
                "conditions": conditions,
                "targetRef": {"kind": "Pod", "name": pod, "namespace": NS},
            }
        )
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": NS, "labels": {SERVICE_NAME_LABEL: service}},
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{"name": "metrics", "port": port, "protocol": "TCP"}],
    }


@pytest.fixture
def cluster(kmock: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    cluster = operator_resources(kmock, monkeypatch)
    cluster.resources["discovery.k8s.io/v1/endpointslices"] = {
        "verbs": ["list", "watch", "get", "create", "patch", "update", "delete"],
        "shortnames": [],
        "categories": [],
        "subresources": [],
        "kind": "EndpointSlice",
        "singular": "endpointslice",
        "namespaced": True,
    }
    return cluster


@pytest.fixture
async def router_pods(cluster: Any) -> AsyncIterator[dict[str, RouterPod]]:
    """Three ready router pods queueing 1, 2 and 4 requests for prefill; one pod of another release's router
    in the same namespace (100 queued); one of ours still starting (not ready: 50 queued, never read)."""
    pods = {
        "router-a": RouterPod("router-a", "127.0.0.1", 1),
        "router-b": RouterPod("router-b", "127.0.0.2", 2),
        "router-c": RouterPod("router-c", "127.0.0.3", 4),
        "other-router": RouterPod("other-router", "127.0.0.4", 100),
        "router-starting": RouterPod("router-starting", "127.0.0.5", 50),
    }
    port = _free_port_on_all([pod.host for pod in pods.values()])
    for pod in pods.values():
        await pod.start(port)
    # router-b's readiness is "unknown" (no condition), which counts as ready, as the API says.
    ours: list[tuple[str, str, bool | None]] = [
        ("router-a", "127.0.0.1", True),
        ("router-b", "127.0.0.2", None),
        ("router-c", "127.0.0.3", True),
    ]
    await cluster.post(SLICES_PATH, json=endpoint_slice(f"{SERVICE}-x1", SERVICE, port, ours))
    starting = [("router-starting", "127.0.0.5", False)]
    await cluster.post(SLICES_PATH, json=endpoint_slice(f"{SERVICE}-x2", SERVICE, port, starting))
    other = [("other-router", "127.0.0.4", True)]
    await cluster.post(SLICES_PATH, json=endpoint_slice(f"{OTHER_SERVICE}-y1", OTHER_SERVICE, port, other))
    yield pods
    for pod in pods.values():
        await pod.stop()


def _prefill_pool() -> Any:
    return next(p for p in parse_spec(td_body()["spec"]).pools_of() if p.role == "prefill")


async def test_three_router_pods_holding_1_2_and_4_queued_read_7(
    cluster: Any, router_pods: dict[str, RouterPod]
) -> None:
    kube = KubeClient(str(cluster.url).rstrip("/"), insecure=True)
    try:
        async with aiohttp.ClientSession() as http:
            source = RouterSource("", http, RouterService(kube, NS, SERVICE))
            signals = await source.read(_prefill_pool(), f"{NAME}-prefill")
            assert signals.queue_depth == 7, signals  # 1 + 2 + 4: not one pod's, not the other release's 100
            assert signals.in_flight == 3 * IN_FLIGHT_PER_POD and signals.uncached_tokens == 3 * TOKENS_PER_POD
            assert signals.unread_from == ()

            # One pod stops answering (crashed, its endpoint not yet unready): partial, never 3.
            await router_pods["router-c"].stop()
            partial = await source.read(_prefill_pool(), f"{NAME}-prefill")
            assert partial.unread_from == ("router-c",), partial
            assert partial.queue_depth is None and partial.uncached_tokens is None and partial.in_flight is None

            # A pod that answers garbage is partial too, charged to that pod.
            router_pods["router-b"].text = "ray_tandem_router_queued_requests{waiting_for=prefill 3\n"
            garbage = await source.read(_prefill_pool(), f"{NAME}-prefill")
            assert set(garbage.unread_from) == {"router-b", "router-c"} and garbage.queue_depth is None

            # No Service named: the plain URL (local mode) is read as before, one pod.
            url = f"http://127.0.0.1:{router_pods['router-a']._runner.addresses[0][1]}/metrics"  # type: ignore[union-attr]
            assert (await RouterSource(url, http).read(_prefill_pool(), f"{NAME}-prefill")).queue_depth == 1
    finally:
        await kube.close()


async def test_the_prefill_demand_rate_is_what_arrives_at_every_router_pod(
    cluster: Any, router_pods: dict[str, RouterPod]
) -> None:
    """``token_rate`` from the router source: the arrivals counter of every ready pod, as a rate over the
    operator's ticks (a counter read once has none). The prefill pool is saturated: each pod places 1,000
    tokens per 10 s (its capacity; the placed counter's rate), while 3,000 arrive. With a measured 150
    tokens/s per worker, the demand (900 tokens/s) asks for 6 workers where the placed tokens asked for 2."""
    ours = ("router-a", "router-b", "router-c")
    clock = [0.0]
    kube = KubeClient(str(cluster.url).rstrip("/"), insecure=True)
    try:
        async with aiohttp.ClientSession() as http:
            rates = CounterRates()

            def source() -> RouterSource:  # the handlers build one per tick; the readings are the memo's
                return RouterSource(
                    "",
                    http,
                    RouterService(kube, NS, SERVICE),
                    rates=rates,
                    rates_key=f"{NS}/{NAME}",
                    clock=lambda: clock[0],
                )

            for name in ours:
                router_pods[name].text = with_prefill_arrivals(router_pods[name].text, 1000)
            first = await source().read(_prefill_pool(), f"{NAME}-prefill")
            assert first.token_rate is None and first.queue_depth == 7  # no rate from one reading
            clock[0] = 10.0
            for name in ours:
                router_pods[name].text = with_prefill_arrivals(router_pods[name].text, 1000 + 3000)
            signals = await source().read(_prefill_pool(), f"{NAME}-prefill")
            assert signals.token_rate == 3 * 3000 / 10, signals  # not the other release's pod

            spec = parse_spec(td_body(capacity={"prefillTokensPerSecondPerWorker": 150})["spec"])
            pool = _prefill_pool()

            def vote(signals: PoolSignals) -> int:
                decision, _ = decide(
                    role="prefill",
                    current_replicas=2,
                    signals=signals,
                    pool=pool.spec,
                    policy=spec.autoscaling,
                    slo=spec.slo,
                    history=(),
                    now_s=10.0,
                    ready_replicas=2,
                )
                return decision.votes["token_rate"]

            assert vote(PoolSignals(queue_depth=0, token_rate=signals.token_rate)) == 6
            assert vote(PoolSignals(queue_depth=0, token_rate=3 * 1000 / 10)) == 2  # the placed tokens' rate
    finally:
        await kube.close()


def test_which_endpoints_are_read() -> None:
    slices = [
        endpoint_slice(
            "s1", SERVICE, 8080, [("a", "10.0.0.1", True), ("b", "10.0.0.2", False), ("c", "10.0.0.3", None)]
        ),
        endpoint_slice("s2", SERVICE, 8080, [("a", "10.0.0.1", True)]),  # the same pod in a second slice
        endpoint_slice("s3", OTHER_SERVICE, 8080, [("z", "10.0.0.9", True)]),
        {**endpoint_slice("s4", SERVICE, 8080, [("v6", "fd00::5", True)]), "addressType": "IPv6"},
        {**endpoint_slice("s5", SERVICE, 8080, [("n", "router.example", True)]), "addressType": "FQDN"},
    ]
    slices.append(
        {
            **endpoint_slice("s6", SERVICE, 0, [("d", "10.0.0.4", True)]),
            "ports": [{"name": "grpc", "port": 9000}, {"name": "other", "port": 9001}],
        }
    )
    got = ready_metrics_urls(slices, SERVICE)
    assert [(e.name, e.url) for e in got] == [
        ("a", "http://10.0.0.1:8080/metrics"),
        ("c", "http://10.0.0.3:8080/metrics"),
        ("v6", "http://[fd00::5]:8080/metrics"),
    ]
    only_port = endpoint_slice("s7", SERVICE, 0, [("e", "10.0.0.5", True)])
    only_port["ports"] = [{"name": "http", "port": 9100}]  # the Service's only port, whatever its name
    assert [e.url for e in ready_metrics_urls([only_port], SERVICE)] == ["http://10.0.0.5:9100/metrics"]
    assert ready_metrics_urls(slices, "no-such-service") == []


async def test_the_operator_sums_every_router_pod_and_says_when_one_is_missing(
    cluster: Any, router_pods: dict[str, RouterPod]
) -> None:
    controller = asyncio.create_task(_deployment_controller(cluster))
    with _runner() as runner:
        await asyncio.sleep(1.0)
        await cluster.post(TD_PATH, json=td_body(source="router", routerMetricsService=SERVICE))

        def status() -> dict[str, Any]:
            return dict((_obj(cluster, "tandem.dev/v1alpha1/tandemdeployments", NAME) or {}).get("status", {}))

        def metrics_condition() -> dict[str, Any]:
            return next((c for c in status().get("conditions", []) if c["type"] == "MetricsAvailable"), {})

        entry = await _until(
            lambda: (
                status().get("autoscaling", {}).get("prefill", {}).get("signals", {}).get("queue_depth")
                and status()["autoscaling"]["prefill"]
            ),
            "a prefill decision",
        )
        assert entry["signals"]["queue_depth"] == 7, entry
        available = await _until(
            lambda: metrics_condition().get("status") == "True" and metrics_condition(), "MetricsAvailable=True"
        )
        assert SERVICE in available["message"], available

        await router_pods["router-c"].stop()
        partial = await _until(
            lambda: metrics_condition().get("reason") == "PartialSignals" and metrics_condition(),
            "MetricsAvailable=False, PartialSignals",
        )
        assert partial["status"] == "False" and "router-c" in partial["message"], partial
        assert "127.0.0" not in partial["message"]  # the pod's name, not its address
    controller.cancel()
    assert runner.exception is None, runner.output[-3000:]
