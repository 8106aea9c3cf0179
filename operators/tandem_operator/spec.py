"""The ``TandemDeployment`` spec (``tandem.dev/v1alpha1``) as typed, frozen data.

:func:`parse_spec` is called by :mod:`tandem_operator.handlers` with the raw
``spec`` dict of the custom resource; everything downstream
(:mod:`tandem_operator.resources`, :mod:`tandem_operator.autoscale`) takes the
parsed :class:`TandemSpec`. The API server validates the CRD's OpenAPI schema
(``charts/tandem/crds/``) first; this module adds the rules a schema cannot
say (min ≤ replicas ≤ max, a model source, unique model names, adapters of
served models) and turns any failure into one :class:`SpecError` whose message
goes into the ``SpecValid`` status condition.

Two forms describe the models:

* the **single-model form** (``spec.model`` + ``spec.pools``), the original
  one: its pools keep their names (``<name>-prefill``, ``<name>-decode``) and
  their objects exactly as before, so a release upgraded in place rolls no pod;
* the **models form** (``spec.models``: a list, each with its own source,
  pools and LoRA settings): each model's pools are named
  ``<name>-<model slug>-<role>`` (:func:`model_slug`: DNS-safe, length-capped,
  with a hash when the served name had to be changed) and carry the
  ``tandem.dev/model`` label.

Both are read through :meth:`TandemSpec.served_models` / :meth:`TandemSpec.pools_of`;
nothing downstream looks at the form. Moving a resource from the first form to
the second renames its pools (new Deployments, the old ones deleted): a rollout.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from tandem.common.adapters import ADAPTER_NAME

GROUP = "tandem.dev"
VERSION = "v1alpha1"
PLURAL = "tandemdeployments"
KIND = "TandemDeployment"

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")

#: What a served model's name may be (clients send it as ``model``; it becomes a label value's source
#: and a Prometheus matcher): no spaces, quotes, control characters or template tokens.
MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_./:-]{0,127}$")
#: Longest model slug: leaves room for the resource name and the role in a 63-character pool name.
MAX_SLUG_LEN = 30
#: Longest object name the pools get (a Service name is a DNS-1035 label).
MAX_POOL_NAME_LEN = 63
_DNS_SAFE = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")


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


class LoraSpec(_Model):
    """LoRA adapters on the model's workers (the worker settings ``max_adapters``, ``max_adapter_rank``)."""

    #: Adapters one worker's engine holds at once (vLLM's ``max_loras``); 0 = LoRA off.
    max_adapters: int = Field(default=0, ge=0, le=256)
    #: Largest adapter rank the engine accepts (vLLM's ``max_lora_rank``: one of its ranks).
    max_adapter_rank: Literal[1, 8, 16, 32, 64, 128, 256, 320, 512] = 16


class ModelSource(_Model):
    """Where a model's weights come from, and its engine-wide settings."""

    #: Folder of the model inside the pod (under the ``/models`` mount).
    path: str = Field(default="/models/model", pattern=r"^/models(/.*)?$")
    max_model_len: int = Field(default=2048, ge=16)
    pvc: PvcSource | None = None
    init_container: InitContainerSource | None = None
    lora: LoraSpec | None = None

    @model_validator(mode="after")
    def _one_source(self) -> ModelSource:
        if (self.pvc is None) == (self.init_container is None):
            raise ValueError("model needs exactly one source: pvc or initContainer")
        return self


class ModelSpec(ModelSource):
    """The single-model form's ``spec.model``."""

    served_model_name: str = Field(min_length=1)


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
    #: "" (or none) tolerates every effect, as in Kubernetes.
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute", ""] | None = None
    toleration_seconds: int | None = None


class Resources(_Model):
    requests: dict[str, str | int] = Field(default_factory=dict)
    limits: dict[str, str | int] = Field(default_factory=dict)


#: A DNS label (a resource claim's name inside the pod, an object name it refers to).
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
#: A rollout bound: a count or a percentage of the pool's replicas, as in a Deployment's strategy.
_COUNT_OR_PERCENT = re.compile(r"^(100|[1-9]?[0-9])%$")
#: Label keys the operator sets on a pool's pods (its selector among them): a pool's podLabels may not set them.
RESERVED_POD_LABEL_PREFIXES = ("tandem.dev/", "app.kubernetes.io/")


class ResourceClaim(_Model):
    """A Dynamic Resource Allocation claim of the pool's pods (a pod's ``resourceClaims`` entry); the worker
    container uses every one (``resources.claims``). Exactly one of the two sources."""

    name: str = Field(pattern=DNS_LABEL, max_length=63)
    resource_claim_name: str | None = Field(default=None, min_length=1)
    resource_claim_template_name: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _one_source(self) -> ResourceClaim:
        if (self.resource_claim_name is None) == (self.resource_claim_template_name is None):
            raise ValueError(f"resourceClaims {self.name!r}: give resourceClaimName or resourceClaimTemplateName")
        return self


class Rollout(_Model):
    """How a pool's Deployment rolls: pods added above the replica count, pods down below it (a count or a
    percentage). The defaults (1, 0) never take a serving worker away first; on a fully allocated GPU pool
    the surge pod stays Pending, and (0, 1) replaces one worker at a time in place instead."""

    max_surge: int | str = 1
    max_unavailable: int | str = 0

    @model_validator(mode="after")
    def _bounds(self) -> Rollout:
        for name, value in (("maxSurge", self.max_surge), ("maxUnavailable", self.max_unavailable)):
            bad_count = isinstance(value, int) and value < 0
            if bad_count or (isinstance(value, str) and not _COUNT_OR_PERCENT.match(value)):
                raise ValueError(f"rollout.{name} {value!r}: a count >= 0 or a percentage such as '25%'")
        if self.max_surge in (0, "0%") and self.max_unavailable in (0, "0%"):
            raise ValueError("rollout: maxSurge and maxUnavailable cannot both be 0 (the rollout could never start)")
        return self


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
    # -- Scheduling and pod metadata, each copied into the pool's pod template as Kubernetes spells it.
    #: A pod ``affinity`` (nodeAffinity, podAffinity, podAntiAffinity), passed through as written.
    affinity: dict[str, Any] = Field(default_factory=dict)
    #: ``topologySpreadConstraints``; one without ``labelSelector`` gets the pool's own pods' selector.
    topology_spread_constraints: list[dict[str, Any]] = Field(default_factory=list)
    priority_class_name: str = Field(default="", pattern=r"^$|^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", max_length=253)
    #: The container runtime class (e.g. ``nvidia`` where it is not the node's default runtime).
    runtime_class_name: str = Field(default="", pattern=r"^$|^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", max_length=253)
    #: Annotations on the pods (e.g. Multus ``k8s.v1.cni.cncf.io/networks`` for a second network).
    pod_annotations: dict[str, str] = Field(default_factory=dict)
    #: Labels on this pool's pods (beside the resource's ``podLabels``); the operator's own keys are refused.
    pod_labels: dict[str, str] = Field(default_factory=dict)
    resource_claims: list[ResourceClaim] = Field(default_factory=list, max_length=16)
    rollout: Rollout = Rollout()

    @model_validator(mode="after")
    def _bounds(self) -> PoolSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"minReplicas {self.min_replicas} > maxReplicas {self.max_replicas}")
        if not self.min_replicas <= self.replicas <= self.max_replicas:
            raise ValueError(
                f"replicas {self.replicas} outside [minReplicas {self.min_replicas}, maxReplicas {self.max_replicas}]"
            )
        return self

    @model_validator(mode="after")
    def _consistent(self) -> PoolSpec:
        tp = self.engine_args.tensor_parallel_size
        if self.num_gpus > 0 and tp > self.num_gpus:
            raise ValueError(
                f"engineArgs.tensorParallelSize {tp} > the {self.num_gpus} GPU(s) in resources.limits "
                "(one rank per GPU)"
            )
        reserved = sorted(k for k in self.pod_labels if k.startswith(RESERVED_POD_LABEL_PREFIXES))
        if reserved:
            raise ValueError(f"podLabels {reserved}: keys under {list(RESERVED_POD_LABEL_PREFIXES)} are the operator's")
        for i, c in enumerate(self.topology_spread_constraints):
            skew, key, when = c.get("maxSkew"), c.get("topologyKey"), c.get("whenUnsatisfiable")
            if not (isinstance(skew, int) and skew >= 1 and isinstance(key, str) and key
                    and when in ("DoNotSchedule", "ScheduleAnyway")):
                raise ValueError(
                    f"topologySpreadConstraints[{i}]: needs maxSkew >= 1, a topologyKey and whenUnsatisfiable "
                    "DoNotSchedule or ScheduleAnyway"
                )
        claims = [c.name for c in self.resource_claims]
        if len(set(claims)) != len(claims):
            raise ValueError(f"resourceClaims: duplicate names {sorted({n for n in claims if claims.count(n) > 1})}")
        return self

    @property
    def num_gpus(self) -> int:
        """GPUs per worker (``nvidia.com/gpu`` in the limits; 0 when absent or not a whole number)."""
        value = self.resources.limits.get("nvidia.com/gpu", 0)
        return value if isinstance(value, int) else int(value) if str(value).isdigit() else 0


class Pools(_Model):
    prefill: PoolSpec = PoolSpec()
    decode: PoolSpec = PoolSpec()

    def get(self, role: Role) -> PoolSpec:
        return self.prefill if role == "prefill" else self.decode


class ModelEntry(ModelSource):
    """One model of the models form (``spec.models[]``), with its own pools."""

    #: The served model name (what clients send as ``model``).
    name: str = Field(pattern=MODEL_NAME.pattern)
    prefill: PoolSpec = PoolSpec()
    decode: PoolSpec = PoolSpec()


class AdapterSpec(_Model):
    """A LoRA adapter the operator keeps in the adapter catalog (``spec.adapters[]``)."""

    name: str = Field(pattern=ADAPTER_NAME.pattern)
    #: The served model it adapts (a ``spec.models[].name``, or the single model's servedModelName).
    base_model: str = Field(min_length=1)
    #: The adapter's folder, as every worker of the base model sees it (absolute; no control character: C0,
    #: DEL or C1, which helm's toYaml cannot encode).
    path: str = Field(pattern=r"^/[^\x00-\x1f\x7f-\x9f]*$", max_length=4096)


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
    #: Prometheus-text endpoint of the router (Ray's metrics export), for ``source: router`` without
    #: ``router_metrics_service`` (local mode, tests): one URL, so one router pod per read.
    router_metrics_url: str = ""
    #: The router's metrics Service in the resource's namespace: ``source: router`` reads every ready
    #: pod its EndpointSlices list (summed), and Prometheus queries select the router's series by it
    #: (label ``service``). "" = the URL above, and Prometheus series by namespace alone.
    router_metrics_service: str = Field(default="", pattern=r"^([a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?)?$")
    #: The gateway's metrics Service: Prometheus queries select the gateway's series by it (label
    #: ``service``). "" = by namespace alone (two releases in one namespace then mix their latencies).
    gateway_metrics_service: str = Field(default="", pattern=r"^([a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?)?$")
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


def model_slug(name: str) -> str:
    """``name`` as a DNS label for object names and label values: the name itself when it already is one
    (and short enough), else lowercased, other characters as ``-``, cut, and a hash of the name appended
    (so two names never share a slug by being cleaned alike)."""
    if len(name) <= MAX_SLUG_LEN and _DNS_SAFE.match(name):
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    cleaned = re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", name.lower())).strip("-")
    cleaned = cleaned[: MAX_SLUG_LEN - len(digest) - 1].rstrip("-")
    return f"{cleaned}-{digest}" if cleaned else digest


def _capped(name: str) -> str:
    """``name`` within :data:`MAX_POOL_NAME_LEN` (cut, with a hash of the whole so cuts stay apart)."""
    if len(name) <= MAX_POOL_NAME_LEN:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[: MAX_POOL_NAME_LEN - len(digest) - 1].rstrip('-')}-{digest}"


@dataclass(frozen=True)
class ServedModel:
    """One model as the rest of the operator sees it, whichever form described it."""

    name: str
    source: ModelSource
    pools: Pools
    #: DNS-safe name part of its pools; None for the single-model form (pools named as they always were).
    slug: str | None

    @property
    def max_adapters(self) -> int:
        return 0 if self.source.lora is None else self.source.lora.max_adapters


@dataclass(frozen=True)
class Pool:
    """One pool (a model's prefill or decode workers): one Deployment and one Service."""

    model: ServedModel
    role: Role

    @property
    def key(self) -> str:
        """Its key in ``status.pools`` and the autoscaler's state: the role (single-model form) or
        ``<slug>-<role>``."""
        return self.role if self.model.slug is None else f"{self.model.slug}-{self.role}"

    @property
    def spec(self) -> PoolSpec:
        return self.model.pools.get(self.role)

    def name(self, deployment_name: str) -> str:
        """The Deployment's and the Service's name."""
        return _capped(f"{deployment_name}-{self.key}")


class TandemSpec(_Model):
    #: The single-model form (with ``pools``); exactly one of ``model`` and ``models``.
    model: ModelSpec | None = None
    image: ImageSpec
    redis: RedisRef
    pools: Pools = Pools()
    #: The models form: several models, each with its own pools.
    models: list[ModelEntry] = Field(default_factory=list, max_length=32)
    #: LoRA adapters the operator keeps in the adapter catalog.
    adapters: list[AdapterSpec] = Field(default_factory=list, max_length=1024)
    slo: SloSpec = SloSpec()
    autoscaling: AutoscalingSpec = AutoscalingSpec()
    service_account_name: str = ""
    #: Secrets for pulling the worker image, as in a pod spec (``[{"name": ...}]``).
    image_pull_secrets: list[ImagePullSecret] = Field(default_factory=list)
    #: Extra labels for every pod of both pools.
    pod_labels: dict[str, str] = Field(default_factory=dict)
    #: Mutual TLS for the pools' gRPC; None: plaintext, fenced by NetworkPolicies.
    tls: TLSRef | None = None

    @model_validator(mode="after")
    def _models_and_adapters(self) -> TandemSpec:
        if (self.model is None) == (not self.models):
            raise ValueError("give exactly one of model (one model, with pools) or models (a list)")
        if self.models and "pools" in self.model_fields_set:
            raise ValueError("pools belong to each entry of models (models[].prefill, models[].decode)")
        names = [m.name for m in self.served_models()]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate model names: {sorted({n for n in names if names.count(n) > 1})}")
        slugs = [m.slug for m in self.served_models()]
        if len(set(slugs)) != len(slugs):
            raise ValueError("two model names make the same pool name; rename one")
        by_name = {m.name: m for m in self.served_models()}
        adapter_names = [a.name for a in self.adapters]
        if len(set(adapter_names)) != len(adapter_names):
            dup = sorted({n for n in adapter_names if adapter_names.count(n) > 1})
            raise ValueError(f"duplicate adapter names: {dup}")
        for adapter in self.adapters:
            if adapter.name in by_name:
                raise ValueError(f"adapter {adapter.name!r} has a served model's name")
            base = by_name.get(adapter.base_model)
            if base is None:
                raise ValueError(f"adapter {adapter.name!r}: baseModel {adapter.base_model!r} is not a served model")
            if base.max_adapters == 0:
                raise ValueError(f"adapter {adapter.name!r}: model {base.name!r} has LoRA off (lora.maxAdapters 0)")
        return self

    def served_models(self) -> list[ServedModel]:
        if self.model is not None:
            return [ServedModel(self.model.served_model_name, self.model, self.pools, None)]
        return [ServedModel(m.name, m, Pools(prefill=m.prefill, decode=m.decode), model_slug(m.name))
                for m in self.models]

    def pools_of(self) -> list[Pool]:
        """Every pool: each model's prefill, then its decode."""
        return [Pool(model, role) for model in self.served_models() for role in ROLES]


def parse_spec(raw: dict[str, Any] | Any) -> TandemSpec:
    """The typed spec, or :class:`SpecError` with every problem on one line."""
    try:
        return TandemSpec.model_validate(dict(raw))
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'spec'}: {err['msg']}" for err in exc.errors())
        raise SpecError(f"invalid spec: {problems}") from exc
    except (TypeError, ValueError) as exc:
        raise SpecError(f"invalid spec: {exc}") from exc
