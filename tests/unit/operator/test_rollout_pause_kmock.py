"""The operator end to end (kopf's KopfRunner against the kmock emulator, a fake Prometheus): while the
prefill pool rolls a new revision, its scale-down waits and a scale-up goes on; once the rollout is over
the pool comes down. kmock runs no controllers: a stand-in Deployment controller writes the status a
rolling Deployment has (one surge pod of the new template beside the old ones), then a settled one."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from tandem_operator.rollout_pause import CONDITION

from tests.unit.operator.test_operator_kmock import (
    NAME,
    NS,
    PREFILL_QUEUE,
    TD_PATH,
    FakePrometheus,
    _obj,
    _runner,
    _until,
    operator_resources,
    prometheus,  # noqa: F401 (a fixture)
    td_body,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def cluster(kmock: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    return operator_resources(kmock, monkeypatch)


async def _deployment_controller(kmock: Any, rolling: dict[str, bool]) -> None:
    """Every replica Ready at once; a pool in ``rolling`` (True) has one surge pod of the new template
    beside its old ones, as under ``maxSurge 1`` before the first old pod goes."""
    while True:
        for role in ("prefill", "decode"):
            try:
                obj = kmock.objects[("apps/v1/deployments", NS, f"{NAME}-{role}")]
            except KeyError:
                continue
            if obj.deleted:
                continue
            replicas = int(obj["spec"]["replicas"])
            if rolling.get(role):
                status = {"replicas": replicas + 1, "updatedReplicas": 1, "readyReplicas": replicas}
            else:
                status = {"replicas": replicas, "updatedReplicas": replicas, "readyReplicas": replicas}
            if {k: (obj.get("status") or {}).get(k) for k in status} != status:
                obj.patch({"status": status})
        await asyncio.sleep(0.1)


def _replicas(kmock: Any, role: str) -> int | None:
    dep = _obj(kmock, "apps/v1/deployments", f"{NAME}-{role}")
    return None if dep is None else int(dep["spec"]["replicas"])


def _status(kmock: Any) -> dict[str, Any]:
    return dict((_obj(kmock, "tandem.dev/v1alpha1/tandemdeployments", NAME) or {}).get("status") or {})


def _paused(kmock: Any) -> dict[str, Any]:
    return next((c for c in _status(kmock).get("conditions") or [] if c.get("type") == CONDITION), {})


def _reason(kmock: Any, role: str) -> str:
    return str(((_status(kmock).get("autoscaling") or {}).get(role) or {}).get("reason", ""))


async def test_a_rolling_pool_grows_but_does_not_shrink_until_the_rollout_is_over(
    cluster: Any,
    prometheus: tuple[FakePrometheus, str],  # noqa: F811
) -> None:
    fake, prom_url = prometheus
    fake.values = {PREFILL_QUEUE: 0.0, "vllm:kv_cache_usage_perc": 0.7}  # prefill idle: it asks for its min, 1
    body = td_body(prometheusUrl=prom_url)
    body["spec"]["pools"]["prefill"]["replicas"] = 2
    rolling = {"prefill": True}
    controller = asyncio.create_task(_deployment_controller(cluster, rolling))
    try:
        with _runner() as runner:
            await asyncio.sleep(1.0)  # discovery and watchers
            await cluster.post(TD_PATH, json=body)
            await _until(lambda: _replicas(cluster, "prefill") == 2, "the prefill pool")
            await _until(
                lambda: _reason(cluster, "prefill").startswith("scale down paused: rollout"), "a held decision"
            )
            assert "(prefill: 1 of 3 pods updated); would go to 1: scale down" in _reason(cluster, "prefill")
            await _until(lambda: _paused(cluster).get("status") == "True", "ScaleDownPaused=True")
            assert _paused(cluster)["reason"] == "Rollout"
            assert "model smol rolls a new revision (prefill: 1 of 3 pods updated)" in _paused(cluster)["message"]
            await asyncio.sleep(2.0)  # four intervals: the idle pool stays at 2 while it rolls
            assert _replicas(cluster, "prefill") == 2 and _replicas(cluster, "decode") == 1

            # Load arrives mid-rollout: the pool grows (a queue of 12 asks for 3, its rise for more), rollout or not.
            fake.values = {PREFILL_QUEUE: 12.0, "vllm:kv_cache_usage_perc": 0.7}
            await _until(lambda: (_replicas(cluster, "prefill") or 0) >= 3, "prefill to grow during the rollout")
            fake.values = {PREFILL_QUEUE: 0.0, "vllm:kv_cache_usage_perc": 0.7}
            await _until(lambda: "load asks 0" in _reason(cluster, "prefill"), "the load gone")
            grown = _replicas(cluster, "prefill")
            await asyncio.sleep(2.0)
            assert _replicas(cluster, "prefill") == grown  # idle again, still rolling: held

            # The rollout is over: the scale-down goes ahead, a step at a time, to the pool's min.
            rolling["prefill"] = False
            await _until(lambda: _replicas(cluster, "prefill") == 1, "prefill back to 1 after the rollout")
            await _until(lambda: _paused(cluster).get("status") == "False", "ScaleDownPaused=False")
            assert _paused(cluster)["reason"] == "NoRollout"
            await cluster.delete(f"{TD_PATH}/{NAME}")
            await _until(
                lambda: _obj(cluster, "tandem.dev/v1alpha1/tandemdeployments", NAME) is None, "finalizer released"
            )
        assert runner.exception is None, runner.output[-3000:]
        assert runner.output.count("autoscaling paused: rollout") == 1, runner.output[-3000:]
        assert runner.output.count("autoscaling resumed") == 1
    finally:
        controller.cancel()
