"""charts/tandem: internal TLS (values ``internalTLS``, on by default) and the
NetworkPolicies that fence the hops TLS does not cover (docs/security.md).

Each component mounts its own role's certificate (gateway, the router's TLS
front, each worker pool through the operator); the certificates come from
cert-manager when the cluster serves it, else from a CA that Helm generates.
The certificates Helm generates are put to work: a worker-shaped gRPC server
with the prefill role's Secret answers the gateway's Secret and refuses the
decode role's with PERMISSION_DENIED, as a worker pod would."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from typing import Any

import grpc
import kubernetes_validate
import pytest
from tandem_operator.reconcile import Owner, desired_objects
from tandem_operator.spec import parse_spec

from tandem.common.identity import DENIED_MESSAGE, ROLES, role_checks
from tandem.common.tls import TLSSettings, add_port, aio_channel
from tandem.v1 import worker_pb2, worker_pb2_grpc
from tests.chart.conftest import RELEASE, find, one, render
from tests.kit.gateway import FakeWorker

K8S_VERSION = "1.30.0"
FULL = f"{RELEASE}-tandem"
PREFIX = f"{FULL}-tls"
CERT_MANAGER = ("cert-manager.io/v1",)


def _gateway_pod(docs: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    return one(docs, "Deployment", f"{FULL}-gateway")["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in container["env"]}


def _mounted_secret(pod: dict[str, Any], container: dict[str, Any]) -> tuple[str, str]:
    (volume,) = [v for v in pod["volumes"] if v["name"] == "internal-tls"]
    assert volume["secret"]["defaultMode"] == 0o440  # readable by the pod's group (fsGroup), nobody else
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "internal-tls"]
    assert mount["readOnly"] is True
    return volume["secret"]["secretName"], mount["mountPath"]


def test_internal_tls_is_on_by_default_and_the_gateway_mounts_its_own_certificate() -> None:
    docs = render(None)
    pod = _gateway_pod(docs)
    kubernetes_validate.validate(one(docs, "Deployment", f"{FULL}-gateway"), K8S_VERSION, strict=True)
    container = pod["containers"][0]
    secret, path = _mounted_secret(pod, container)
    assert secret == f"{PREFIX}-gateway"
    env = _env(container)
    assert env["TANDEM_GATEWAY_TLS__ENABLED"] == "true"
    assert env["TANDEM_GATEWAY_TLS__SERVER_NAME_OVERRIDE"] == "tandem-internal"
    for name, key in (("CERT_FILE", "tls.crt"), ("KEY_FILE", "tls.key"), ("CA_FILE", "ca.crt")):
        assert env[f"TANDEM_GATEWAY_TLS__{name}"] == f"{path}/{key}"
    # The gateway dials the router's TLS front, and the Service exposes only that port.
    service = one(docs, "Service", f"{FULL}-router")["spec"]["ports"]
    assert service == [{"name": "grpc-tls", "port": 9443, "targetPort": "grpc-tls", "protocol": "TCP"}]
    assert env["TANDEM_GATEWAY_ROUTER_ADDRESS"] == f"{FULL}-router:9443"


def test_every_router_pod_runs_a_tls_front_with_the_router_certificate() -> None:
    docs = render(None)
    cluster = one(docs, "RayService", f"{FULL}-router")["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]["template"]["spec"], cluster["workerGroupSpecs"][0]["template"]["spec"]]
    for pod in pods:
        (front,) = [c for c in pod["containers"] if c["name"] == "tls-front"]
        assert front["command"] == ["python", "-m", "tandem.router.tls_front"]
        assert front["ports"] == [{"name": "grpc-tls", "containerPort": 9443, "protocol": "TCP"}]
        secret, path = _mounted_secret(pod, front)
        assert secret == f"{PREFIX}-router"
        env = _env(front)
        assert env["TANDEM_ROUTER_TLS__ENABLED"] == "true" and env["TANDEM_ROUTER_TLS__CERT_FILE"] == f"{path}/tls.crt"
        assert env["TANDEM_ROUTER_GRPC_PORT"] == "9000" and env["TANDEM_ROUTER_TLS_PORT"] == "9443"
        assert front["securityContext"]["readOnlyRootFilesystem"] is True


def test_each_pool_mounts_its_own_roles_certificate_through_the_operator() -> None:
    docs = render(None)
    gateway_env = _env(_gateway_pod(docs)["containers"][0])
    (td,) = find(docs, "TandemDeployment")
    assert td["spec"]["tls"] == {
        "prefillSecretName": f"{PREFIX}-prefill",
        "decodeSecretName": f"{PREFIX}-decode",
        "serverName": "tandem-internal",
    }
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
        container = pod["containers"][0]
        role = container["args"][container["args"].index("--role") + 1]
        secret, _ = _mounted_secret(pod, container)
        assert secret == f"{PREFIX}-{role}"
        env = _env(container)
        assert env["TANDEM_WORKER_TLS__ENABLED"] == "true"
        for name in ("CERT_FILE", "KEY_FILE", "CA_FILE", "SERVER_NAME_OVERRIDE"):
            assert env[f"TANDEM_WORKER_TLS__{name}"] == gateway_env[f"TANDEM_GATEWAY_TLS__{name}"]


def test_plaintext_only_when_turned_off_and_then_said_explicitly() -> None:
    docs = render(None, ("internalTLS.enabled=false",))
    pod = _gateway_pod(docs)
    assert not [v for v in pod["volumes"] if v["name"] == "internal-tls"]
    assert _env(pod["containers"][0])["TANDEM_GATEWAY_TLS__ENABLED"] == "false"
    assert not find(docs, "Secret", f"{PREFIX}-gateway") and not find(docs, "Certificate")
    cluster = one(docs, "RayService", f"{FULL}-router")["spec"]["rayClusterConfig"]
    assert [c["name"] for c in cluster["headGroupSpec"]["template"]["spec"]["containers"]] == ["ray-head"]
    assert one(docs, "Service", f"{FULL}-router")["spec"]["ports"][0]["port"] == 9000
    (td,) = find(docs, "TandemDeployment")
    assert "tls" not in td["spec"]


def test_cert_manager_issues_each_roles_certificate_when_the_cluster_serves_it() -> None:
    docs = render(None, api_versions=CERT_MANAGER)
    assert not find(docs, "Secret", f"{PREFIX}-gateway")  # cert-manager writes the Secrets
    certificates = {c["metadata"]["name"]: c["spec"] for c in find(docs, "Certificate")}
    assert certificates[f"{PREFIX}-ca"]["isCA"] is True
    for role in ROLES:
        spec = certificates[f"{PREFIX}-{role}"]
        assert spec["secretName"] == f"{PREFIX}-{role}"
        assert spec["uris"] == [f"spiffe://tandem/role/{role}"]
        assert spec["dnsNames"] == ["tandem-internal", f"{role}.role.tandem"]
        assert {"server auth", "client auth"} <= set(spec["usages"])
        assert spec["issuerRef"] == {"name": f"{PREFIX}-ca", "kind": "Issuer", "group": "cert-manager.io"}
        assert spec["privateKey"]["rotationPolicy"] == "Always"
    # An issuer of your own replaces the chart's CA.
    own = render(
        None,
        (
            "internalTLS.issuer=certManager",
            "internalTLS.certManagerIssuerRef.name=corp",
            "internalTLS.certManagerIssuerRef.kind=ClusterIssuer",
        ),
    )
    assert not find(own, "Issuer")
    assert {c["spec"]["issuerRef"]["name"] for c in find(own, "Certificate")} == {"corp"}


def test_existing_secrets_are_mounted_and_nothing_is_issued() -> None:
    docs = render(None, ("internalTLS.issuer=existing", "internalTLS.secretPrefix=mine"))
    assert not find(docs, "Certificate") and not [s for s in find(docs, "Secret") if "mine" in s["metadata"]["name"]]
    assert _mounted_secret(_gateway_pod(docs), _gateway_pod(docs)["containers"][0])[0] == "mine-gateway"


def _write_role(docs: tuple[dict[str, Any], ...], role: str, folder: Path) -> TLSSettings:
    data = one(docs, "Secret", f"{PREFIX}-{role}")["data"]
    files = {}
    for key in ("tls.crt", "tls.key", "ca.crt"):
        files[key] = folder / f"{role}-{key}"
        files[key].write_bytes(base64.b64decode(data[key]))
    return TLSSettings(
        enabled=True,
        cert_file=files["tls.crt"],
        key_file=files["tls.key"],
        ca_file=files["ca.crt"],
        server_name_override="tandem-internal",
    )


def test_the_certificates_helm_generates_carry_their_roles_into_the_role_checks(tmp_path: Path) -> None:
    docs = render(None)
    ca = one(docs, "Secret", f"{PREFIX}-ca")["data"]
    assert {one(docs, "Secret", f"{PREFIX}-{role}")["data"]["ca.crt"] for role in ROLES} == {ca["tls.crt"]}
    roles = {role: _write_role(docs, role, tmp_path) for role in ("prefill", "gateway", "decode")}

    async def calls() -> dict[str, grpc.StatusCode]:
        server = grpc.aio.server(interceptors=role_checks(True))
        worker_pb2_grpc.add_WorkerServicer_to_server(FakeWorker(worker_id="prefill-0"), server)
        port = add_port(server, "127.0.0.1:0", roles["prefill"])
        await server.start()
        codes = {}
        try:
            for role in ("gateway", "decode"):
                async with aio_channel(f"127.0.0.1:{port}", roles[role]) as channel:
                    request = worker_pb2.PrefillRequest(request_id="r1", prompt_token_ids=[1, 2, 3])
                    try:
                        await worker_pb2_grpc.WorkerStub(channel).Prefill(request, timeout=10)
                        codes[role] = grpc.StatusCode.OK
                    except grpc.aio.AioRpcError as exc:
                        codes[role] = exc.code()
                        assert exc.details() == DENIED_MESSAGE
        finally:
            await server.stop(grace=None)
        return codes

    assert asyncio.run(calls()) == {"gateway": grpc.StatusCode.OK, "decode": grpc.StatusCode.PERMISSION_DENIED}


@pytest.mark.parametrize("tls", [True, False], ids=["tls-front", "plaintext"])
def test_the_router_admits_the_gateway_on_its_grpc_port_and_the_dashboard_to_kuberay_only(tls: bool) -> None:
    docs = render(None, () if tls else ("internalTLS.enabled=false",))
    router = one(docs, "NetworkPolicy", f"{FULL}-router")["spec"]
    grpc_port = one(docs, "Service", f"{FULL}-router")["spec"]["ports"][0]["port"]
    gateway_rule = router["ingress"][0]
    assert gateway_rule["ports"] == [{"port": grpc_port, "protocol": "TCP"}]
    assert grpc_port == (9443 if tls else 9000)  # with TLS, Serve's plaintext proxy port is not open to gateways
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
