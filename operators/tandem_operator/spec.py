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

from pydantic import Field, ValidationError, model_validator

from tandem.common.adapters import ADAPTER_NAME
from tandem_operator.pool_spec import EngineArgs, Pools, SpecModel
from tandem_operator.pool_spec import PoolSpec as PoolSpec  # re-exported: its users import it from here
from tandem_operator.pool_spec import Role as Role

GROUP = "tandem.dev"
VERSION = "v1alpha1"
PLURAL = "tandemdeployments"
KIND = "TandemDeployment"

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


class ImageSpec(SpecModel):
    repository: str = Field(min_length=1)
    tag: str = Field(min_length=1)
    #: sha256:<64 hex>; when set the pods pull repository@digest and the tag is ignored (the release
    #: workflow publishes images by digest).
    digest: str = Field(default="", pattern=r"^(sha256:[0-9a-f]{64})?$")
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"

    @property
    def ref(self) -> str:
        return f"{self.repository}@{self.digest}" if self.digest else f"{self.repository}:{self.tag}"


class PvcSource(SpecModel):
    claim_name: str = Field(min_length=1)
    sub_path: str = ""


class InitContainerSource(SpecModel):
    """An image whose command copies the model into ``/models`` (an emptyDir)."""

    image: str = Field(min_length=1)
    command: list[str] = Field(min_length=1)


class LoraSpec(SpecModel):
    """LoRA adapters on the model's workers (the worker settings ``max_adapters``, ``max_adapter_rank``)."""

    #: Adapters one worker's engine holds at once (vLLM's ``max_loras``); 0 = LoRA off.
    max_adapters: int = Field(default=0, ge=0, le=256)
    #: Largest adapter rank the engine accepts (vLLM's ``max_lora_rank``: one of its ranks).
    max_adapter_rank: Literal[1, 8, 16, 32, 64, 128, 256, 320, 512] = 16


#: The worker's variable for the weights' revision (``ModelSource.revision``, set by the operator).
MODEL_REVISION_ENV = "TANDEM_WORKER_ENGINE__MODEL_REVISION"


class ModelSource(SpecModel):
    """Where a model's weights come from, and its engine-wide settings."""

    #: Folder of the model inside the pod (under the ``/models`` mount).
    path: str = Field(default="/models/model", pattern=r"^/models(/.*)?$")
    max_model_len: int = Field(default=2048, ge=16)
    #: The weights' revision (a commit, a tag): the workers' TANDEM_WORKER_ENGINE__MODEL_REVISION, part
    #: of their KV fingerprint; "" = a digest of the model folder (tandem.common.kv_fingerprint).
    revision: str = Field(default="", pattern=r"^([A-Za-z0-9][A-Za-z0-9._/:@+-]{0,127})?$")
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

    #: The same rule as a models-form name (MODEL_NAME): it is a worker's registered model and a PromQL value.
    served_model_name: str = Field(pattern=MODEL_NAME.pattern)


class RedisRef(SpecModel):
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


class TLSRef(SpecModel):
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


class ModelEntry(ModelSource):
    """One model of the models form (``spec.models[]``), with its own pools."""

    #: The served model name (what clients send as ``model``).
    name: str = Field(pattern=MODEL_NAME.pattern)
    prefill: PoolSpec = PoolSpec()
    decode: PoolSpec = PoolSpec()


class AdapterSpec(SpecModel):
    """A LoRA adapter the operator keeps in the adapter catalog (``spec.adapters[]``)."""

    name: str = Field(pattern=ADAPTER_NAME.pattern)
    #: The served model it adapts (a ``spec.models[].name``, or the single model's servedModelName).
    base_model: str = Field(min_length=1)
    #: The adapter's folder, as every worker of the base model sees it (absolute; no control character: C0,
    #: DEL or C1, which helm's toYaml cannot encode).
    path: str = Field(pattern=r"^/[^\x00-\x1f\x7f-\x9f]*$", max_length=4096)


class SloSpec(SpecModel):
    ttft_p90_seconds: float = Field(default=2.0, gt=0)
    itl_p90_seconds: float = Field(default=0.1, gt=0)


class PrefillTargets(SpecModel):
    #: Requests waiting in the router per prefill replica before adding one.
    queue_depth_per_replica: float = Field(default=4.0, gt=0)
    #: Uncached prompt tokens in flight per prefill replica before adding one.
    uncached_tokens_per_replica: float = Field(default=8192.0, gt=0)


class DecodeTargets(SpecModel):
    #: Average share (0..1) of the router's decode budget in use to hold (what its admission check counts).
    budget_usage: float = Field(default=0.8, gt=0, le=1)
    #: Average KV-cache usage (0..1) of the decode pool to hold.
    kv_usage: float = Field(default=0.7, gt=0, le=1)
    #: Requests waiting for decode (router queue for decode budget, engines' queues) per decode replica.
    waiting_per_replica: float = Field(default=4.0, gt=0)


class CapacitySpec(SpecModel):
    """Per-worker capacity within the SLO, measured by ``tandem-loadtest sweep`` (0: not measured)."""

    #: Uncached prompt tokens per second one prefill worker computes at the knee.
    prefill_tokens_per_second_per_worker: float = Field(default=0.0, ge=0)
    #: Output tokens per second one decode worker generates at the knee.
    decode_tokens_per_second_per_worker: float = Field(default=0.0, ge=0)


class AutoscalingSpec(SpecModel):
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
    capacity: CapacitySpec = CapacitySpec()


class ImagePullSecret(SpecModel):
    name: str = Field(min_length=1)


def model_slug(name: str) -> str:
    """``name`` as a DNS label for object names and label values: the name itself when it already is one
    (and short enough), else lowercased, other characters as ``-``, cut, and a hash of the name appended
    (so two names never share a slug by being cleaned alike)."""
    if len(name) <= MAX_SLUG_LEN and _DNS_SAFE.fullmatch(name):
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


#: The worker variables of a pool's ``engineArgs.extraEnv`` that decide its KV fingerprint
#: (:func:`tandem.common.kv_fingerprint.kv_fingerprint`'s model, dtype, tensor-parallel size and revision).
DTYPE_ENV = "TANDEM_WORKER_ENGINE__DTYPE"
TP_ENV = "TANDEM_WORKER_ENGINE__TENSOR_PARALLEL_SIZE"
SERVED_NAME_ENV = "TANDEM_WORKER_ENGINE__SERVED_MODEL_NAME"
#: vLLM's other names of one dtype.
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def pairing_conflicts(model: ServedModel) -> list[str]:
    """What, declared in the spec, makes ``model``'s prefill and decode workers' KV fingerprints differ for
    certain (``"<setting>: prefill <value>, decode <value>"``; [] when they may pair): the dtype (``engineArgs.dtype``,
    or ``extraEnv``'s, which the worker reads last; ``auto`` is the model's and the platform's, so it differs
    from nothing declared), the tensor-parallel size, the served model name (``extraEnv``) and the weights'
    revision (``model.revision`` is both pools'; ``extraEnv``'s differs from none declared, whose revision is
    the model folder's ``dir-`` digest). Not compared: the model folder (two folders may hold the same
    files, and the fingerprint reads their files, not their path), and the block size and image, which no
    pool sets apart. The chart's ``tandem.checkPairing`` says the same at render time."""
    prefill, decode = (model.pools.get(role).engine_args for role in ROLES)
    out = []

    def dtype(args: EngineArgs) -> str:
        value = str(args.extra_env.get(DTYPE_ENV, args.dtype)).strip().lower()
        return _DTYPE_ALIASES.get(value, value)

    p, d = dtype(prefill), dtype(decode)
    if "auto" not in (p, d) and "" not in (p, d) and p != d:
        out.append(f"engineArgs.dtype: prefill {p}, decode {d}")

    def tp(args: EngineArgs) -> str:
        return str(args.extra_env.get(TP_ENV, args.tensor_parallel_size)).strip()

    p, d = tp(prefill), tp(decode)
    if p.isascii() and p.isdigit() and d.isascii() and d.isdigit() and int(p) != int(d):
        out.append(f"engineArgs.tensorParallelSize: prefill {int(p)}, decode {int(d)}")
    p, d = (a.extra_env.get(SERVED_NAME_ENV, model.name) for a in (prefill, decode))
    if p != d:
        out.append(f"{SERVED_NAME_ENV}: prefill {p}, decode {d}")
    if not model.source.revision:
        p, d = (a.extra_env.get(MODEL_REVISION_ENV, "") for a in (prefill, decode))
        if p != d and not ((p == "" and d.startswith("dir-")) or (d == "" and p.startswith("dir-"))):
            none = "none (the folder digest)"
            out.append(f"{MODEL_REVISION_ENV}: prefill {p or none}, decode {d or none}")
    return out


class TandemSpec(SpecModel):
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
        for pool in self.pools_of():
            spec = pool.spec
            if pool.model.source.revision and spec is not None and MODEL_REVISION_ENV in spec.engine_args.extra_env:
                raise ValueError(
                    f"{pool.key}: the revision is model.revision's; drop {MODEL_REVISION_ENV} from engineArgs.extraEnv"
                )
        for i, model in enumerate(self.served_models()):
            differ = pairing_conflicts(model)
            if differ:
                where = "pools" if model.slug is None else f"models[{i}] ({model.name})"
                raise ValueError(
                    f"{where}: prefill and decode can never pair ({'; '.join(differ)}): their workers' KV "
                    "fingerprints differ, so the router would run every request as a local prefill; "
                    "set the same on both pools"
                )
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
