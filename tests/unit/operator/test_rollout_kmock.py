"""The operator rolls prefill and decode of a new revision together, end to end under kopf's
KopfRunner against the kmock emulator: a new image tag gates both pools' new pods, and the operator
marks a new worker paired (so the Deployment controller may take an old one away) only once a worker
of the other role with the same revision serves. kmock runs no controllers: the test creates the
pods the Deployment controller would, from the Deployments' own templates."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest
from tandem_operator.rollout import PAIRED_CONDITION

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
POD_PATH = f"/api/v1/namespaces/{NS}/pods"


@pytest.fixture
def cluster(kmock: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    kmock = operator_resources(kmock, monkeypatch)
    kmock.resources["v1/pods"] = {
        "verbs": ["list", "watch", "get", "create", "patch", "update", "delete"],
        "shortnames": [],
        "categories": [],
        "kind": "Pod",
        "singular": "pod",
        "namespaced": True,
        "subresources": ["status"],
    }
    return kmock


def _plain(value: Any) -> Any:
    """kmock's stored views as plain JSON values."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _template(cluster: Any, role: str) -> dict[str, Any]:
    dep = _obj(cluster, "apps/v1/deployments", f"{NAME}-{role}")
    assert dep is not None
    template: dict[str, Any] = _plain(dep["spec"]["template"])
    return template


async def _pod(cluster: Any, name: str, role: str, *, ready: bool) -> None:
    """A pod made from ``role``'s current template, its containers ready (its worker serves); Ready as
    well when its template has no gate and ``ready``."""
    template = _template(cluster, role)
    conditions = [{"type": "ContainersReady", "status": "True"}, {"type": "Ready", "status": str(ready)}]
    await cluster.post(
        POD_PATH,
        json={
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": template["metadata"]["labels"]},
            "spec": template["spec"],
            "status": {"conditions": conditions},
        },
    )


def _paired(cluster: Any, name: str) -> bool:
    pod = _obj(cluster, "v1/pods", name) or {}
    return any(
        c.get("type") == PAIRED_CONDITION and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


async def test_a_new_image_rolls_prefill_and_decode_together(cluster: Any) -> None:
    with _runner() as runner:
        await asyncio.sleep(1.0)
        body = td_body(enabled=False)
        await cluster.post(TD_PATH, json=body)
        for role in ("prefill", "decode"):
            await _until(lambda r=role: _obj(cluster, "apps/v1/deployments", f"{NAME}-{r}"), f"{role} pool")
            assert "readinessGates" not in _template(cluster, role)["spec"]  # a new pool: nothing to protect
            await _pod(cluster, f"{role}-old", role, ready=True)

        # A new image: both pools get the new template and the pairing gate.
        await cluster.patch(
            f"{TD_PATH}/{NAME}",
            json={"spec": {"image": {"tag": "0.2.0"}}},
            headers={"Content-Type": "application/merge-patch+json"},
        )
        for role in ("prefill", "decode"):
            await _until(lambda r=role: _template(cluster, r)["spec"].get("readinessGates"), f"{role} gate")
            assert _template(cluster, role)["spec"]["containers"][0]["image"].endswith(":0.2.0")

        # The new prefill worker serves first: it is not paired while the old pair is all that serves.
        await _pod(cluster, "prefill-new", "prefill", ready=False)
        await asyncio.sleep(5.0)  # two pairing ticks and more
        assert not _paired(cluster, "prefill-new")
        # Its decode partner of the same revision serves: both are paired (and may replace the old ones).
        await _pod(cluster, "decode-new", "decode", ready=False)
        await _until(lambda: _paired(cluster, "prefill-new") and _paired(cluster, "decode-new"), "both paired")
        kept = (_obj(cluster, "v1/pods", "prefill-new") or {})["status"]["conditions"]
        assert {"type": "ContainersReady", "status": "True"} in kept  # the kubelet's conditions stay
        assert not _paired(cluster, "prefill-old") and not _paired(cluster, "decode-old")
    assert runner.exit_code == 0, runner.output


def _spec_valid(cluster: Any) -> dict[str, Any]:
    td = _obj(cluster, "tandem.dev/v1alpha1/tandemdeployments", NAME) or {}
    conditions = _plain((td.get("status") or {}).get("conditions") or [])
    return next((c for c in conditions if c["type"] == "SpecValid"), {})


def _dtype(cluster: Any, role: str) -> str:
    env = _template(cluster, role)["spec"]["containers"][0]["env"]
    return str(next(e["value"] for e in env if e["name"] == "TANDEM_WORKER_ENGINE__DTYPE"))


async def test_pools_that_can_never_pair_are_refused_and_left_as_they_were(cluster: Any) -> None:
    """An update that gives prefill and decode other dtypes (pools that could never pair) gets SpecValid=False
    naming the setting and changes neither pool; the same dtype on both in the next apply rolls both."""
    with _runner() as runner:
        await asyncio.sleep(1.0)
        await cluster.post(TD_PATH, json=td_body(enabled=False))
        for role in ("prefill", "decode"):
            await _until(lambda r=role: _obj(cluster, "apps/v1/deployments", f"{NAME}-{r}"), f"{role} pool")
        before = {role: _template(cluster, role) for role in ("prefill", "decode")}
        merge = {"Content-Type": "application/merge-patch+json"}
        pools = {"prefill": {"engineArgs": {"dtype": "bfloat16"}}, "decode": {"engineArgs": {"dtype": "float16"}}}
        await cluster.patch(f"{TD_PATH}/{NAME}", json={"spec": {"pools": pools}}, headers=merge)
        refused = await _until(lambda: _spec_valid(cluster).get("status") == "False", "SpecValid=False")
        message = _spec_valid(cluster)["message"]
        assert refused and "pools: prefill and decode can never pair" in message
        assert "engineArgs.dtype: prefill bfloat16, decode float16" in message
        await asyncio.sleep(1.5)  # timer ticks: nothing changes
        assert {role: _template(cluster, role) for role in ("prefill", "decode")} == before

        pools["decode"]["engineArgs"]["dtype"] = "bfloat16"
        await cluster.patch(f"{TD_PATH}/{NAME}", json={"spec": {"pools": pools}}, headers=merge)
        await _until(lambda: _spec_valid(cluster).get("status") == "True", "SpecValid=True")
        await _until(lambda: _dtype(cluster, "prefill") == _dtype(cluster, "decode") == "bfloat16", "both rolled")
    assert runner.exit_code == 0, runner.output
