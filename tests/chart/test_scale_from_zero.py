"""``minReplicas: 0`` for each pool (issue 42 item 4): the values schema (helm checks it), the chart's own
bounds check, the CRD and the operator's spec parsing all accept a pool at zero, in the single-model and
the models form, and the operator's Deployment for it has zero replicas and validates. The gateway's
readiness probe stays /readyz, which no longer needs a worker of each role."""

from __future__ import annotations

import kubernetes_validate
import pytest
from tandem_operator.reconcile import Owner, desired_objects
from tandem_operator.spec import parse_spec

from tests.chart.conftest import find, render
from tests.chart.crd_schema import validate_custom_resource

K8S_VERSION = "1.30.0"
TWO_MODELS = "examples/values-gpu-two-models.yaml"


def _pool_deployments(td: dict[str, object]) -> dict[str, dict[str, object]]:
    meta = td["metadata"]
    assert isinstance(meta, dict)
    owner = Owner(name=meta["name"], namespace="tandem", uid="uid-1", labels=meta["labels"], generation=1)
    spec = parse_spec(td["spec"])
    objects = desired_objects(owner, spec, {})
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == "Deployment"}


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_single_model_pool_may_start_and_sit_at_zero(role: str) -> None:
    at = f"tandemDeployment.pools.{role}"
    docs = render(None, (f"{at}.replicas=0", f"{at}.minReplicas=0"))
    (td,) = find(docs, "TandemDeployment")
    validate_custom_resource(td)
    pools = td["spec"]["pools"]
    assert (pools[role]["replicas"], pools[role]["minReplicas"]) == (0, 0)
    other = "decode" if role == "prefill" else "prefill"
    assert pools[other]["minReplicas"] == 1
    deployments = _pool_deployments(td)
    name = td["metadata"]["name"]
    assert deployments[f"{name}-{role}"]["spec"]["replicas"] == 0
    assert deployments[f"{name}-{other}"]["spec"]["replicas"] == 1


def test_a_model_of_the_models_form_may_have_a_pool_at_zero() -> None:
    docs = render(
        TWO_MODELS, ("tandemDeployment.models[1].decode.replicas=0", "tandemDeployment.models[1].decode.minReplicas=0")
    )
    (td,) = find(docs, "TandemDeployment")
    validate_custom_resource(td)
    deployments = _pool_deployments(td)
    zero = [n for n, d in deployments.items() if d["spec"]["replicas"] == 0]
    assert len(deployments) == 4 and len(zero) == 1 and zero[0].endswith("-decode"), sorted(deployments)


def test_the_gateway_probe_is_readyz() -> None:
    docs = render(None, ("tandemDeployment.pools.decode.replicas=0", "tandemDeployment.pools.decode.minReplicas=0"))
    (gateway,) = [d for d in find(docs, "Deployment") if d["metadata"]["name"].endswith("-gateway")]
    (container,) = [c for c in gateway["spec"]["template"]["spec"]["containers"] if c["name"] == "gateway"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
