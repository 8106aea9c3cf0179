"""The chart's models form (tandemDeployment.models, .adapters): the two-model GPU example renders a
TandemDeployment the CRD and the operator accept, and the pools the operator makes of it validate."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from tandem_operator.reconcile import Owner, desired_objects
from tandem_operator.resources import LABEL_MODEL
from tandem_operator.spec import parse_spec

from tandem.common.registry import MODEL_NAME
from tests.chart.conftest import CHART, RELEASE, find, one, render, run_helm, values_args
from tests.chart.crd_schema import validate_custom_resource

K8S_VERSION = "1.30.0"
TWO_MODELS = "examples/values-gpu-two-models.yaml"


def _td(values: str | None, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    (td,) = find(render(values, extra), "TandemDeployment")
    return td


def test_the_two_model_example_gives_each_model_its_pools() -> None:
    td = _td(TWO_MODELS)
    validate_custom_resource(td)
    spec = parse_spec(td["spec"])
    assert [m.name for m in spec.served_models()] == ["Llama-3.1-8B-Instruct", "Qwen/Qwen2.5-14B-Instruct"]
    assert "model" not in td["spec"] and "pools" not in td["spec"]
    assert [(a.name, a.base_model) for a in spec.adapters] == [
        ("support-bot", "Llama-3.1-8B-Instruct"),
        ("sql-writer", "Llama-3.1-8B-Instruct"),
    ]
    owner = Owner(
        name=td["metadata"]["name"], namespace="tandem", uid="uid-1", labels=td["metadata"]["labels"], generation=1
    )
    objects = desired_objects(owner, spec, {})
    assert len(objects) == 8  # two models × two pools × (Deployment, Service)
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        assert len(obj["metadata"]["name"]) <= 63
    deployments = [o for o in objects if o["kind"] == "Deployment"]
    models = {d["spec"]["selector"]["matchLabels"][LABEL_MODEL] for d in deployments}
    assert len(models) == 2
    qwen = [d for d in deployments if "qwen" in d["metadata"]["name"]]
    assert len(qwen) == 2
    for dep in qwen:
        container = dep["spec"]["template"]["spec"]["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["TANDEM_WORKER_ENGINE__TENSOR_PARALLEL_SIZE"] == "2"
        assert "TANDEM_WORKER_ADAPTERS__MAX_ADAPTERS" not in env
    llama = [d for d in deployments if "llama" in d["metadata"]["name"]]
    for dep in llama:
        env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["TANDEM_WORKER_ADAPTERS__MAX_ADAPTERS"] == "4"
        assert env["TANDEM_WORKER_ADAPTERS__MAX_ADAPTER_RANK"] == "64"


def test_the_default_chart_keeps_the_single_model_form() -> None:
    """A release upgraded in place keeps its pools' names: no models list unless the values give one."""
    td = _td(None)
    assert "models" not in td["spec"] and "adapters" not in td["spec"]
    assert td["spec"]["model"]["servedModelName"] and set(td["spec"]["pools"]) == {"prefill", "decode"}


def test_the_operator_reads_its_redis_url_optionally_and_may_reach_redis() -> None:
    docs = render(None)
    (operator,) = [d for d in find(docs, "Deployment") if d["metadata"]["name"].endswith("-operator")]
    env = {e["name"]: e for e in operator["spec"]["template"]["spec"]["containers"][0]["env"]}
    ref = env["TANDEM_OPERATOR_REDIS_URL"]["valueFrom"]["secretKeyRef"]
    assert ref["optional"] is True and ref["key"] == "operator-url"  # the chart's default: redis.auth on
    policy = one(docs, "NetworkPolicy", "rel-tandem-redis")
    sources = [
        p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in policy["spec"]["ingress"][0]["from"]
    ]
    assert "operator" in sources


@pytest.mark.parametrize(
    "bad",
    [
        "tandemDeployment.models[0].name=<|im_start|>",
        "tandemDeployment.adapters[0].path=relative",
        "tandemDeployment.models[0].lora.maxAdapterRank=12",
    ],
)
def test_values_schema_refuses_hostile_models_and_adapters(bad: str) -> None:
    proc = run_helm("template", RELEASE, str(CHART), *values_args(TWO_MODELS, (bad,)), check=False)
    assert proc.returncode != 0
    assert "schema" in proc.stderr.lower() or "values don't meet" in proc.stderr.lower(), proc.stderr


@pytest.mark.parametrize(
    "name", ["模型", "café-7b", "llama🦙", "<|im_start|>system", 'm"x', "m x", "m\n", ".m", "a" * 129, ""]
)
def test_values_schema_refuses_a_served_model_name_workers_cannot_register(name: str, tmp_path: Path) -> None:
    """The single-model form's ``model.servedModelName`` under the rule of ``tandemDeployment.models[].name``
    and of the gateway's and the workers' model (tandem.common.registry.MODEL_NAME): a name no worker may
    register would render, install, and then never be served."""
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"model": {"servedModelName": name}}, allow_unicode=True), encoding="utf-8")
    proc = run_helm("template", RELEASE, str(CHART), "-f", str(values), check=False)
    assert proc.returncode != 0, proc.stdout[:200]
    assert "servedModelName" in proc.stderr, proc.stderr


def test_the_values_schema_names_models_by_the_registrys_rule() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    single = schema["properties"]["model"]["properties"]["servedModelName"]["pattern"]
    listed = schema["properties"]["tandemDeployment"]["properties"]["models"]["items"]["properties"]["name"]["pattern"]
    assert single == listed == MODEL_NAME.pattern


#: Model names whose slugs the chart's template must make exactly as the operator does.
TRICKY_NAMES = [
    "smol",
    "Llama-3.1-8B-Instruct",
    "Qwen/Qwen2.5-14B-Instruct",
    "a" * 31,
    "x.y",
    "9b",
    "org/-weird--name-",
    "A" * 128,
]


@pytest.mark.parametrize("values", [TWO_MODELS, "tricky"])
def test_each_pool_has_its_own_disruption_budget_selecting_exactly_its_pods(values: str) -> None:
    extra: tuple[str, ...] = ()
    if values == "tricky":
        extra = tuple(
            f"tandemDeployment.models[{i}].name={name},tandemDeployment.models[{i}].pvc.claimName=m"
            for i, name in enumerate(TRICKY_NAMES)
        )
        values = None  # type: ignore[assignment]
    docs = render(values, extra)
    td = _td(values, extra)
    owner = Owner(
        name=td["metadata"]["name"], namespace="tandem", uid="uid-1", labels=td["metadata"]["labels"], generation=1
    )
    spec = parse_spec(td["spec"])
    pools = [o for o in desired_objects(owner, spec, {}) if o["kind"] == "Deployment"]
    budgets = [d for d in find(docs, "PodDisruptionBudget") if not d["metadata"]["name"].endswith("-gateway")]
    assert len(budgets) == len(pools) == 2 * len(spec.served_models())
    for pdb in budgets:
        selector = pdb["spec"]["selector"]["matchLabels"]
        selected = [
            p["metadata"]["name"]
            for p in pools
            if selector.items() <= p["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(selected) == 1, (pdb["metadata"]["name"], selected)
