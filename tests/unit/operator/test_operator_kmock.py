"""The operator end to end under kopf's KopfRunner, against the kmock Kubernetes
emulator (no cluster) and a fake Prometheus HTTP API on 127.0.0.1.

kmock stores objects and streams watch events; it runs no controllers (no
pods, no garbage collector), so "everything owned is gone" is the operator's
own delete handler at work.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp import web
from kopf.testing import KopfRunner

NS = "tandem"
NAME = "chat"
TD_PATH = f"/apis/tandem.dev/v1alpha1/namespaces/{NS}/tandemdeployments"
_RESOURCE = {"verbs": ["list", "watch", "get", "create", "patch", "update", "delete"], "shortnames": [],
             "categories": [], "subresources": []}

pytestmark = pytest.mark.timeout(120)


def td_body(**autoscaling: Any) -> dict[str, Any]:
    return {
        "apiVersion": "tandem.dev/v1alpha1",
        "kind": "TandemDeployment",
        "metadata": {"name": NAME, "namespace": NS, "uid": "uid-chat", "generation": 1, "resourceVersion": "1",
                     "labels": {"app.kubernetes.io/instance": "rel"}},
        "spec": {
            "model": {"servedModelName": "smol", "pvc": {"claimName": "models"}},
            "image": {"repository": "ghcr.io/tandem-llm/tandem-worker-cpu", "tag": "0.1.0"},
            "redis": {"secretName": "rel-tandem-redis"},
            "pools": {"prefill": {"replicas": 1, "minReplicas": 1, "maxReplicas": 4},
                      "decode": {"replicas": 1, "minReplicas": 1, "maxReplicas": 4}},
            "autoscaling": {"intervalSeconds": 0.5, "scaleUpStabilizationSeconds": 0,
                            "scaleDownStabilizationSeconds": 0, **autoscaling},
        },
    }


#: The prefill pool's queue query (the decode pool's says waiting_for="decode").
PREFILL_QUEUE = f'ray_tandem_router_queued_requests{{namespace="{NS}",waiting_for="prefill"}}'


class FakePrometheus:
    """Answers /api/v1/query from a dict keyed by metric-name fragments; no match = empty result."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}
        self.queries: list[str] = []

    async def handle(self, request: web.Request) -> web.Response:
        query = request.query.get("query", "")
        self.queries.append(query)
        for fragment, value in self.values.items():
            if fragment in query:
                return web.json_response({"status": "success", "data": {"resultType": "vector",
                                          "result": [{"metric": {}, "value": [0, str(value)]}]}})
        return web.json_response({"status": "success", "data": {"resultType": "vector", "result": []}})


@pytest.fixture
async def prometheus() -> AsyncIterator[tuple[FakePrometheus, str]]:
    fake = FakePrometheus()
    app = web.Application()
    app.router.add_get("/api/v1/query", fake.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield fake, f"http://127.0.0.1:{port}"
    await runner.cleanup()


@pytest.fixture
def cluster(kmock: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    return operator_resources(kmock, monkeypatch)


def operator_resources(kmock: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``kmock`` serving the resources the operator uses, and the operator's settings pointing at it."""
    for key, kind, namespaced, subresources in [
        ("v1/namespaces", "Namespace", False, []),
        ("apiextensions.k8s.io/v1/customresourcedefinitions", "CustomResourceDefinition", False, []),
        ("tandem.dev/v1alpha1/tandemdeployments", "TandemDeployment", True, ["status"]),
        ("apps/v1/deployments", "Deployment", True, ["status", "scale"]),
        ("v1/services", "Service", True, []),
        ("v1/events", "Event", True, []),
    ]:
        kmock.resources[key] = dict(_RESOURCE, kind=kind, singular=kind.lower(), namespaced=namespaced,
                                    subresources=subresources)
    monkeypatch.setenv("TANDEM_OPERATOR_API_SERVER_URL", str(kmock.url).rstrip("/"))
    monkeypatch.setenv("TANDEM_OPERATOR_TICK_S", "0.2")
    monkeypatch.setenv("TANDEM_OPERATOR_RETRY_DELAY_S", "1")
    return kmock


def _obj(kmock: Any, resource: str, name: str) -> dict[str, Any] | None:
    try:  # kmock parses string keys on item access (not on `in`)
        obj = kmock.objects[(resource, NS, name)]
    except KeyError:
        return None
    return None if obj.deleted else copy.deepcopy(dict(obj))


async def _until(check: Callable[[], Any], what: str, timeout_s: float = 20.0) -> Any:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        result = check()
        if result:
            return result
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _replicas(kmock: Any, role: str) -> int | None:
    dep = _obj(kmock, "apps/v1/deployments", f"{NAME}-{role}")
    return None if dep is None else int(dep["spec"]["replicas"])


async def _deployment_controller(kmock: Any) -> None:
    """kmock runs no controllers: stand in for the Deployment controller (every replica becomes
    ready at once, of the current template), so the operator sees ready replicas as in a cluster."""
    while True:
        for role in ("prefill", "decode"):
            try:
                obj = kmock.objects[("apps/v1/deployments", NS, f"{NAME}-{role}")]
            except KeyError:
                continue
            if obj.deleted:
                continue
            replicas = int(obj["spec"]["replicas"])
            if (obj.get("status") or {}).get("readyReplicas") != replicas:
                obj.patch({"status": {"replicas": replicas, "updatedReplicas": replicas, "readyReplicas": replicas}})
        await asyncio.sleep(0.2)


def _runner() -> KopfRunner:
    # -A, not --namespace: kmock 0.8 answers a 500 on the namespace listing that
    # kopf does for --namespace (its path parser expects a name after "namespaces").
    return KopfRunner(["run", "--standalone", "-A", "-m", "tandem_operator.handlers"])


async def test_create_scale_delete(cluster: Any, prometheus: tuple[FakePrometheus, str]) -> None:
    fake, prom_url = prometheus
    controller = asyncio.create_task(_deployment_controller(cluster))
    with _runner() as runner:
        await asyncio.sleep(1.0)  # discovery and watchers
        await cluster.post(TD_PATH, json=td_body(prometheusUrl=prom_url))

        # Create → both pools (Deployment + Service) appear, owned by the resource.
        for role in ("prefill", "decode"):
            dep = await _until(lambda r=role: _obj(cluster, "apps/v1/deployments", f"{NAME}-{r}"), f"{role} pool")
            assert dep["metadata"]["ownerReferences"][0]["uid"] == "uid-chat"
            assert dep["spec"]["template"]["spec"]["containers"][0]["args"] == ["--role", role]
            svc = await _until(lambda r=role: _obj(cluster, "v1/services", f"{NAME}-{r}"), f"{role} Service")
            assert svc["spec"]["clusterIP"] == "None"
        td = await _until(
            lambda: (_obj(cluster, "tandem.dev/v1alpha1/tandemdeployments", NAME) or {}).get("status", {})
            .get("conditions"), "status conditions")
        assert {c["type"]: c["status"] for c in td}["SpecValid"] == "True"

        # The status follows the pools as they become ready (a timer, not only on spec changes).
        def td_status() -> dict[str, Any]:
            return dict((_obj(cluster, "tandem.dev/v1alpha1/tandemdeployments", NAME) or {}).get("status", {}))

        await _until(lambda: td_status().get("pools", {}).get("decode", {}).get("readyReplicas") == 1
                     and {c["type"]: c["status"] for c in td_status()["conditions"]}.get("Ready") == "True",
                     "status to show the ready pools", timeout_s=30)

        # No series yet: the pools hold, and the resource says so.
        def metrics_condition() -> dict[str, Any]:
            return next((c for c in td_status().get("conditions", []) if c["type"] == "MetricsAvailable"), {})

        missing = await _until(lambda: metrics_condition().get("status") == "False" and metrics_condition(),
                               "MetricsAvailable=False")
        assert "no signal for the prefill and decode pool" in missing["message"], missing

        # Prefill load rises (router queue of 12, 4 per replica) → only prefill scales (step cap 2).
        fake.values = {PREFILL_QUEUE: 12.0, "vllm:kv_cache_usage_perc": 0.7}
        await _until(lambda: _replicas(cluster, "prefill") == 3, "prefill to scale to 3")
        assert _replicas(cluster, "decode") == 1

        def prefill_decision() -> dict[str, Any]:
            status = (_obj(cluster, "tandem.dev/v1alpha1/tandemdeployments", NAME) or {}).get("status", {})
            return dict(status.get("autoscaling", {}).get("prefill", {}))

        # The status is patched after the Deployment (and retried when the API drops a request).
        decision = await _until(lambda: "queue_depth" in prefill_decision().get("reason", "") and prefill_decision(),
                                "the prefill decision in status")
        assert decision["desiredReplicas"] == 3, decision
        await _until(lambda: metrics_condition().get("status") == "True", "MetricsAvailable=True")

        # Decode KV usage rises → decode scales; prefill load gone → prefill comes down (one step at a time).
        fake.values = {PREFILL_QUEUE: 0.0, "vllm:kv_cache_usage_perc": 0.95}
        await _until(lambda: (_replicas(cluster, "decode") or 0) >= 2, "decode to scale up")
        await _until(lambda: _replicas(cluster, "prefill") == 1, "prefill to scale back to 1")

        # Delete → everything owned is gone.
        await cluster.delete(f"{TD_PATH}/{NAME}")
        for role in ("prefill", "decode"):
            await _until(lambda r=role: _obj(cluster, "apps/v1/deployments", f"{NAME}-{r}") is None,
                         f"{role} Deployment deleted")
            await _until(lambda r=role: _obj(cluster, "v1/services", f"{NAME}-{r}") is None,
                         f"{role} Service deleted")
        await _until(lambda: _obj(cluster, "tandem.dev/v1alpha1/tandemdeployments", NAME) is None,
                     "finalizer released")
    controller.cancel()
    assert runner.exception is None, runner.output[-3000:]
    assert any("histogram_quantile" in q for q in fake.queries)  # latency signals were asked for too


async def test_malformed_resource_gets_a_condition_not_a_crash(cluster: Any) -> None:
    body = td_body()
    body["spec"]["pools"]["decode"] = {"replicas": 9, "minReplicas": 1, "maxReplicas": 4}
    del body["spec"]["redis"]
    with _runner() as runner:
        await asyncio.sleep(1.0)
        await cluster.post(TD_PATH, json=body)
        conditions = await _until(
            lambda: (_obj(cluster, "tandem.dev/v1alpha1/tandemdeployments", NAME) or {}).get("status", {})
            .get("conditions"), "a status condition")
        spec_valid = next(c for c in conditions if c["type"] == "SpecValid")
        assert spec_valid["status"] == "False" and spec_valid["reason"] == "InvalidSpec"
        assert "redis" in spec_valid["message"] and "replicas 9" in spec_valid["message"]
        await asyncio.sleep(1.5)  # a few timer ticks: nothing is created, nothing crashes
        assert _obj(cluster, "apps/v1/deployments", f"{NAME}-prefill") is None
    assert runner.exception is None
    assert runner.exit_code == 0
    assert runner.output.count("not reconciling") == 1  # reported once, not retried in a loop
