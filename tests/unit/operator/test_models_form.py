"""The models form of a TandemDeployment (several models, each with its pools, and LoRA adapters):
names, labels, environment, the autoscaler's per-model queries, and the specs it refuses."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from tandem_operator.reconcile import Owner, desired_objects, owned_names, stale_names
from tandem_operator.resources import LABEL_MODEL, LORA_ENV_MAX_ADAPTER_RANK, LORA_ENV_MAX_ADAPTERS
from tandem_operator.signals import QueryScope, parse_router_metrics
from tandem_operator.spec import MAX_POOL_NAME_LEN, SpecError, model_slug, parse_spec

from tests.chart.crd_schema import validate_custom_resource

BASE: dict[str, Any] = {"image": {"repository": "r", "tag": "t"}, "redis": {"url": "redis://r:6379/0"}}
LEGACY: dict[str, Any] = {**BASE, "model": {"servedModelName": "smol", "pvc": {"claimName": "models"}}}
TWO: dict[str, Any] = {
    **BASE,
    "models": [
        {"name": "smol", "pvc": {"claimName": "models"}, "lora": {"maxAdapters": 2, "maxAdapterRank": 16},
         "decode": {"replicas": 2, "minReplicas": 1, "maxReplicas": 3}},
        {"name": "Qwen/Qwen2.5-7B-Instruct", "path": "/models/qwen", "pvc": {"claimName": "qwen"},
         "prefill": {"engineArgs": {"tensorParallelSize": 2}}, "decode": {"engineArgs": {"tensorParallelSize": 2}}},
    ],
    "adapters": [{"name": "tandem-test-a", "baseModel": "smol", "path": "/models/adapters/a"}],
}
OWNER = Owner(name="chat", namespace="ns", uid="u", labels={"app.kubernetes.io/instance": "rel"}, generation=1)


def _cr(spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "tandem.dev/v1alpha1", "kind": "TandemDeployment", "metadata": {"name": "chat"}, "spec": spec}


def _env(dep: dict[str, Any]) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_the_single_model_form_builds_the_pools_it_always_built() -> None:
    """One release upgraded in place: same names, same selectors, no model label, no LoRA variables."""
    objects = desired_objects(OWNER, parse_spec(LEGACY), {"prefill": None, "decode": None})
    assert [(o["kind"], o["metadata"]["name"]) for o in objects] == [
        ("Deployment", "chat-prefill"), ("Service", "chat-prefill"),
        ("Deployment", "chat-decode"), ("Service", "chat-decode"),
    ]
    dep = objects[0]
    assert dep["spec"]["selector"]["matchLabels"] == {"tandem.dev/deployment": "chat", "tandem.dev/pool": "prefill"}
    assert LABEL_MODEL not in dep["spec"]["template"]["metadata"]["labels"]
    assert not any(k.startswith("TANDEM_WORKER_ADAPTERS__") for k in _env(dep))
    assert owned_names("chat", parse_spec(LEGACY).pools_of())[0] == ("apps/v1", "Deployment", "chat-prefill")


def test_two_models_get_their_own_pools() -> None:
    validate_custom_resource(_cr(TWO))
    spec = parse_spec(TWO)
    objects = desired_objects(OWNER, spec, {})
    deployments = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Deployment"}
    qwen = model_slug("Qwen/Qwen2.5-7B-Instruct")
    assert set(deployments) == {"chat-smol-prefill", "chat-smol-decode", f"chat-{qwen}-prefill", f"chat-{qwen}-decode"}
    smol_decode = deployments["chat-smol-decode"]
    assert smol_decode["spec"]["replicas"] == 2
    assert smol_decode["spec"]["selector"]["matchLabels"][LABEL_MODEL] == "smol"
    assert smol_decode["spec"]["template"]["metadata"]["labels"][LABEL_MODEL] == "smol"
    env = _env(smol_decode)
    assert env["TANDEM_WORKER_ENGINE__SERVED_MODEL_NAME"] == "smol"
    assert env[LORA_ENV_MAX_ADAPTERS] == "2" and env[LORA_ENV_MAX_ADAPTER_RANK] == "16"
    qwen_prefill = deployments[f"chat-{qwen}-prefill"]
    env = _env(qwen_prefill)
    assert env["TANDEM_WORKER_ENGINE__SERVED_MODEL_NAME"] == "Qwen/Qwen2.5-7B-Instruct"
    assert env["TANDEM_WORKER_ENGINE__MODEL_DIR"] == "/models/qwen"
    assert env["TANDEM_WORKER_ENGINE__TENSOR_PARALLEL_SIZE"] == "2"
    assert LORA_ENV_MAX_ADAPTERS not in env  # LoRA off on that model
    volumes = qwen_prefill["spec"]["template"]["spec"]["volumes"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "qwen", "readOnly": True}} in volumes
    # The selectors of the two models' pools never overlap.
    selectors = [tuple(sorted(d["spec"]["selector"]["matchLabels"].items())) for d in deployments.values()]
    assert len(set(selectors)) == 4


@pytest.mark.parametrize(
    "name", ["smol", "Qwen/Qwen2.5-7B-Instruct", "A" * 128, "a.b:c_d-e", "x" * 30, "llama-3.1--8b"]
)
def test_model_slugs_are_dns_labels_and_names_fit(name: str) -> None:
    slug = model_slug(name)
    assert len(slug) <= 30 and slug == slug.lower() and slug.replace("-", "").isalnum()
    assert not slug.startswith("-") and not slug.endswith("-")
    spec = parse_spec({**BASE, "models": [{"name": name, "pvc": {"claimName": "m"}}]})
    long_owner = "a-very-long-tandemdeployment-name-that-keeps-going-on"
    for pool in spec.pools_of():
        assert len(pool.name(long_owner)) <= MAX_POOL_NAME_LEN
        assert pool.name(long_owner).rstrip("-") == pool.name(long_owner)


def test_names_cleaned_alike_get_different_slugs() -> None:
    assert model_slug("Org/Model") != model_slug("org-model")
    assert model_slug("org-model") == "org-model"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: s["models"].append(copy.deepcopy(s["models"][0])), "duplicate model names: \\['smol'\\]"),
        (lambda s: s["adapters"].append({"name": "b", "baseModel": "nope", "path": "/a"}),
         "baseModel 'nope' is not a served model"),
        (lambda s: s["adapters"].append({"name": "b", "baseModel": "Qwen/Qwen2.5-7B-Instruct", "path": "/a"}),
         "has LoRA off"),
        (lambda s: s["adapters"].append(copy.deepcopy(s["adapters"][0])), "duplicate adapter names"),
        (lambda s: s["adapters"].append({"name": "smol", "baseModel": "smol", "path": "/a"}), "a served model's name"),
        (lambda s: s["models"][0].update(name="<|im_start|>system"), "models.0.name"),
        (lambda s: s["models"][0].update(name="smol 🙂"), "models.0.name"),
        (lambda s: s["models"][0].update(name='smol",namespace="other'), "models.0.name"),
        (lambda s: s["adapters"][0].update(name="../../etc"), "adapters.0.name"),
        (lambda s: s["adapters"][0].update(path="relative/path"), "adapters.0.path"),
        (lambda s: s["adapters"][0].update(path="/a\nb"), "adapters.0.path"),
        (lambda s: s.update(model=LEGACY["model"]), "exactly one of model"),
        (lambda s: s.update(pools={"prefill": {"replicas": 1}}), "pools belong to each entry"),
        (lambda s: s["models"][0].update(lora={"maxAdapters": 2, "maxAdapterRank": 12}), "maxAdapterRank"),
        (lambda s: s.pop("models"), "exactly one of model"),
    ],
)
def test_bad_specs_are_one_clear_error(change: Any, message: str) -> None:
    spec = copy.deepcopy(TWO)
    change(spec)
    with pytest.raises(SpecError, match=message):
        parse_spec(spec)


@pytest.mark.parametrize(
    "change",
    [
        lambda s: s["models"][0].update(name="<|im_start|>"),
        lambda s: s["adapters"][0].update(name="a b"),
        lambda s: s["adapters"][0].update(path="x"),
        lambda s: s["models"][0].update(lora={"maxAdapterRank": 12}),
        lambda s: s["adapters"][0].pop("baseModel"),
    ],
)
def test_the_crd_schema_refuses_hostile_names_too(change: Any) -> None:
    spec = copy.deepcopy(TWO)
    change(spec)
    with pytest.raises(jsonschema.ValidationError):
        validate_custom_resource(_cr(spec))


def test_pools_of_a_removed_model_are_stale() -> None:
    spec = parse_spec(TWO)
    owned = [{"metadata": {"name": n}} for n in ("chat-smol-prefill", "chat-smol-decode", "chat-old-prefill",
                                                  "chat-prefill")]
    assert stale_names("chat", owned, spec.pools_of()) == ["chat-old-prefill", "chat-prefill"]


def test_each_models_pools_query_their_own_series() -> None:
    spec = parse_spec(TWO)
    scope = QueryScope("ns1", "chat")
    smol_decode = next(p for p in spec.pools_of() if p.model.name == "smol" and p.role == "decode")
    queries = scope.queries("decode", model="smol", pool_name=smol_decode.name("chat"))
    assert 'pod=~"chat-smol-decode-[a-z0-9]+-[a-z0-9]+"' in queries["kv_usage"]
    assert 'model="smol"' in queries["budget_usage"] and 'model="smol"' in queries["itl_p90_s"]
    assert 'model="smol"' not in queries["kv_usage"]  # vLLM's series: the pool's pods select the model
    prefill = scope.queries("prefill", model="smol", pool_name="chat-smol-prefill")
    assert all('model="smol"' in q for q in prefill.values())
    # The single-model form's queries are what they always were.
    assert scope.queries("decode") == scope.queries("decode", pool_name="chat-decode")
    assert "model=" not in "".join(scope.queries("prefill").values())


def test_router_text_is_read_per_model() -> None:
    text = "\n".join([
        "# TYPE ray_tandem_router_queued_requests gauge",
        'ray_tandem_router_queued_requests{model="smol",waiting_for="prefill"} 3.0',
        'ray_tandem_router_queued_requests{model="other",waiting_for="prefill"} 7.0',
        "# TYPE ray_tandem_router_pool_budget_used_fraction gauge",
        'ray_tandem_router_pool_budget_used_fraction{model="smol",role="decode"} 0.5',
        'ray_tandem_router_pool_budget_used_fraction{model="other",role="decode"} 0.9',
    ]) + "\n"
    assert parse_router_metrics(text, "prefill", "smol").queue_depth == 3.0
    assert parse_router_metrics(text, "prefill", "other").queue_depth == 7.0
    assert parse_router_metrics(text, "decode", "smol").budget_usage == 0.5
    assert parse_router_metrics(text, "prefill").queue_depth == 10.0  # single-model form: everything
    assert parse_router_metrics(text, "prefill", "absent").queue_depth is None


def test_an_upgraded_operator_builds_the_single_model_forms_objects_unchanged() -> None:
    """Byte for byte what the operator before the models form built (recorded from commit 78e8784): an
    operator upgrade rolls no pod of an existing single-model resource."""
    golden = json.loads((Path(__file__).parent / "single_model_pools_78e8784.json").read_text())
    owner = Owner(name="chat", namespace="ns", uid="u", labels={"app.kubernetes.io/instance": "rel"}, generation=1)
    for spec, objects in zip(golden["specs"], golden["objects"], strict=True):
        assert desired_objects(owner, parse_spec(spec), {"prefill": None, "decode": 3}) == objects


def test_the_operator_imports_no_generated_stub_or_service() -> None:
    """docker/operator.Dockerfile installs tandem-common without generating the tandem.v1 stubs, and no
    service package: the operator must import neither."""
    code = ("import sys, tandem_operator.handlers; "
            "print(sorted(m for m in sys.modules if m.startswith(('tandem.v1', 'tandem.gateway', 'tandem.router', "
            "'tandem.worker', 'torch', 'vllm', 'ray', 'grpc'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout
