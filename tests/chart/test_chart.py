"""charts/tandem: lint, render over the values matrix, validate every manifest,
and assert on the rendered objects (security, probes, policies, GPU requests)."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from tandem_operator.reconcile import Owner, desired_objects
from tandem_operator.spec import parse_spec

from tests.chart import gateway_api
from tests.chart.conftest import CHART, RELEASE, VALUES_MATRIX, find, one, render, run_helm, values_args
from tests.chart.crd_schema import validate_custom_resource
from tests.chart.schema_strategy import resolved

K8S_VERSION = "1.30.0"
FULL = f"{RELEASE}-tandem"
#: Kinds from other operators' CRDs: the RayService is checked against KubeRay's own CRD in
#: test_router_gcs_ft (tests/chart/kuberay/); the Prometheus operator's schemas are not available offline.
THIRD_PARTY_KINDS = {"RayService", "ServiceMonitor", "PodMonitor", "PrometheusRule"}
POD_KINDS = {"Deployment", "Job"}


def _ids(values: str | None) -> str:
    return values or "defaults"


@pytest.mark.parametrize("values", VALUES_MATRIX, ids=_ids)
def test_helm_lint_strict(values: str | None) -> None:
    proc = run_helm("lint", "--strict", str(CHART), *values_args(values))
    assert "0 chart(s) failed" in proc.stdout


@pytest.mark.parametrize("values", VALUES_MATRIX, ids=_ids)
def test_every_manifest_validates(values: str | None) -> None:
    docs = render(values)
    assert docs
    for doc in docs:
        kind = doc["kind"]
        if kind == "TandemDeployment":
            validate_custom_resource(doc)
            parse_spec(doc["spec"])  # the operator accepts what the chart renders
        elif kind == "HTTPRoute":
            assert gateway_api.validate([doc]) == ["ok"]
        elif kind in THIRD_PARTY_KINDS:
            assert doc["apiVersion"] in ("ray.io/v1", "monitoring.coreos.com/v1")
            assert doc["metadata"]["name"] and doc["spec"]
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_validation_catches_a_broken_manifest() -> None:
    """The validator above is not a rubber stamp."""
    deployment = json.loads(json.dumps(one(render(None), "Deployment", f"{FULL}-gateway")))
    deployment["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
    deployment["spec"]["replicas"] = 2
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
    td = json.loads(json.dumps(one(render(None), "TandemDeployment", FULL)))
    td["spec"]["pools"]["prefill"]["replicaz"] = 3
    with pytest.raises(jsonschema.ValidationError):
        validate_custom_resource(td)


@pytest.mark.parametrize(
    "bad",
    ["gateway.replcas=2", "accelerator=tpu", "tandemDeployment.pools.decode.maxReplicas=0",
     "tandemDeployment.autoscaling.prefill.budgetUsage=2", "podSecurityContext.runAsNonRoot=false"],
)
def test_values_schema_rejects(bad: str) -> None:
    proc = run_helm("template", RELEASE, str(CHART), "--set", bad, check=False)
    assert proc.returncode != 0
    assert "schema" in proc.stderr.lower() or "values don't meet" in proc.stderr.lower()


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (("redis.enabled=false",), "redis"),
        (("tandemDeployment.pools.prefill.replicas=9",), "minReplicas <= replicas <= maxReplicas"),
        (("model.source=initContainer",), "initContainer"),
    ],
)
def test_inconsistent_values_fail_with_a_message(sets: tuple[str, ...], message: str) -> None:
    args = [a for s in sets for a in ("--set", s)]
    proc = run_helm("template", RELEASE, str(CHART), *args, check=False)
    assert proc.returncode != 0 and message in proc.stderr


def _walk_values(node: Any, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths = []
    if isinstance(node, dict):
        for key, value in node.items():
            paths.append((*path, key))
            # Free-form maps (resources, selectors, labels) are typed as maps, not key by key.
            if isinstance(value, dict) and key not in {"requests", "limits", "labels", "nodeSelector",
                                                       "monitoringNamespaceSelector", "kuberayNamespaceSelector",
                                                       "kuberayPodSelector", "extraEnv", "annotations",
                                                       "affinity", "podAnnotations", "podLabels"}:
                paths.extend(_walk_values(value, (*path, key)))
    return paths


def test_every_value_is_typed_in_the_schema() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    for path in _walk_values(values):
        node = schema
        for key in path:
            node = resolved(node, schema)
            assert key in node.get("properties", {}), f"values.{'.'.join(path)} is not in values.schema.json"
            node = node["properties"][key]
        node = resolved(node, schema)
        assert "type" in node or "const" in node or "enum" in node, f"values.{'.'.join(path)} has no type"


def test_every_value_is_documented() -> None:
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    for i, line in enumerate(lines):
        match = re.match(r"^(\s*)([A-Za-z][\w.-]*):", line)
        if not match:
            continue
        previous = lines[i - 1].strip() if i else ""
        if not previous.startswith("#"):
            undocumented.append(line.strip())
    # Keys inside free-form maps (resource quantities, labels) are examples, not values.
    undocumented = [u for u in undocumented if not re.match(r"^(cpu|memory|grafana_dashboard|kubernetes\.io)", u)]
    assert not undocumented, f"values without a comment: {undocumented}"


def _pod_specs(docs: tuple[dict[str, Any], ...]) -> list[tuple[str, dict[str, Any]]]:
    specs = [(d["metadata"]["name"], d["spec"]["template"]["spec"]) for d in docs if d["kind"] in POD_KINDS]
    for ray in find(docs, "RayService"):
        cluster = ray["spec"]["rayClusterConfig"]
        specs.append((f"{ray['metadata']['name']}-head", cluster["headGroupSpec"]["template"]["spec"]))
        specs += [(f"{ray['metadata']['name']}-{g['groupName']}", g["template"]["spec"])
                  for g in cluster["workerGroupSpecs"]]
    return specs


def _operator_pools(docs: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    """What the operator would create for the chart's TandemDeployment (same code as in the cluster)."""
    (td,) = find(docs, "TandemDeployment")
    owner = Owner(name=td["metadata"]["name"], namespace="tandem", uid="uid-1",
                  labels=td["metadata"]["labels"], generation=1)
    return desired_objects(owner, parse_spec(td["spec"]), {"prefill": None, "decode": None})


@pytest.mark.parametrize("values", VALUES_MATRIX, ids=_ids)
def test_secure_pod_defaults(values: str | None) -> None:
    docs = render(values)
    pods = _pod_specs(docs) + [(d["metadata"]["name"], d["spec"]["template"]["spec"])
                               for d in _operator_pools(docs) if d["kind"] == "Deployment"]
    assert len(pods) >= 6
    for name, pod in pods:
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
        # The operator talks to the API server, and so does its uninstall hook (as the operator's account).
        expected_token = name.endswith(("-operator", "-uninstall"))
        assert pod.get("automountServiceAccountToken") is expected_token, name
        for container in pod["containers"] + pod.get("initContainers", []):
            ctx = container["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False, (name, container["name"])
            assert ctx["readOnlyRootFilesystem"] is True, (name, container["name"])
            assert ctx["capabilities"]["drop"] == ["ALL"], (name, container["name"])
            assert container.get("resources", {}).get("requests") or container["name"] == "fetch-model", name


def test_probes_point_at_the_service_endpoints() -> None:
    docs = render(None)
    gateway = one(docs, "Deployment", f"{FULL}-gateway")["spec"]["template"]["spec"]["containers"][0]
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert gateway["startupProbe"]["httpGet"]["path"] == "/healthz"
    operator = one(docs, "Deployment", f"{FULL}-operator")["spec"]["template"]["spec"]["containers"][0]
    assert "--liveness=http://0.0.0.0:8081/healthz" in operator["args"]
    assert operator["livenessProbe"]["httpGet"]["port"] == "health"
    for pool in _operator_pools(docs):
        # Kubernetes' schema too: a gRPC probe's port must be a number (a name fails here).
        kubernetes_validate.validate(pool, K8S_VERSION, strict=True)
        if pool["kind"] != "Deployment":
            continue
        worker = pool["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in worker["env"]}
        health_port = {p["name"]: p["containerPort"] for p in worker["ports"]}["health"]
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            # grpc.health.v1 on the worker's plaintext health port (kubelet gRPC probes speak no TLS).
            assert worker[probe]["grpc"] == {"port": health_port, "service": "tandem.v1.Worker"}, probe
            assert "tcpSocket" not in worker[probe], probe
        assert env["TANDEM_WORKER_HEALTH_PORT"] == str(health_port)


def test_gateway_reaches_the_router_service() -> None:
    docs = render(None)
    env = {e["name"]: e for e in one(docs, "Deployment", f"{FULL}-gateway")["spec"]["template"]["spec"]
           ["containers"][0]["env"]}
    router_svc = one(docs, "Service", f"{FULL}-router")
    assert env["TANDEM_GATEWAY_ROUTER_ADDRESS"]["value"] == f"{FULL}-router:{router_svc['spec']['ports'][0]['port']}"
    assert env["TANDEM_GATEWAY_REDIS__URL"]["valueFrom"]["secretKeyRef"]["name"] == f"{FULL}-redis"
    ray = one(docs, "RayService", f"{FULL}-router")
    serve = yaml.safe_load(ray["spec"]["serveConfigV2"])
    assert serve["applications"][0]["name"] == "tandem-router"
    # The Service leads to each pod's TLS front, which forwards to Serve's proxy on the pod's loopback.
    (front,) = [c for c in ray["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"]
                if c["name"] == "tls-front"]
    assert router_svc["spec"]["ports"][0]["targetPort"] == front["ports"][0]["name"]
    front_env = {e["name"]: e.get("value") for e in front["env"]}
    assert front_env["TANDEM_ROUTER_TLS_PORT"] == str(router_svc["spec"]["ports"][0]["port"])
    assert serve["grpc_options"]["port"] == int(front_env["TANDEM_ROUTER_GRPC_PORT"])
    assert serve["grpc_options"]["grpc_servicer_functions"] == [
        "tandem.v1.router_pb2_grpc.add_RouterServicer_to_server"
    ]


@pytest.mark.parametrize("threshold", [None, 0, 512])
def test_the_router_reads_its_placement_settings_from_the_chart(
    threshold: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Ray pods' environment, read by the router's own settings class (not a copy of its names)."""
    settings = pytest.importorskip("tandem.router.settings", reason="the router package (make setup)")
    extra = () if threshold is None else (f"router.minUncachedTokensToDisaggregate={threshold}",)
    ray = one(render(None, extra), "RayService", f"{FULL}-router")
    head = ray["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    literal = {e["name"]: e["value"] for e in head["env"] if "value" in e}
    assert {n for n in literal if n.startswith("TANDEM_ROUTER_")} >= {
        "TANDEM_ROUTER_POLICY",
        "TANDEM_ROUTER_DISAGGREGATION__MIN_UNCACHED_TOKENS",
        "TANDEM_ROUTER_BUDGET__PREFILL_TOKENS_IN_FLIGHT",
    }
    for name in [n for n in os.environ if n.startswith("TANDEM_ROUTER_")]:
        monkeypatch.delenv(name)
    for name, value in literal.items():
        monkeypatch.setenv(name, value)
    parsed = settings.TandemRouterSettings()
    expected = settings.DEFAULT_MIN_UNCACHED_TOKENS_TO_DISAGGREGATE if threshold is None else threshold
    assert parsed.disaggregation.min_uncached_tokens == expected
    # The chart's default prefill budget is the router's own.
    assert parsed.budget.prefill_tokens_in_flight == settings.BudgetSettings().prefill_tokens_in_flight
    assert parsed.policy == yaml.safe_load(run_helm("show", "values", str(CHART)).stdout)["router"]["policy"]
    # Day one routes by prefix-cache locality, as the router does when nothing is set.
    assert parsed.policy == "cache_aware" == settings.TandemRouterSettings.model_fields["policy"].default


def test_external_redis_goes_through_a_secret() -> None:
    docs = render("ci/values-external-redis-initcontainer.yaml")
    assert not find(docs, "Deployment", f"{FULL}-redis")
    secret = one(docs, "Secret", f"{FULL}-redis")
    assert secret["stringData"]["url"] == "redis://redis.example.internal:6379/3"
    td = one(docs, "TandemDeployment", "chat")
    assert td["spec"]["redis"]["secretName"] == f"{FULL}-redis"
    assert td["spec"]["model"]["initContainer"]["image"].startswith("registry.example.com/")
    assert not find(docs, "NetworkPolicy")


def test_ingress_is_safe_for_server_sent_events() -> None:
    docs = render("ci/values-everything.yaml")
    annotations = one(docs, "Ingress", f"{FULL}-gateway")["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    assert annotations["nginx.ingress.kubernetes.io/proxy-request-buffering"] == "off"
    assert int(annotations["nginx.ingress.kubernetes.io/proxy-read-timeout"]) >= 3600
    assert int(annotations["nginx.ingress.kubernetes.io/proxy-send-timeout"]) >= 3600
    assert not find(render(None), "Ingress")


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _peers(rule: dict[str, Any]) -> list[dict[str, Any]]:
    return rule.get("from", [])


def test_network_policies_isolate_the_workers() -> None:
    docs = render(None)
    policies = {p["metadata"]["name"]: p["spec"] for p in find(docs, "NetworkPolicy")}
    pools = [d for d in _operator_pools(docs) if d["kind"] == "Deployment"]
    worker_labels = pools[0]["spec"]["template"]["metadata"]["labels"]
    gateway_labels = one(docs, "Deployment", f"{FULL}-gateway")["spec"]["template"]["metadata"]["labels"]
    # Default deny covers every pod of the release, the operator's workers included.
    deny = policies[f"{FULL}-default-deny"]
    assert deny["policyTypes"] == ["Ingress"] and "ingress" not in deny
    assert _selects(deny["podSelector"]["matchLabels"], worker_labels)
    # Only the gateway admits everyone, on its HTTP port only.
    open_policies = [n for n, p in policies.items() for r in p.get("ingress", []) if not _peers(r)]
    assert open_policies == [f"{FULL}-gateway"]
    assert policies[f"{FULL}-gateway"]["ingress"][0]["ports"] == [{"port": "http", "protocol": "TCP"}]
    # Workers: each peer on its own ports only (gateway → gRPC, workers → KV, router → KV events),
    # Prometheus on the metrics port only.
    workers = policies[f"{FULL}-workers"]
    assert all(_selects(workers["podSelector"]["matchLabels"], p["spec"]["template"]["metadata"]["labels"])
               for p in pools)
    assert all(rule.get("ports") for rule in workers["ingress"])
    by_peer = {p["podSelector"]["matchLabels"]["app.kubernetes.io/component"]: sorted(str(q["port"])
                                                                                     for q in r["ports"])
               for r in workers["ingress"][:3] for p in _peers(r)}
    assert by_peer == {"gateway": ["grpc"], "worker": ["kv"], "router": ["5557", "6557"]}
    assert _selects(_peers(workers["ingress"][0])[0]["podSelector"]["matchLabels"], gateway_labels)
    worker_ports = {p["name"] for p in pools[0]["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert {"grpc", "kv"} <= worker_ports  # the named ports exist on the operator's pods
    monitoring = workers["ingress"][3]
    assert monitoring["ports"] == [{"port": 9101, "protocol": "TCP"}] and "namespaceSelector" in _peers(monitoring)[0]
    # The plaintext health port is for the kubelet's probes (node traffic, which NetworkPolicy
    # always admits): no rule opens it to any pod or namespace.
    worker_container = pools[0]["spec"]["template"]["spec"]["containers"][0]
    health_port = {p["name"]: p["containerPort"] for p in worker_container["ports"]}["health"]
    opened = {q["port"] for r in workers["ingress"] for q in r["ports"]}
    assert not opened & {"health", health_port}
    # Redis: only Tandem components (the operator: the adapter catalog).
    redis_from = [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
                  for p in _peers(policies[f"{FULL}-redis"]["ingress"][0])]
    assert sorted(redis_from) == ["gateway", "operator", "router", "worker"]


def test_pod_disruption_budgets_select_the_pools() -> None:
    docs = render(None)
    pools = {d["metadata"]["name"]: d for d in _operator_pools(docs) if d["kind"] == "Deployment"}
    for role in ("prefill", "decode"):
        pdb = one(docs, "PodDisruptionBudget", f"{FULL}-{role}")
        pod_labels = pools[f"{FULL}-{role}"]["spec"]["template"]["metadata"]["labels"]
        assert _selects(pdb["spec"]["selector"]["matchLabels"], pod_labels)
        assert pdb["spec"]["maxUnavailable"] == 1
    assert one(docs, "PodDisruptionBudget", f"{FULL}-gateway")["spec"]["minAvailable"] == 1


def test_gpu_values_request_gpus_with_selectors_and_tolerations() -> None:
    docs = render("examples/values-gpu.yaml")
    td = one(docs, "TandemDeployment", FULL)
    assert td["spec"]["image"]["repository"].endswith("tandem-worker-gpu")
    for pool in _operator_pools(docs):
        if pool["kind"] != "Deployment":
            continue
        pod = pool["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert pod["nodeSelector"]["nvidia.com/gpu.present"] == "true"
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        assert any(v.get("emptyDir", {}).get("medium") == "Memory" for v in pod["volumes"])
        drain = int(next(e["value"] for e in container["env"] if e["name"] == "TANDEM_WORKER_DRAIN_TIMEOUT_S"))
        assert pod["terminationGracePeriodSeconds"] > drain
    cpu_td = one(render("examples/values-cpu-demo.yaml"), "TandemDeployment", FULL)
    assert cpu_td["spec"]["image"]["repository"].endswith("tandem-worker-cpu")
    assert "nvidia.com/gpu" not in json.dumps(cpu_td)


def test_operator_rbac_is_least_privilege() -> None:
    docs = render("ci/values-everything.yaml")
    (cluster_role,) = find(docs, "ClusterRole")
    assert cluster_role["rules"] == [{"apiGroups": ["apiextensions.k8s.io"],
                                      "resources": ["customresourcedefinitions"],
                                      "verbs": ["get", "list", "watch"]}]
    roles = find(docs, "Role")
    operator_roles = [r for r in roles if r["metadata"]["name"] == f"{FULL}-operator"]
    assert sorted(r["metadata"]["namespace"] for r in operator_roles) == ["tandem", "tandem-b"]
    # The uninstall hook's Role (tests/chart/test_uninstall.py) is the only other one.
    assert {r["metadata"]["name"] for r in roles} == {f"{FULL}-operator", f"{FULL}-uninstall"}
    for role in roles:
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
            assert not {"secrets", "pods/exec", "configmaps"} & set(rule["resources"])
    # The router pods' metrics endpoints (autoscaling.source router reads every pod): EndpointSlices,
    # listed only, in each watched namespace; nothing else of discovery.k8s.io, no Endpoints. Pods: listed,
    # and their status patched (the rollout's pairing condition), never created, deleted or exec'd into.
    for role in operator_roles:
        discovery = [r for r in role["rules"] if set(r["apiGroups"]) & {"discovery.k8s.io"}]
        assert discovery == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list"]}]
        assert not any("endpoints" in r["resources"] for r in role["rules"])
        pods = [r for r in role["rules"] if any(x.startswith("pods") for x in r["resources"])]
        assert pods == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
                        {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch"]}]
    operator = one(docs, "Deployment", f"{FULL}-operator")["spec"]["template"]["spec"]["containers"][0]
    assert "--namespace=tandem" in operator["args"] and "--namespace=tandem-b" in operator["args"]


def test_monitoring_objects() -> None:
    docs = render("ci/values-everything.yaml")
    assert {d["metadata"]["name"] for d in find(docs, "ServiceMonitor")} == {f"{FULL}-gateway", f"{FULL}-router"}
    (pod_monitor,) = find(docs, "PodMonitor")
    assert pod_monitor["spec"]["selector"]["matchLabels"] == {"tandem.dev/deployment": FULL}
    (rule,) = find(docs, "PrometheusRule")
    alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
    assert {"TandemTTFTBudgetBurnFast", "TandemITLBudgetBurnFast", "TandemTTFTBudgetBurnSlow",
            "TandemITLBudgetBurnSlow"} <= alerts
    recorded = " ".join(r["expr"] for g in rule["spec"]["groups"] for r in g["rules"] if "record" in r)
    assert 'le="2"' in recorded or 'le="2.0"' in recorded  # the TTFT SLO threshold from values
    (dashboard_cm,) = find(docs, "ConfigMap")
    assert dashboard_cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(dashboard_cm["data"]["tandem.json"])
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for needle in ("time to first token", "inter-token", "queue", "kv-cache usage", "kv transfer", "replicas"):
        assert needle in titles
    assert not find(render(None), "ServiceMonitor") and not find(render(None), "PrometheusRule")


def test_image_pull_secrets_reach_every_pod_the_operator_creates_too() -> None:
    docs = render(None, ("imagePullSecrets[0].name=registry-cred",))
    pods = _pod_specs(docs) + [(d["metadata"]["name"], d["spec"]["template"]["spec"])
                               for d in _operator_pools(docs) if d["kind"] == "Deployment"]
    assert {n for n, _ in pods} >= {f"{FULL}-prefill", f"{FULL}-decode"}, [n for n, _ in pods]
    for name, pod in pods:
        assert pod.get("imagePullSecrets") == [{"name": "registry-cred"}], name
    (td,) = find(docs, "TandemDeployment")
    validate_custom_resource(td)


@pytest.mark.parametrize(
    ("extra", "source"),
    [
        ((), "router"),  # nothing scrapes the pods: read the router, never hold for want of metrics
        (("monitoring.serviceMonitors.enabled=true",), "prometheus"),
        (("tandemDeployment.autoscaling.source=prometheus",), "prometheus"),  # an explicit choice stands
    ],
)
def test_day_one_autoscaling_reads_a_source_that_has_data(extra: tuple[str, ...], source: str) -> None:
    (td,) = find(render(None, extra), "TandemDeployment")
    assert td["spec"]["autoscaling"]["source"] == source
    assert parse_spec(td["spec"]).autoscaling.source == source


@pytest.mark.parametrize("grace_s", [120, 600])
def test_the_gateway_drains_for_its_pods_grace_period(grace_s: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway's own drain grace (read by its settings class) fits inside the pod's termination grace."""
    settings = pytest.importorskip("tandem.gateway.settings", reason="the gateway package (make setup)")
    docs = render(None, (f"gateway.terminationGracePeriodSeconds={grace_s}",))
    pod = one(docs, "Deployment", f"{FULL}-gateway")["spec"]["template"]["spec"]
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"] if "value" in e}
    monkeypatch.setenv("TANDEM_GATEWAY_STREAM__DRAIN_GRACE_S", env["TANDEM_GATEWAY_STREAM__DRAIN_GRACE_S"])
    drain_s = settings.GatewaySettings().stream.drain_grace_s
    assert pod["terminationGracePeriodSeconds"] == grace_s
    assert drain_s == grace_s - 10


def test_the_admin_key_comes_from_a_secret_and_the_gateway_reads_that_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = pytest.importorskip("tandem.gateway.settings", reason="the gateway package (make setup)")
    pod = one(render(None, ("gateway.adminKeySecret.name=tandem-admin",)), "Deployment", f"{FULL}-gateway")
    env = {e["name"]: e for e in pod["spec"]["template"]["spec"]["containers"][0]["env"]}
    ref = env["TANDEM_GATEWAY_AUTH__ADMIN_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "tandem-admin", "key": "admin-key"}
    monkeypatch.setenv("TANDEM_GATEWAY_AUTH__ADMIN_KEY", "from-the-secret")
    assert settings.GatewaySettings().auth.admin_key.get_secret_value() == "from-the-secret"
    # Without the Secret, no admin credential at all (the endpoints answer 403).
    plain = one(render(None), "Deployment", f"{FULL}-gateway")["spec"]["template"]["spec"]["containers"][0]
    assert "TANDEM_GATEWAY_AUTH__ADMIN_KEY" not in {e["name"] for e in plain["env"]}


def test_only_the_kuberay_operators_namespace_reaches_the_ray_dashboard() -> None:
    policies = find(render(None), "NetworkPolicy")
    peers = [
        peer
        for policy in policies
        for rule in policy["spec"].get("ingress", [])
        if any(p.get("port") == 8265 for p in rule.get("ports", []))
        for peer in rule.get("from", [])
    ]
    assert peers, "no rule admits the Ray dashboard port"
    for peer in peers:
        # Never {} (every namespace): KubeRay's usual namespaces by name, its default install's `default` included.
        kuberay_namespaces = ["default", "ray-system", "kuberay-system"]
        assert peer["namespaceSelector"] == {
            "matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "In", "values": kuberay_namespaces}]
        }, peer
        assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "kuberay-operator"}
    labelled = find(render(None, ("networkPolicy.kuberayNamespaceSelector.team=ray",)), "NetworkPolicy")
    assert any(
        peer.get("namespaceSelector") == {"matchLabels": {"team": "ray"}}
        for policy in labelled
        for rule in policy["spec"].get("ingress", [])
        for peer in rule.get("from", [])
    )
    proc = run_helm("template", RELEASE, str(CHART), "--set", "networkPolicy.kuberayNamespaces=null", check=False)
    assert proc.returncode != 0 and "set kuberayNamespaces or kuberayNamespaceSelector" in proc.stderr


def test_the_gateway_serves_every_model_of_the_models_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """The models form's gateway tokenizes every model: the two-model example's gateway env, read by the
    gateway's own settings, lists both models with their folders and context lengths."""
    from tandem.gateway.settings import GatewaySettings

    example = "examples/values-gpu-two-models.yaml"
    wanted = yaml.safe_load((CHART / example).read_text())["tandemDeployment"]["models"]
    container = one(render(example), "Deployment", f"{FULL}-gateway")["spec"]["template"]["spec"]["containers"][0]
    for item in container["env"]:
        if "value" in item:
            monkeypatch.setenv(item["name"], item["value"])
    settings = GatewaySettings()
    assert [(m.name, str(m.model_dir), m.max_model_len) for m in settings.models] == [
        (m["name"], m["path"], m["maxModelLen"]) for m in wanted
    ]
    assert settings.served_model_name == wanted[0]["name"]
    # The single-model form sets no list: the gateway serves `model` alone, as before.
    single = one(render(None), "Deployment", f"{FULL}-gateway")["spec"]["template"]["spec"]["containers"][0]
    assert "TANDEM_GATEWAY_MODELS" not in {e["name"] for e in single["env"]}
