"""One pool's part of the ``TandemDeployment`` spec (a model's prefill or decode workers), as typed, frozen data.

Split out of :mod:`tandem_operator.spec` (which parses the whole resource and re-exports nothing from here
but :class:`PoolSpec`, :class:`Pools` and ``Role``): engine arguments, resources, scheduling options and the
rollout bounds of one pool's Deployment. Validated by pydantic when :func:`tandem_operator.spec.parse_spec`
parses the resource.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

Role = Literal["prefill", "decode"]


class SpecModel(BaseModel):
    """The base of every part of the spec: camelCase aliases, frozen, unknown fields refused."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, frozen=True, extra="forbid")


class EngineArgs(SpecModel):
    dtype: str = "auto"
    tensor_parallel_size: int = Field(default=1, ge=1)
    kv_cache_bytes: int | None = Field(default=None, ge=1)
    #: Extra ``TANDEM_WORKER_*`` variables, passed through unchanged.
    extra_env: dict[str, str] = Field(default_factory=dict)


class Toleration(SpecModel):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    #: "" (or none) tolerates every effect, as in Kubernetes.
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute", ""] | None = None
    toleration_seconds: int | None = None


class Resources(SpecModel):
    requests: dict[str, str | int] = Field(default_factory=dict)
    limits: dict[str, str | int] = Field(default_factory=dict)


#: A DNS label (a resource claim's name inside the pod, an object name it refers to).
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
#: A rollout bound: a count or a percentage of the pool's replicas, as in a Deployment's strategy.
_COUNT_OR_PERCENT = re.compile(r"^(100|[1-9]?[0-9])%$")
#: Label keys the operator sets on a pool's pods (its selector among them): a pool's podLabels may not set them.
RESERVED_POD_LABEL_PREFIXES = ("tandem.dev/", "app.kubernetes.io/")


class ResourceClaim(SpecModel):
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


class Rollout(SpecModel):
    """How a pool's Deployment rolls: pods added above the replica count, pods down below it (a count or a
    percentage). The defaults (1, 0) never take a serving worker away first; on a fully allocated GPU pool
    the surge pod stays Pending, and (0, 1) replaces one worker at a time in place instead."""

    max_surge: int | str = 1
    max_unavailable: int | str = 0

    @model_validator(mode="after")
    def _bounds(self) -> Rollout:
        for name, value in (("maxSurge", self.max_surge), ("maxUnavailable", self.max_unavailable)):
            bad_count = isinstance(value, int) and value < 0
            if bad_count or (isinstance(value, str) and not _COUNT_OR_PERCENT.fullmatch(value)):
                raise ValueError(f"rollout.{name} {value!r}: a count >= 0 or a percentage such as '25%'")
        if self.max_surge in (0, "0%") and self.max_unavailable in (0, "0%"):
            raise ValueError("rollout: maxSurge and maxUnavailable cannot both be 0 (the rollout could never start)")
        return self


class PoolSpec(SpecModel):
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
            if not (
                isinstance(skew, int)
                and skew >= 1
                and isinstance(key, str)
                and key
                and when in ("DoNotSchedule", "ScheduleAnyway")
            ):
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


class Pools(SpecModel):
    prefill: PoolSpec = PoolSpec()
    decode: PoolSpec = PoolSpec()

    def get(self, role: Role) -> PoolSpec:
        return self.prefill if role == "prefill" else self.decode
