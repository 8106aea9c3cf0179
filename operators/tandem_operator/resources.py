"""The Kubernetes objects of one pool (a model's prefill or decode workers) as plain dicts.

Pure functions: :mod:`tandem_operator.reconcile` calls them with a parsed
:class:`tandem_operator.spec.TandemSpec` and gets the Deployment and Service
it should apply; nothing here talks to the API server.

The pod contract with the worker (``python -m tandem.worker``): gRPC on
:data:`WORKER_PORT`, KV transfer on :data:`KV_PORT`, metrics on
:data:`METRICS_PORT`, and the gRPC health service alone, in plaintext, for
the kubelet's probes on :data:`HEALTH_PORT`; it advertises its pod IP
(downward API), and on SIGTERM unregisters, finishes in-flight requests for up
to ``drainTimeoutSeconds``, then exits. The grace period is longer than the
drain so the kubelet never kills a draining worker; that is how a scale-down
drains.

A pool of the models form (:class:`tandem_operator.spec.Pool` with a slug) also
carries the ``tandem.dev/model`` label (the model's slug) in its labels and
selector; a pool of the single-model form is built exactly as it always was.
"""

from __future__ import annotations

from typing import Any

from tandem_operator.spec import GROUP, KIND, MODEL_REVISION_ENV, VERSION, Pool, PoolSpec, Role, TandemSpec

WORKER_PORT = 50051
KV_PORT = 50061
METRICS_PORT = 9101
#: grpc.health.v1 alone, in plaintext (TANDEM_WORKER_HEALTH_PORT): the kubelet's gRPC probes speak no TLS.
HEALTH_PORT = 50071
#: The health service name the probes ask about (the worker also answers "").
HEALTH_SERVICE = "tandem.v1.Worker"
#: Where the pool's TLS Secret (spec.tls: its role's certificate) is mounted.
TLS_DIR = "/etc/tandem/tls"
#: Seconds of grace on top of the drain timeout (process exit, engine shutdown).
GRACE_MARGIN_S = 30

LABEL_DEPLOYMENT = "tandem.dev/deployment"
LABEL_POOL = "tandem.dev/pool"
#: The model's slug, on the pools of the models form.
LABEL_MODEL = "tandem.dev/model"
#: The worker settings of LoRA (``WorkerSettings.adapters.max_adapters`` / ``.max_adapter_rank``).
LORA_ENV_MAX_ADAPTERS = "TANDEM_WORKER_ADAPTERS__MAX_ADAPTERS"
LORA_ENV_MAX_ADAPTER_RANK = "TANDEM_WORKER_ADAPTERS__MAX_ADAPTER_RANK"
#: CR labels copied onto the pools (so the chart's NetworkPolicies and PDBs select them).
INHERITED_LABELS = ("app.kubernetes.io/instance", "app.kubernetes.io/part-of", "app.kubernetes.io/name")

RESTRICTED_SECURITY_CONTEXT: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def pool_name(deployment_name: str, role: Role) -> str:
    """The name of ``role``'s pool in the single-model form (:meth:`Pool.name` in general)."""
    return f"{deployment_name}-{role}"


def selector_labels(deployment_name: str, pool: Pool) -> dict[str, str]:
    labels = {LABEL_DEPLOYMENT: deployment_name, LABEL_POOL: pool.role}
    if pool.model.slug is not None:
        labels[LABEL_MODEL] = pool.model.slug
    return labels


def pool_labels(deployment_name: str, pool: Pool, cr_labels: dict[str, str], spec: TandemSpec) -> dict[str, str]:
    labels = {key: cr_labels[key] for key in INHERITED_LABELS if key in cr_labels}
    labels.update(spec.pod_labels)
    labels.update(
        {
            "app.kubernetes.io/component": "worker",
            "app.kubernetes.io/managed-by": "tandem-operator",
            **selector_labels(deployment_name, pool),
        }
    )
    return labels


def owner_reference(name: str, uid: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _env(spec: TandemSpec, the_pool: Pool) -> list[dict[str, Any]]:
    role, pool, model = the_pool.role, the_pool.spec, the_pool.model  # pool: its PoolSpec
    field = {"fieldRef": {"fieldPath": "status.podIP"}}
    env: list[dict[str, Any]] = [
        {"name": "TANDEM_WORKER_ROLE", "value": role},
        {"name": "TANDEM_WORKER_BIND_HOST", "value": "0.0.0.0"},
        {"name": "TANDEM_WORKER_ADVERTISE_HOST", "valueFrom": field},
        {"name": "TANDEM_WORKER_PORT", "value": str(WORKER_PORT)},
        {"name": "TANDEM_WORKER_METRICS_PORT", "value": str(METRICS_PORT)},
        {"name": "TANDEM_WORKER_HEALTH_PORT", "value": str(HEALTH_PORT)},
        {"name": "TANDEM_WORKER_KV__HOST", "valueFrom": field},
        {"name": "TANDEM_WORKER_KV__PORT", "value": str(KV_PORT)},
        {"name": "TANDEM_WORKER_ENGINE__MODEL_DIR", "value": model.source.path},
        {"name": "TANDEM_WORKER_ENGINE__SERVED_MODEL_NAME", "value": model.name},
        {"name": "TANDEM_WORKER_ENGINE__MAX_MODEL_LEN", "value": str(model.source.max_model_len)},
        {"name": "TANDEM_WORKER_ENGINE__DTYPE", "value": pool.engine_args.dtype},
        {
            "name": "TANDEM_WORKER_ENGINE__TENSOR_PARALLEL_SIZE",
            "value": str(pool.engine_args.tensor_parallel_size),
        },
        {"name": "TANDEM_WORKER_REGISTRY__KEY_PREFIX", "value": spec.redis.key_prefix},
        {"name": "TANDEM_WORKER_DRAIN_TIMEOUT_S", "value": str(pool.drain_timeout_seconds)},
        # Writable caches on a read-only root filesystem.
        {"name": "HOME", "value": "/tmp"},
        {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
        {"name": "HF_HUB_OFFLINE", "value": "1"},
    ]
    if model.source.revision:
        env.append({"name": MODEL_REVISION_ENV, "value": model.source.revision})
    if pool.engine_args.kv_cache_bytes is not None:
        env.append({"name": "TANDEM_WORKER_ENGINE__KV_CACHE_BYTES", "value": str(pool.engine_args.kv_cache_bytes)})
    if model.source.lora is not None:
        env += [
            {"name": LORA_ENV_MAX_ADAPTERS, "value": str(model.source.lora.max_adapters)},
            {"name": LORA_ENV_MAX_ADAPTER_RANK, "value": str(model.source.lora.max_adapter_rank)},
        ]
    if spec.redis.secret_name is not None:
        secret = {"secretKeyRef": {"name": spec.redis.secret_name, "key": spec.redis.secret_key}}
        env.append({"name": "TANDEM_WORKER_REDIS__URL", "valueFrom": secret})
    else:
        env.append({"name": "TANDEM_WORKER_REDIS__URL", "value": spec.redis.url})
    if spec.tls is not None:
        env += [
            {"name": "TANDEM_WORKER_TLS__ENABLED", "value": "true"},
            {"name": "TANDEM_WORKER_TLS__CERT_FILE", "value": f"{TLS_DIR}/tls.crt"},
            {"name": "TANDEM_WORKER_TLS__KEY_FILE", "value": f"{TLS_DIR}/tls.key"},
            {"name": "TANDEM_WORKER_TLS__CA_FILE", "value": f"{TLS_DIR}/ca.crt"},
            {"name": "TANDEM_WORKER_TLS__SERVER_NAME_OVERRIDE", "value": spec.tls.server_name},
        ]
    else:
        # Plaintext, said explicitly (the worker warns at start: no caller is checked).
        env.append({"name": "TANDEM_WORKER_TLS__ENABLED", "value": "false"})
    env.extend({"name": name, "value": value} for name, value in sorted(pool.engine_args.extra_env.items()))
    return env


def _health_check() -> dict[str, Any]:
    """A probe's ``grpc`` action (a fresh dict per probe, so no two probes share one object)."""
    return {"port": HEALTH_PORT, "service": HEALTH_SERVICE}


def _volumes(spec: TandemSpec, the_pool: Pool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts): the model under /models, a writable /tmp, and /dev/shm for tensor parallelism."""
    role, pool, source = the_pool.role, the_pool.spec, the_pool.model.source
    volumes: list[dict[str, Any]] = [{"name": "tmp", "emptyDir": {}}]
    mounts: list[dict[str, Any]] = [{"name": "tmp", "mountPath": "/tmp"}]
    if source.pvc is not None:
        claim = {"claimName": source.pvc.claim_name, "readOnly": True}
        volumes.append({"name": "model", "persistentVolumeClaim": claim})
        mount: dict[str, Any] = {"name": "model", "mountPath": "/models", "readOnly": True}
        if source.pvc.sub_path:
            mount["subPath"] = source.pvc.sub_path
        mounts.append(mount)
    else:
        volumes.append({"name": "model", "emptyDir": {}})
        mounts.append({"name": "model", "mountPath": "/models", "readOnly": True})
    if pool.num_gpus > 0 or pool.engine_args.tensor_parallel_size > 1:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    if spec.tls is not None:
        secret = {"secretName": spec.tls.secret_for(role), "defaultMode": 0o440}
        volumes.append({"name": "internal-tls", "secret": secret})
        mounts.append({"name": "internal-tls", "mountPath": TLS_DIR, "readOnly": True})
    return volumes, mounts


def _rank_kv_ports(tensor_parallel_size: int) -> list[dict[str, Any]]:
    """The KV-transfer ports of ranks 1.. (rank r's KV server listens on ``KV_PORT + r``; rank 0's is ``kv``)."""
    return [
        {"name": f"kv-{rank}", "containerPort": KV_PORT + rank, "protocol": "TCP"}
        for rank in range(1, tensor_parallel_size)
    ]


def _schedule(
    pod_spec: dict[str, Any], container: dict[str, Any], pool_spec: PoolSpec, selector: dict[str, str]
) -> None:
    """The pool's scheduling options, each only where set (a pool without them renders as it always did)."""
    if pool_spec.affinity:
        pod_spec["affinity"] = dict(pool_spec.affinity)
    if pool_spec.topology_spread_constraints:
        pod_spec["topologySpreadConstraints"] = [
            c if "labelSelector" in c else {**c, "labelSelector": {"matchLabels": dict(selector)}}
            for c in pool_spec.topology_spread_constraints
        ]
    if pool_spec.priority_class_name:
        pod_spec["priorityClassName"] = pool_spec.priority_class_name
    if pool_spec.runtime_class_name:
        pod_spec["runtimeClassName"] = pool_spec.runtime_class_name
    if pool_spec.resource_claims:
        pod_spec["resourceClaims"] = [c.model_dump(by_alias=True, exclude_none=True) for c in pool_spec.resource_claims]
        container["resources"]["claims"] = [{"name": c.name} for c in pool_spec.resource_claims]


def build_pool_deployment(
    *,
    name: str,
    namespace: str,
    uid: str,
    cr_labels: dict[str, str],
    spec: TandemSpec,
    pool: Pool,
    replicas: int,
) -> dict[str, Any]:
    """The Deployment of one pool, owned by the TandemDeployment ``name``."""
    role, source, pool_spec = pool.role, pool.model.source, pool.spec
    labels = pool_labels(name, pool, cr_labels, spec)
    volumes, mounts = _volumes(spec, pool)
    container: dict[str, Any] = {
        "name": "worker",
        "image": spec.image.ref,
        "imagePullPolicy": spec.image.pull_policy,
        "args": ["--role", role],
        "env": _env(spec, pool),
        "ports": [
            {"name": "grpc", "containerPort": WORKER_PORT, "protocol": "TCP"},
            {"name": "kv", "containerPort": KV_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
            {"name": "health", "containerPort": HEALTH_PORT, "protocol": "TCP"},
            *_rank_kv_ports(pool_spec.engine_args.tensor_parallel_size),
        ],
        # gRPC health checks (grpc.health.v1), not TCP. A worker whose engine died
        # keeps no port open for long (it exits with status 70), but a TCP check
        # passes for as long as the process is still up; the health service
        # reflects the engine: NOT_SERVING once it died (and while draining).
        # They ask the plaintext health port because the kubelet's gRPC probes
        # speak no TLS and the gRPC port may be mTLS; a gRPC probe takes a port
        # number, not a name. The engine loads the model before any port opens;
        # the startup probe gives it up to 20 minutes, then liveness takes over.
        "startupProbe": {"grpc": _health_check(), "periodSeconds": 10, "failureThreshold": 120},
        "livenessProbe": {"grpc": _health_check(), "periodSeconds": 15, "failureThreshold": 4},
        "readinessProbe": {"grpc": _health_check(), "periodSeconds": 5, "failureThreshold": 2},
        "resources": pool_spec.resources.model_dump(),
        "securityContext": RESTRICTED_SECURITY_CONTEXT,
        "volumeMounts": mounts,
    }
    pod_spec: dict[str, Any] = {
        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": pool_spec.drain_timeout_seconds + GRACE_MARGIN_S,
        "containers": [container],
        "volumes": volumes,
    }
    if source.init_container is not None:
        pod_spec["initContainers"] = [
            {
                "name": "fetch-model",
                "image": source.init_container.image,
                "command": list(source.init_container.command),
                "securityContext": RESTRICTED_SECURITY_CONTEXT,
                "volumeMounts": [{"name": "model", "mountPath": "/models"}, {"name": "tmp", "mountPath": "/tmp"}],
            }
        ]
    if spec.service_account_name:
        pod_spec["serviceAccountName"] = spec.service_account_name
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s.name} for s in spec.image_pull_secrets]
    if pool_spec.node_selector:
        pod_spec["nodeSelector"] = dict(pool_spec.node_selector)
    if pool_spec.tolerations:
        pod_spec["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in pool_spec.tolerations]
    _schedule(pod_spec, container, pool_spec, selector_labels(name, pool))
    template_annotations = {**pool_spec.pod_annotations, "kubectl.kubernetes.io/default-container": "worker"}
    rollout = pool_spec.rollout
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": pool.name(name),
            "namespace": namespace,
            "labels": labels,
            "ownerReferences": [owner_reference(name, uid)],
        },
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector_labels(name, pool)},
            # By default never a worker down because of a rollout; surge instead (spec's rollout).
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": rollout.max_unavailable, "maxSurge": rollout.max_surge},
            },
            "template": {
                "metadata": {"labels": {**pool_spec.pod_labels, **labels}, "annotations": template_annotations},
                "spec": pod_spec,
            },
        },
    }


def build_pool_service(
    *, name: str, namespace: str, uid: str, cr_labels: dict[str, str], spec: TandemSpec, pool: Pool
) -> dict[str, Any]:
    """A headless Service per pool: stable DNS for the pods and a target for monitoring."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": pool.name(name),
            "namespace": namespace,
            "labels": pool_labels(name, pool, cr_labels, spec),
            "ownerReferences": [owner_reference(name, uid)],
        },
        "spec": {
            "clusterIP": "None",
            "selector": selector_labels(name, pool),
            "ports": [
                {"name": "grpc", "port": WORKER_PORT, "targetPort": "grpc", "protocol": "TCP"},
                {"name": "kv", "port": KV_PORT, "targetPort": "kv", "protocol": "TCP"},
                {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"},
            ],
        },
    }
