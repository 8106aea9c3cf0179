"""charts/tandem: internal TLS (values ``internalTLS``) and the NetworkPolicies
that fence the hops TLS does not cover (docs/security.md)."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
from tandem_operator.reconcile import Owner, desired_objects
from tandem_operator.spec import parse_spec

from tests.chart.conftest import RELEASE, find, one, render

K8S_VERSION = "1.30.0"
FULL = f"{RELEASE}-tandem"
TLS_ON = ("internalTLS.enabled=true",)


def _gateway_pod(docs: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    return one(docs, "Deployment", f"{FULL}-gateway")["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def test_internal_tls_mounts_the_secret_into_the_gateway_and_points_its_settings_at_it() -> None:
    docs = render(None, (*TLS_ON, "internalTLS.secretName=certs", "internalTLS.serverName=tandem-workers"))
    pod = _gateway_pod(docs)
    kubernetes_validate.validate(one(docs, "Deployment", f"{FULL}-gateway"), K8S_VERSION, strict=True)
    (volume,) = [v for v in pod["volumes"] if v["name"] == "internal-tls"]
    assert volume["secret"]["secretName"] == "certs"
    assert volume["secret"]["defaultMode"] == 0o440  # readable by the pod's group (fsGroup), nobody else
    container = pod["containers"][0]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "internal-tls"]
    assert mount["readOnly"] is True
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["TANDEM_GATEWAY_TLS__ENABLED"] == "true"
    assert env["TANDEM_GATEWAY_TLS__SERVER_NAME_OVERRIDE"] == "tandem-workers"
    for name, key in (("CERT_FILE", "tls.crt"), ("KEY_FILE", "tls.key"), ("CA_FILE", "ca.crt")):
        assert env[f"TANDEM_GATEWAY_TLS__{name}"] == f"{mount['mountPath']}/{key}"


def test_internal_tls_is_off_by_default() -> None:
    pod = _gateway_pod(render(None))
    assert not [v for v in pod["volumes"] if v["name"] == "internal-tls"]
    assert not [e for e in pod["containers"][0]["env"] if "_TLS__" in e["name"]]


def test_internal_tls_reaches_the_operators_pools_with_the_same_files() -> None:
    docs = render(None, (*TLS_ON, "internalTLS.secretName=certs", "internalTLS.serverName=tandem-workers"))
    gateway_env = {e["name"]: e.get("value") for e in _gateway_pod(docs)["containers"][0]["env"]}
    (td,) = find(docs, "TandemDeployment")
    assert td["spec"]["tls"] == {"secretName": "certs", "serverName": "tandem-workers"}
    owner = Owner(name=td["metadata"]["name"], namespace="tandem", uid="uid-1", labels={}, generation=1)
    pools = [
        d
        for d in desired_objects(owner, parse_spec(td["spec"]), {"prefill": None, "decode": None})
        if d["kind"] == "Deployment"
    ]
    assert len(pools) == 2
    for pool in pools:
        pod = pool["spec"]["template"]["spec"]
        kubernetes_validate.validate(pool, K8S_VERSION, strict=True)
        (volume,) = [v for v in pod["volumes"] if v["name"] == "internal-tls"]
        assert volume["secret"]["secretName"] == "certs"
        container = pod["containers"][0]
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "internal-tls"]
        assert mount["readOnly"] is True
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["TANDEM_WORKER_TLS__ENABLED"] == "true"
        for name in ("CERT_FILE", "KEY_FILE", "CA_FILE", "SERVER_NAME_OVERRIDE"):
            assert env[f"TANDEM_WORKER_TLS__{name}"] == gateway_env[f"TANDEM_GATEWAY_TLS__{name}"]


def test_the_router_admits_the_gateway_on_its_grpc_port_and_the_dashboard_to_kuberay_only() -> None:
    docs = render(None)
    router = one(docs, "NetworkPolicy", f"{FULL}-router")["spec"]
    grpc_port = one(docs, "Service", f"{FULL}-router")["spec"]["ports"][0]["port"]
    gateway_rule = router["ingress"][0]
    assert gateway_rule["ports"] == [{"port": grpc_port, "protocol": "TCP"}]
    assert [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in gateway_rule["from"]] == ["gateway"]
    dashboard = [r for r in router["ingress"] if {"port": 8265, "protocol": "TCP"} in r.get("ports", [])]
    (rule,) = dashboard
    (peer,) = rule["from"]
    assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "kuberay-operator"}
    assert "namespaceSelector" in peer  # both in one peer: KubeRay's pods, not every pod of those namespaces
    # Every rule but the router's own pods (Ray's internal traffic) names its ports.
    unported = [r for r in router["ingress"] if not r.get("ports")]
    assert [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for r in unported for p in r["from"]] == [
        "router"
    ]


def test_no_policy_opens_a_worker_port_to_everyone() -> None:
    for doc in find(render(None), "NetworkPolicy"):
        for rule in doc["spec"].get("ingress", []):
            if not rule.get("from"):
                assert doc["metadata"]["name"] == f"{FULL}-gateway"
