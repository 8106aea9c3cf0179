"""The scheduling options platforms give GPU pools (issue 43, item 3), from the chart's values through the
TandemDeployment to the Deployments the operator makes (the operator's own code, as in the cluster):
affinity, topology spread, priorityClassName, runtimeClassName, pod annotations and labels, Dynamic
Resource Allocation claims and the rollout's surge and unavailability, per pool, in both forms. Every
object is checked against the CRD's schema or Kubernetes' own (kubernetes-validate, strict).

Inconsistent values fail at render time with a message naming the pool: a GPU accelerator without a GPU
limit, a tensor-parallel size above the GPUs, a rollout that could never start, an operator-owned label.
A tensor-parallel worker declares one KV port per rank and the workers' NetworkPolicy admits them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from tandem_operator.reconcile import Owner, desired_objects
from tandem_operator.resources import KV_PORT
from tandem_operator.spec import SpecError, parse_spec

from tests.chart.conftest import CHART, RELEASE, find, one, render, run_helm
from tests.chart.crd_schema import validate_custom_resource

#: Pod-level ``resourceClaims[].resourceClaimName`` exists from Kubernetes 1.31 (1.27-1.30 had ``source``);
#: Dynamic Resource Allocation is GA in 1.34. The chart's other tests validate against 1.30.
K8S_VERSION = "1.34.0"
FULL = f"{RELEASE}-tandem"

AFFINITY = {
    "nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [
                {
                    "matchExpressions": [
                        {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-H100-80GB-HBM3"]}
                    ]
                }
            ]
        }
    },
    "podAntiAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {
                "weight": 50,
                "podAffinityTerm": {
                    "topologyKey": "kubernetes.io/hostname",
                    "labelSelector": {"matchLabels": {"tandem.dev/pool": "prefill"}},
                },
            }
        ]
    },
}
SPREAD = [
    {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway"},
    {
        "maxSkew": 2,
        "topologyKey": "kubernetes.io/hostname",
        "whenUnsatisfiable": "DoNotSchedule",
        "labelSelector": {"matchLabels": {"team": "llm"}},
    },
]
PREFILL_OPTIONS: dict[str, Any] = {
    "resources": {
        "requests": {"cpu": "8", "memory": "48Gi", "nvidia.com/gpu": 2},
        "limits": {"memory": "64Gi", "nvidia.com/gpu": 2},
    },
    "engineArgs": {"dtype": "bfloat16", "tensorParallelSize": 2},
    "affinity": AFFINITY,
    "topologySpreadConstraints": SPREAD,
    "priorityClassName": "llm-serving",
    "runtimeClassName": "nvidia",
    "podAnnotations": {"k8s.v1.cni.cncf.io/networks": "rdma-net", "note": "Zürich → 東京 🚀"},
    "podLabels": {"team": "llm", "cost-center": "42"},
    "resourceClaims": [
        {"name": "rdma", "resourceClaimTemplateName": "rdma-nic"},
        {"name": "shared-nic", "resourceClaimName": "nic-0"},
    ],
    "rollout": {"maxSurge": 0, "maxUnavailable": "25%"},
    # Kubernetes' "every effect": the values schema allowed it before the CRD did.
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": ""}],
}


def _values_file(tmp_path: Path, values: dict[str, Any]) -> str:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values, allow_unicode=True))
    return str(path)


def _gpu_values(prefill: dict[str, Any]) -> dict[str, Any]:
    """GPU values with ``prefill`` as the prefill pool; the decode pool has its KV settings (dtype, tensor-parallel
    size, and GPUs for as many ranks), or the two could never pair and the render fails."""
    decode: dict[str, Any] = {"resources": {"limits": {"nvidia.com/gpu": 1}}}
    if "engineArgs" in prefill:
        gpus = prefill.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 1)
        decode = {"resources": {"limits": {"nvidia.com/gpu": gpus}}, "engineArgs": prefill["engineArgs"]}
    return {"accelerator": "gpu", "tandemDeployment": {"pools": {"prefill": prefill, "decode": decode}}}


def _pools(docs: tuple[dict[str, Any], ...]) -> dict[str, dict[str, Any]]:
    """The operator's Deployments for the chart's TandemDeployment, by name (the CR checked on the way)."""
    (td,) = find(docs, "TandemDeployment")
    validate_custom_resource(td)
    owner = Owner(
        name=td["metadata"]["name"], namespace="tandem", uid="uid-1", labels=td["metadata"]["labels"], generation=1
    )
    objects = desired_objects(owner, parse_spec(td["spec"]), {})
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == "Deployment"}


def _assert_scheduled(deployment: dict[str, Any]) -> None:
    template = deployment["spec"]["template"]
    pod, container = template["spec"], template["spec"]["containers"][0]
    assert pod["affinity"] == AFFINITY
    selector = deployment["spec"]["selector"]["matchLabels"]
    # A constraint without a labelSelector counts this pool's own pods; one with a selector keeps it.
    assert pod["topologySpreadConstraints"] == [{**SPREAD[0], "labelSelector": {"matchLabels": selector}}, SPREAD[1]]
    assert pod["priorityClassName"] == "llm-serving" and pod["runtimeClassName"] == "nvidia"
    assert template["metadata"]["annotations"] == {
        **PREFILL_OPTIONS["podAnnotations"],
        "kubectl.kubernetes.io/default-container": "worker",
    }
    labels = template["metadata"]["labels"]
    assert labels["team"] == "llm" and labels["cost-center"] == "42"
    assert all(labels[k] == v for k, v in selector.items())  # the pool's selector still selects its pods
    assert pod["resourceClaims"] == PREFILL_OPTIONS["resourceClaims"]
    assert container["resources"]["claims"] == [{"name": "rdma"}, {"name": "shared-nic"}]
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": "25%"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": ""}]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["kv"] == KV_PORT and ports["kv-1"] == KV_PORT + 1 and "kv-2" not in ports


def _kv_rule_ports(docs: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    policy = one(docs, "NetworkPolicy", f"{FULL}-workers")
    (rule,) = [r for r in policy["spec"]["ingress"] if {"port": "kv", "protocol": "TCP"} in r["ports"]]
    return list(rule["ports"])


def test_every_option_reaches_the_pools_deployment_in_the_single_model_form(tmp_path: Path) -> None:
    docs = render(_values_file(tmp_path, _gpu_values(PREFILL_OPTIONS)))
    pools = _pools(docs)
    _assert_scheduled(pools[f"{FULL}-prefill"])
    # The other pool keeps the defaults: nothing of the prefill's options, the surge-first rollout (its engine
    # arguments are the prefill's: pools of one model pair only at one dtype and tensor-parallel size).
    decode = pools[f"{FULL}-decode"]
    pod = decode["spec"]["template"]["spec"]
    assert (
        not {"affinity", "topologySpreadConstraints", "priorityClassName", "runtimeClassName", "resourceClaims"}
        & pod.keys()
    )
    assert decode["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert "kv-1" in {p["name"] for p in pod["containers"][0]["ports"]}
    # Rank 1's KV port is admitted from the other workers (rank r listens on the kv port + r).
    assert {"port": KV_PORT + 1, "endPort": KV_PORT + 1, "protocol": "TCP"} in _kv_rule_ports(docs)


def test_every_option_reaches_the_pools_deployment_in_the_models_form(tmp_path: Path) -> None:
    two = yaml.safe_load((CHART / "examples" / "values-gpu-two-models.yaml").read_text())
    first = two["tandemDeployment"]["models"][0]
    first["prefill"] = {**first["prefill"], **PREFILL_OPTIONS}
    # The same KV settings for its decode pool, or the two could never pair (the render fails).
    first["decode"] = {**first["decode"], **{k: PREFILL_OPTIONS[k] for k in ("resources", "engineArgs")}}
    docs = render(_values_file(tmp_path, two))
    pools = _pools(docs)
    (prefill,) = [d for name, d in pools.items() if "llama" in name and name.endswith("-prefill")]
    _assert_scheduled(prefill)


def test_the_kv_ports_of_every_rank_are_admitted_and_one_rank_needs_no_range() -> None:
    # The two-model example's second model runs tensor-parallel 2; the default values run 1.
    assert {"port": KV_PORT + 1, "endPort": KV_PORT + 1, "protocol": "TCP"} in _kv_rule_ports(
        render("examples/values-gpu-two-models.yaml")
    )
    assert _kv_rule_ports(render(None)) == [{"port": "kv", "protocol": "TCP"}]


@pytest.mark.parametrize(
    ("prefill", "accelerator", "message"),
    [
        (
            {"resources": {"limits": {"memory": "8Gi"}}},
            "gpu",
            "tandemDeployment.pools.prefill: accelerator is gpu but resources.limits has no nvidia.com/gpu",
        ),
        (
            {"resources": {"limits": {"nvidia.com/gpu": 2}}, "engineArgs": {"tensorParallelSize": 4}},
            "gpu",
            "tandemDeployment.pools.prefill: engineArgs.tensorParallelSize 4 > the 2 GPU(s)",
        ),
        (
            {"rollout": {"maxSurge": 0, "maxUnavailable": "0%"}},
            "cpu",
            "tandemDeployment.pools.prefill: rollout.maxSurge and rollout.maxUnavailable cannot both be 0",
        ),
    ],
)
def test_inconsistent_pools_fail_at_render_time_naming_the_pool(
    tmp_path: Path, prefill: dict[str, Any], accelerator: str, message: str
) -> None:
    values = _gpu_values(prefill) | {"accelerator": accelerator}
    proc = run_helm("template", RELEASE, str(CHART), "-f", _values_file(tmp_path, values), check=False)
    assert proc.returncode != 0
    assert message in proc.stderr


def test_a_models_form_pool_is_checked_too(tmp_path: Path) -> None:
    two = yaml.safe_load((CHART / "examples" / "values-gpu-two-models.yaml").read_text())
    two["tandemDeployment"]["models"][1]["decode"]["engineArgs"]["tensorParallelSize"] = 4
    proc = run_helm("template", RELEASE, str(CHART), "-f", _values_file(tmp_path, two), check=False)
    assert proc.returncode != 0
    assert "tandemDeployment.models[1].decode: engineArgs.tensorParallelSize 4 > the 2 GPU(s)" in proc.stderr


@pytest.mark.parametrize(
    "prefill",
    [
        {"podLabels": {"app.kubernetes.io/component": "mine"}},  # the operator's label
        {"resourceClaims": [{"name": "rdma"}]},  # no source
        {"rollout": {"maxSurge": "150%"}},
        {"resources": {"limits": {"cpu": 0.5}}},  # a number the CRD's int-or-string refuses
    ],
)
def test_the_values_schema_refuses_what_the_crd_or_the_operator_would(tmp_path: Path, prefill: dict[str, Any]) -> None:
    values = {"tandemDeployment": {"pools": {"prefill": prefill}}}
    proc = run_helm("template", RELEASE, str(CHART), "-f", _values_file(tmp_path, values), check=False)
    assert proc.returncode != 0
    assert "schema" in proc.stderr.lower() or "values don't meet" in proc.stderr.lower()


BASE_SPEC: dict[str, Any] = {
    "model": {"servedModelName": "m", "pvc": {"claimName": "models"}},
    "image": {"repository": "r", "tag": "t"},
    "redis": {"url": "redis://r:6379/0"},
}


@pytest.mark.parametrize(
    ("pool", "message"),
    [
        (
            {"resources": {"limits": {"nvidia.com/gpu": 1}}, "engineArgs": {"tensorParallelSize": 2}},
            "tensorParallelSize 2 > the 1 GPU",
        ),
        ({"podLabels": {"tandem.dev/pool": "decode"}}, "podLabels ['tandem.dev/pool']"),
        (
            {
                "topologySpreadConstraints": [
                    {"maxSkew": 0, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"}
                ]
            },
            "topologySpreadConstraints[0]: needs maxSkew >= 1",
        ),
        (
            {"resourceClaims": [{"name": "a", "resourceClaimName": "x", "resourceClaimTemplateName": "y"}]},
            "give resourceClaimName or resourceClaimTemplateName",
        ),
        (
            {"resourceClaims": [{"name": "a", "resourceClaimName": "x"}, {"name": "a", "resourceClaimName": "y"}]},
            "duplicate names ['a']",
        ),
        ({"rollout": {"maxSurge": 0, "maxUnavailable": 0}}, "cannot both be 0"),
        ({"rollout": {"maxSurge": "x%"}}, "a count >= 0 or a percentage"),
    ],
)
def test_the_operator_refuses_an_inconsistent_pool_with_one_clear_error(pool: dict[str, Any], message: str) -> None:
    """A resource applied without the chart (kubectl) meets the same rules in the operator's SpecValid status."""
    with pytest.raises(SpecError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_spec({**BASE_SPEC, "pools": {"prefill": pool}})
