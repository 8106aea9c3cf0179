"""The ``TandemDeployment`` spec (``tandem.dev/v1alpha1``) as typed, frozen data.

:func:`parse_spec` is called by :mod:`tandem_operator.handlers` with the raw
``spec`` dict of the custom resource; everything downstream
(:mod:`tandem_operator.resources`, :mod:`tandem_operator.autoscale`) takes the
parsed :class:`TandemSpec`. The API server validates the CRD's OpenAPI schema
(``charts/tandem/crds/``) first; this module adds the rules a schema cannot
say (min ≤ replicas ≤ max, a model source) and turns any failure into one
:class:`SpecError` whose message goes into the ``SpecValid`` status condition.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

GROUP = "tandem.dev"
VERSION = "v1alpha1"
PLURAL = "tandemdeployments"
KIND = "TandemDeployment"

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")


class SpecError(ValueError):
    """The resource cannot be reconciled as written; the message says why (permanent)."""


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, frozen=True, extra="forbid")


class ImageSpec(_Model):
    repository: str = Field(min_length=1)
    tag: str = Field(min_length=1)
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"

    @property
    def ref(self) -> str:
        return f"{self.repository}:{self.tag}"


class PvcSource(_Model):
    claim_name: str = Field(min_length=1)
    sub_path: str = ""


class InitContainerSource(_Model):
    """An image whose command copies the model into ``/models`` (an emptyDir)."""

    image: str = Field(min_length=1)
    command: list[str] = Field(min_length=1)


class ModelSpec(_Model):
    served_model_name: str = Field(min_length=1)
    #: Folder of the model inside the pod (under the ``/models`` mount).
    path: str = Field(default="/models/model", pattern=r"^/models(/.*)?$")
    max_model_len: int = Field(default=2048, ge=16)
    pvc: PvcSource | None = None
    init_container: InitContainerSource | None = None

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if (self.pvc is None) == (self.init_container is None):
            raise ValueError("model needs exactly one source: pvc or initContainer")
        return self


class RedisRef(_Model):
    """Where the pools' workers register. ``url`` or a Secret key holding it."""

    url: str | None = None
    secret_name: str | None = None
    secret_key: str = "url"
    key_prefix: str = "tandem"

    @model_validator(mode="after")
    def _one_source(self) -> RedisRef:
        if (self.url is None) == (self.secret_name is None):
            raise ValueError("redis needs exactly one of url or secretName")
        return self


class TLSRef(_Model):
    """Mutual TLS of the pools' gRPC (Worker service, KV transfer): Secrets with tls.crt, tls.key, ca.crt.

    Each pool should have its own role's certificate (``prefillSecretName``, ``decodeSecretName``: the
    workers check each caller's role, and a decode worker's KV pulls need the decode role);
    ``secretName`` is the one Secret of a pool that names none (one certificate for every role)."""

    secret_name: str | None = Field(default=None, min_length=1)
    prefill_secret_name: str | None = Field(default=None, min_length=1)
    decode_secret_name: str | None = Field(default=None, min_length=1)
    #: DNS name in the certificate that callers check (workers are dialled by pod IP); "" = the IP.
    server_name: str = ""

    @model_validator(mode="after")
    def _a_secret_per_pool(self) -> TLSRef:
        if self.secret_name is None and (self.prefill_secret_name is None or self.decode_secret_name is None):
            raise ValueError("tls needs secretName, or both prefillSecretName and decodeSecretName")
        return self

    def secret_for(self, role: str) -> str:
        """The Secret mounted into ``role``'s pool."""
        own = self.prefill_secret_name if role == "prefill" else self.decode_secret_name
        secret = own or self.secret_name
        assert secret is not None  # the validator
        return secret


class EngineArgs(_Model):
    dtype: str = "auto"
    tensor_parallel_size: int = Field(default=1, ge=1)
    kv_cache_bytes: int | None = Field(default=None, ge=1)
    #: Extra ``TANDEM_WORKER_*`` variables, passed through unchanged.
    extra_env: dict[str, str] = Field(default_factory=dict)


class Toleration(_Model):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class Resources(_Model):
    requests: dict[str, str | int] = Field(default_factory=dict)
    limits: dict[str, str | int] = Field(default_factory=dict)


class PoolSpec(_Model):
    replicas: int = Field(default=1, ge=0)
    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=4, ge=1)
    resources: Resources = Resources()
    engine_args: EngineArgs = EngineArgs()
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    #: A worker told to stop finishes its in-flight requests for at most this long.
    drain_timeout_seconds: int = Field(default=120, ge=0)

    @model_validator(mode="after")
    def _bounds(self) -> PoolSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"minReplicas {self.min_replicas} > maxReplicas {self.max_replicas}")
        if not self.min_replicas <= self.replicas <= self.max_replicas:
            raise ValueError(
                f"replicas {self.replicas} outside [minReplicas {self.min_replicas}, maxReplicas {self.max_replicas}]"
            )
        return self

    @property
    def num_gpus(self) -> int:
        return int(self.resources.limits.get("nvidia.com/gpu", 0))


class Pools(_Model):
    prefill: PoolSpec = PoolSpec()
    decode: PoolSpec = PoolSpec()

    def get(self, role: Role) -> PoolSpec:
        return self.prefill if role == "prefill" else self.decode


class SloSpec(_Model):
    ttft_p90_seconds: float = Field(default=2.0, gt=0)
    itl_p90_seconds: float = Field(default=0.1, gt=0)


class PrefillTargets(_Model):
    #: Requests waiting in the router per prefill replica before adding one.
    queue_depth_per_replica: float = Field(default=4.0, gt=0)
    #: Uncached prompt tokens in flight per prefill replica before adding one.
    uncached_tokens_per_replica: float = Field(default=8192.0, gt=0)


class DecodeTargets(_Model):
    #: Average share (0..1) of the router's decode budget in use to hold (what its admission check counts).
    budget_usage: float = Field(default=0.8, gt=0, le=1)
    #: Average KV-cache usage (0..1) of the decode pool to hold.
    kv_usage: float = Field(default=0.7, gt=0, le=1)
    #: Requests waiting for decode (router queue for decode budget, engines' queues) per decode replica.
    waiting_per_replica: float = Field(default=4.0, gt=0)


class AutoscalingSpec(_Model):
    enabled: bool = True
    #: The pools' replicas belong to an external autoscaler (HPA, KEDA) targeting the pool Deployments:
    #: the operator neither decides nor resets them after creating the pools.
    external: bool = False
    source: Literal["prometheus", "router"] = "prometheus"
    prometheus_url: str = "http://prometheus-operated.monitoring.svc:9090"
    #: Prometheus-text endpoint of the router (Ray's metrics export), for ``source: router``.
    router_metrics_url: str = ""
    interval_seconds: float = Field(default=15.0, gt=0)
    scale_up_stabilization_seconds: float = Field(default=30.0, ge=0)
    scale_down_stabilization_seconds: float = Field(default=300.0, ge=0)
    max_scale_up_step: int = Field(default=2, ge=1)
    max_scale_down_step: int = Field(default=1, ge=1)
    #: Ratios within this band of 1.0 leave the replica count alone (no flapping).
    tolerance: float = Field(default=0.1, ge=0, lt=1)
    #: Scale-down is allowed only while the pool's latency p90 is below this fraction of its SLO.
    scale_down_slo_fraction: float = Field(default=0.8, gt=0, le=1)
    prefill: PrefillTargets = PrefillTargets()
    decode: DecodeTargets = DecodeTargets()


class ImagePullSecret(_Model):
    name: str = Field(min_length=1)


class TandemSpec(_Model):
    model: ModelSpec
    image: ImageSpec
    redis: RedisRef
    pools: Pools = Pools()
    slo: SloSpec = SloSpec()
    autoscaling: AutoscalingSpec = AutoscalingSpec()
    service_account_name: str = ""
    #: Secrets for pulling the worker image, as in a pod spec (``[{"name": ...}]``).
    image_pull_secrets: list[ImagePullSecret] = Field(default_factory=list)
    #: Extra labels for every pod of both pools.
    pod_labels: dict[str, str] = Field(default_factory=dict)
    #: Mutual TLS for the pools' gRPC; None: plaintext, fenced by NetworkPolicies.
    tls: TLSRef | None = None


def parse_spec(raw: dict[str, Any] | Any) -> TandemSpec:
    """The typed spec, or :class:`SpecError` with every problem on one line."""
    try:
        return TandemSpec.model_validate(dict(raw))
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'spec'}: {err['msg']}" for err in exc.errors())
        raise SpecError(f"invalid spec: {problems}") from exc
    except (TypeError, ValueError) as exc:
        raise SpecError(f"invalid spec: {exc}") from exc
