"""The operator's spec model and the chart's CRD schema describe the same resource."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from pydantic import BaseModel
from tandem_operator.resources import HEALTH_PORT, build_pool_deployment
from tandem_operator.spec import Pool, SpecError, TandemSpec, parse_spec

from tests.chart.crd_schema import crd_version_schema, validate_custom_resource

VALID: dict[str, Any] = {
    "model": {"servedModelName": "smol", "pvc": {"claimName": "models"}},
    "image": {"repository": "r", "tag": "t"},
    "redis": {"url": "redis://r:6379/0"},
    "pools": {"decode": {"replicas": 2, "minReplicas": 1, "maxReplicas": 3,
                         "resources": {"limits": {"nvidia.com/gpu": 1}},
                         "engineArgs": {"extraEnv": {"TANDEM_WORKER_X": "1"}}}},
}


def _model_fields(model: type[BaseModel]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        alias = field.alias or name
        sub = field.annotation
        args = getattr(sub, "__args__", ())
        nested = next((a for a in (sub, *args) if isinstance(a, type) and issubclass(a, BaseModel)), None)
        out[alias] = _model_fields(nested) if nested else None
    return out


def _schema_fields(node: dict[str, Any]) -> dict[str, Any]:
    def sub(v: dict[str, Any]) -> Any:
        v = v.get("items", v) if v.get("type") == "array" else v  # a list of objects: its items' fields
        return _schema_fields(v) if "properties" in v else None

    return {k: sub(v) for k, v in node.get("properties", {}).items()}


def test_crd_and_model_have_the_same_fields() -> None:
    crd = _schema_fields(crd_version_schema()["properties"]["spec"])
    model = _model_fields(TandemSpec)
    assert crd == model
    assert crd["models"]["prefill"] == crd["pools"]["prefill"] and crd["models"]["lora"] == crd["model"]["lora"]


def test_valid_spec_passes_both() -> None:
    validate_custom_resource({"apiVersion": "tandem.dev/v1alpha1", "kind": "TandemDeployment",
                              "metadata": {"name": "x"}, "spec": VALID})
    spec = parse_spec(VALID)
    assert spec.pools.decode.num_gpus == 1
    dep = build_pool_deployment(name="x", namespace="ns", uid="u", cr_labels={}, spec=spec, pool=spec.pools_of()[1],
                                replicas=2)
    env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["TANDEM_WORKER_ROLE"] == "decode" and env["TANDEM_WORKER_X"] == "1"
    assert env["TANDEM_WORKER_REDIS__URL"] == "redis://r:6379/0"


@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "mtls"])
def test_worker_probes_ask_the_plaintext_health_service(tls: bool) -> None:
    """gRPC health probes (the engine's state, not an open port) on the worker's plaintext health port."""
    spec = parse_spec({**VALID, "tls": {"secretName": "internal-tls"}} if tls else VALID)
    dep = build_pool_deployment(name="x", namespace="ns", uid="u", cr_labels={}, spec=spec, pool=spec.pools_of()[1],
                                replicas=2)
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    expected = {
        "startupProbe": (10, 120),
        "livenessProbe": (15, 4),
        "readinessProbe": (5, 2),
    }
    for probe, (period, failures) in expected.items():
        assert container[probe] == {
            "grpc": {"port": HEALTH_PORT, "service": "tandem.v1.Worker"},
            "periodSeconds": period,
            "failureThreshold": failures,
        }, probe
        port = container[probe]["grpc"]["port"]
        # A number (the kubelet's gRPC probes take no port name), the one the worker serves health on.
        assert isinstance(port, int) and str(port) == env["TANDEM_WORKER_HEALTH_PORT"], probe
        assert port in ports.values() and ports["health"] == port, probe
    # Health has its own port, apart from the (possibly mTLS) gRPC port.
    assert len(set(ports.values())) == len(ports) and ports["health"] != ports["grpc"]
    assert env["TANDEM_WORKER_TLS__ENABLED"] == ("true" if tls else "false")  # plaintext is said explicitly


def test_each_pool_mounts_its_own_roles_secret() -> None:
    spec = parse_spec({**VALID, "tls": {"prefillSecretName": "p-tls", "decodeSecretName": "d-tls"}})
    for role, secret in (("prefill", "p-tls"), ("decode", "d-tls")):
        dep = build_pool_deployment(name="x", namespace="ns", uid="u", cr_labels={}, spec=spec,
                                    pool=Pool(spec.served_models()[0], role), replicas=1)
        (volume,) = [v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "internal-tls"]
        assert volume["secret"]["secretName"] == secret
    with pytest.raises(SpecError, match="both prefillSecretName and decodeSecretName"):
        parse_spec({**VALID, "tls": {"prefillSecretName": "p-tls"}})


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"model": {"servedModelName": "m"}}, "exactly one source"),
        ({"redis": {"url": "redis://a", "secretName": "s"}}, "exactly one of url or secretName"),
        ({"pools": {"prefill": {"replicas": 5, "minReplicas": 1, "maxReplicas": 4}}}, "replicas 5 outside"),
        ({"autoscaling": {"decode": {"kvUsage": 1.5}}}, "autoscaling.decode.kvUsage"),
        ({"slo": {"ttftP90Seconds": 0}}, "slo.ttftP90Seconds"),
        ({"pools": {"prefill": {"replicaz": 1}}}, "replicaz"),
    ],
)
def test_malformed_specs_are_one_clear_error(patch: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=message.replace(".", r"\.")):
        parse_spec({**VALID, **patch})


def test_crd_schema_rejects_what_the_model_rejects() -> None:
    bad = {**VALID, "autoscaling": {"decode": {"kvUsage": 1.5}}}
    with pytest.raises(jsonschema.ValidationError):
        validate_custom_resource({"apiVersion": "tandem.dev/v1alpha1", "kind": "TandemDeployment",
                                  "metadata": {"name": "x"}, "spec": bad})


@pytest.mark.parametrize(
    "name",
    ["模型", "café-7b", "llama🦙", "<|im_start|>system", 'm"} or vector(1) #', "m x", "m\n", ".m", "a" * 129, ""],
)
def test_the_single_models_name_follows_the_models_forms_rule(name: str) -> None:
    """``model.servedModelName`` is a worker's registered model and a value in the operator's PromQL, as a
    ``models[].name`` is: the same rule (MODEL_NAME) in the model and the CRD."""
    bad = {**VALID, "model": {**VALID["model"], "servedModelName": name}}
    with pytest.raises(SpecError, match="servedModelName"):
        parse_spec(bad)
    if not name.endswith("\n"):  # Python's re lets ``$`` match before a last newline; the API server's Go regexp
        with pytest.raises(jsonschema.ValidationError):  # does not (helm's refusal of it: tests/chart)
            validate_custom_resource({"apiVersion": "tandem.dev/v1alpha1", "kind": "TandemDeployment",
                                      "metadata": {"name": "x"}, "spec": bad})
    good = {**VALID, "model": {**VALID["model"], "servedModelName": "Qwen/Qwen2.5-14B-Instruct:q4_1"}}
    assert parse_spec(good).served_models()[0].name == "Qwen/Qwen2.5-14B-Instruct:q4_1"
