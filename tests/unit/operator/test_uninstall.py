"""``helm uninstall`` leaves nothing stuck (issue 43, item 5): the chart's pre-delete hook
(``python -m tandem_operator.uninstall``) deletes the release's TandemDeployment while the operator still
runs and waits for it to go. Against the kmock API emulator:

* with the real operator running (kopf's KopfRunner): the operator deletes the pools and releases its
  finalizer, and the hook reports ``released``;
* with no operator (crashed, or never running): the resource waits on the finalizer; after the timeout
  the hook removes it and reports ``forced`` (a cluster's garbage collector then takes the pools, which
  carry owner references);
* no resource: ``absent``; an API server that refuses: the CLI exits 1 with the reason.

The chart renders the hook as a pre-delete Job with a Role limited to that one resource."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from tandem_operator import uninstall as hook
from tandem_operator.kube import KubeClient

from tests.chart.conftest import find, one, render
from tests.unit.operator.test_operator_kmock import (
    NAME,
    NS,
    TD_PATH,
    _obj,
    _runner,
    _until,
    operator_resources,
    td_body,
)

pytestmark = pytest.mark.timeout(120)
TD = "tandem.dev/v1alpha1/tandemdeployments"


@pytest.fixture
def cluster(kmock: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    return operator_resources(kmock, monkeypatch)


async def _client(cluster: Any) -> KubeClient:
    return KubeClient(str(cluster.url).rstrip("/"), insecure=True)


async def test_with_the_operator_running_the_pools_go_and_the_finalizer_is_released(cluster: Any) -> None:
    with _runner() as runner:
        await asyncio.sleep(1.0)
        await cluster.post(TD_PATH, json=td_body())
        for role in ("prefill", "decode"):
            await _until(lambda r=role: _obj(cluster, "apps/v1/deployments", f"{NAME}-{r}"), f"{role} pool")
        await _until(lambda: (_obj(cluster, TD, NAME) or {}).get("metadata", {}).get("finalizers"), "finalizer")
        kube = await _client(cluster)
        try:
            outcome = await hook.uninstall(kube, NS, NAME, timeout_s=30, poll_s=0.2)
        finally:
            await kube.close()
    assert outcome == "released"
    assert _obj(cluster, TD, NAME) is None
    for role in ("prefill", "decode"):
        assert _obj(cluster, "apps/v1/deployments", f"{NAME}-{role}") is None  # deleted by the operator
    assert runner.exception is None, runner.output[-3000:]


async def test_without_an_operator_the_hook_removes_the_finalizer_after_its_timeout(cluster: Any) -> None:
    body = td_body()
    body["metadata"]["finalizers"] = ["kopf.zalando.org/KopfFinalizerMarker"]
    await cluster.post(TD_PATH, json=body)
    kube = await _client(cluster)
    try:
        waited = asyncio.get_running_loop().time()
        outcome = await hook.uninstall(kube, NS, NAME, timeout_s=1.0, poll_s=0.1)
        waited = asyncio.get_running_loop().time() - waited
        assert outcome == "forced"
        assert waited >= 1.0  # it gave the operator its time first
        assert _obj(cluster, TD, NAME) is None
        assert await hook.uninstall(kube, NS, NAME, timeout_s=1.0) == "absent"
    finally:
        await kube.close()


def test_the_cli_exits_1_with_the_reason_when_the_api_refuses(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TANDEM_OPERATOR_API_SERVER_URL", "http://127.0.0.1:9")  # nothing listens on discard
    assert hook.main(["--namespace", NS, "--name", NAME, "--timeout-s", "1"]) == 1
    assert f"could not delete TandemDeployment {NS}/{NAME}" in caplog.text


def test_the_chart_renders_the_hook_with_a_role_for_that_one_resource() -> None:
    docs = render(None)
    full = "rel-tandem"
    job = one(docs, "Job", f"{full}-uninstall")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete"
    role = one(docs, "Role", f"{full}-uninstall")
    assert role["metadata"]["annotations"]["helm.sh/hook-weight"] == "-10"  # before the Job (weight 0)
    (td,) = find(docs, "TandemDeployment")
    assert role["rules"] == [
        {
            "apiGroups": ["tandem.dev"],
            "resources": ["tandemdeployments"],
            "resourceNames": [td["metadata"]["name"]],
            "verbs": ["get", "delete", "patch"],
        }
    ]
    pod = job["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == f"{full}-operator"
    (container,) = pod["containers"]
    assert container["command"] == ["python", "-m", "tandem_operator.uninstall"]
    assert f"--name={td['metadata']['name']}" in container["args"] and "--namespace=tandem" in container["args"]
    assert job["spec"]["activeDeadlineSeconds"] > 600  # the drain's bound (600 s by default) and a margin
    assert not find(render(None, ("tandemDeployment.enabled=false",)), "Job")
