"""Scale from and to zero (issue 42 item 4), the operator end to end under kopf against kmock.

The decode pool has ``minReplicas: 0`` and starts at zero. Its router's metrics endpoint serves the real
router's export (tests/kit/router_export.py, checked against a live Ray Serve router), to which a pending
demand sample is added the way the router publishes one when it refuses a request for want of any decode
worker (its shape checked against a live refusal in tests/integration/test_router_ray.py). The operator
must start the pool within one interval, although its scale-up window is ten minutes, and let it go back
to zero once the demand is gone and the pool idle.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from tests.kit.router_export import recorded_router_export, with_pending_demand
from tests.unit.operator.test_operator_kmock import (
    NAME,
    TD_PATH,
    _deployment_controller,
    _obj,
    _runner,
    _until,
    operator_resources,
    td_body,
)
from tests.unit.operator.test_router_pods import RouterPod, _free_port_on_all

pytestmark = pytest.mark.timeout(120)
INTERVAL_S = 3.0
#: kopf's timer tick (TANDEM_OPERATOR_TICK_S in operator_resources), the API round trips and a loaded box.
SLACK_S = 2.0


@pytest.fixture
def cluster(kmock: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    return operator_resources(kmock, monkeypatch)


def _replicas(kmock: Any, role: str) -> int | None:
    dep = _obj(kmock, "apps/v1/deployments", f"{NAME}-{role}")
    return None if dep is None else int(dep["spec"]["replicas"])


def _decode_status(kmock: Any) -> dict[str, Any]:
    td = _obj(kmock, "tandem.dev/v1alpha1/tandemdeployments", NAME) or {}
    return dict((td.get("status") or {}).get("autoscaling", {}).get("decode", {}))


async def test_a_decode_pool_at_zero_starts_within_one_interval_and_returns_to_zero(cluster: Any) -> None:
    port = _free_port_on_all(["127.0.0.1"])
    router = RouterPod("router-0", "127.0.0.1", 0)
    await router.start(port)
    quiet = recorded_router_export().replace("} 1.0\n", "} 0.0\n")  # nothing in flight anywhere
    quiet = quiet.replace("} 320.0\n", "} 0.0\n").replace("} 300.0\n", "} 0.0\n")
    router.text = quiet
    body = td_body(
        source="router",
        routerMetricsUrl=f"http://127.0.0.1:{port}/metrics",
        intervalSeconds=INTERVAL_S,
        scaleUpStabilizationSeconds=600,  # from zero must not wait for it
        scaleDownStabilizationSeconds=0,
    )
    body["spec"]["pools"]["decode"] = {"replicas": 0, "minReplicas": 0, "maxReplicas": 4}
    controller = asyncio.create_task(_deployment_controller(cluster))
    try:
        with _runner() as runner:
            await asyncio.sleep(1.0)  # discovery and watchers
            await cluster.post(TD_PATH, json=body)
            await _until(lambda: _replicas(cluster, "decode") == 0, "the decode pool, at zero")
            # Idle at zero: it stays there (two intervals, and the decision says why).
            await _until(lambda: _decode_status(cluster).get("currentReplicas") == 0, "a decision at zero")
            await asyncio.sleep(2 * INTERVAL_S)
            assert _replicas(cluster, "decode") == 0 and _replicas(cluster, "prefill") == 1

            # A request found no decode worker: the router counts it as the decode pool's pending demand.
            router.text = with_pending_demand(quiet, "decode", 2)
            raised_s = time.monotonic()
            await _until(lambda: _replicas(cluster, "decode") == 1, "the decode pool to start", timeout_s=30)
            started_after_s = time.monotonic() - raised_s
            assert started_after_s <= INTERVAL_S + SLACK_S, started_after_s
            assert _replicas(cluster, "prefill") == 1  # prefill's signals did not move
            decision = await _until(
                lambda: _decode_status(cluster).get("desiredReplicas") == 1 and _decode_status(cluster),
                "the decision in status",
            )
            assert decision["reason"] == "scale from zero: pending_demand asks 1", decision

            # The demand leaves the router's window and the pool idles: back to zero (min 0).
            router.text = quiet
            await _until(lambda: _replicas(cluster, "decode") == 0, "the decode pool back at zero", timeout_s=30)
            assert _replicas(cluster, "prefill") == 1  # its minReplicas
            await cluster.delete(f"{TD_PATH}/{NAME}")
            await _until(
                lambda: _obj(cluster, "tandem.dev/v1alpha1/tandemdeployments", NAME) is None, "finalizer released"
            )
        assert runner.exception is None, runner.output[-3000:]
    finally:
        controller.cancel()
        await router.stop()
