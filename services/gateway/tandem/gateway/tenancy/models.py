"""What a tenant is allowed: quotas, models and adapters, priority and its trusted prompt.

Plain pydantic models, stored as JSON in Redis by :mod:`.store`, read by the
route handlers, the quota and the prompt assembly. The one rule here is
:func:`allowed` (with :func:`may_know_missing`): which base models and LoRA
adapters a tenant may call, used where the gateway resolves a request's
``model`` and by ``/v1/models``.
"""

from __future__ import annotations

import re
import secrets
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tandem.common.adapters import ADAPTER_NAME

#: The router's admission classes, highest first (sent as ``tandem-priority`` gRPC metadata).
PriorityClass = Literal["interactive", "standard", "batch"]
TENANT_ID_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
ANONYMOUS_TENANT_ID = "anonymous"


class ModelQuota(BaseModel):
    """One tenant's limits on one model or adapter, on top of its own (``None``: the tenant's alone)."""

    model_config = ConfigDict(extra="ignore")

    input_tokens_per_minute: int | None = Field(None, ge=1)
    output_tokens_per_minute: int | None = Field(None, ge=1)
    max_concurrent_streams: int | None = Field(None, ge=1)


class TenantPolicy(BaseModel):
    """Limits and prompt rules of one tenant. ``None`` means unlimited."""

    model_config = ConfigDict(extra="ignore")

    #: Prompt tokens admitted per minute (token bucket, shared by all gateway replicas).
    input_tokens_per_minute: int | None = Field(None, ge=1)
    #: Completion tokens per minute; a request reserves its ``max_tokens`` at admission.
    output_tokens_per_minute: int | None = Field(None, ge=1)
    #: Requests generating at the same time.
    max_concurrent_streams: int | None = Field(None, ge=1)
    #: Prompt plus completion tokens per request (capped by the model's own context).
    max_context_tokens: int | None = Field(None, ge=2)
    #: Base models this tenant may call; empty: every served model.
    allowed_models: list[str] = Field(default_factory=list)
    #: LoRA adapters this tenant may call, by the name requests use; empty: every adapter (of a base
    #: model it may call: see :func:`allowed`).
    allowed_adapters: list[str] = Field(default_factory=list)
    #: Limits per model or adapter (by the name requests use), each its own buckets and stream slots
    #: beside the tenant's: a request is admitted when both have room (tandem.gateway.quota.redis_quota).
    model_quotas: dict[str, ModelQuota] = Field(default_factory=dict)
    priority_class: PriorityClass = "standard"
    #: Inserted by the server as the first system block of every chat request.
    system_prompt: str = ""
    #: Whether clients may send their own ``system``/``developer`` messages (appended after the trusted one).
    allow_client_system_prompt: bool = True
    #: Whether raw prompts (``/v1/completions``: text or token ids sent to the model as they are) are
    #: served when the tenant has a prompt policy (a system prompt, or no client system messages). A raw
    #: prompt can open with its own system turn, so it would skip that policy: refused (403) unless set.
    allow_raw_prompts: bool = False
    #: Bytes this tenant may keep stored in Redis (conversations, and any later store): past it its least
    #: recently used conversations are forgotten, and a request that could not fit even then gets 413
    #: ``storage_quota_exceeded`` (tandem.gateway.storage_quota). Unset: the gateway's
    #: ``tenancy.default_max_stored_bytes_per_tenant``, never unlimited; 0: nothing stored (no conversations).
    max_stored_bytes: int | None = Field(None, ge=0)

    def model_policy(self, model: str) -> TenantPolicy | None:
        """The limits of ``model`` (as the request names it) as a policy of their own; None without any."""
        quota = self.model_quotas.get(model) if model else None
        return None if quota is None else TenantPolicy(**quota.model_dump())

    @field_validator("allowed_adapters")
    @classmethod
    def _adapter_names(cls, names: list[str]) -> list[str]:
        for name in names:
            if not ADAPTER_NAME.fullmatch(name):
                raise ValueError(f"allowed adapter {name!r}: not an adapter name (1-128 of A-Z a-z 0-9 _ . : -)")
        return names


class Tenant(TenantPolicy):
    id: str
    name: str = ""
    created_unix_s: int = 0
    #: A disabled tenant's keys answer 401.
    disabled: bool = False
    #: Random per tenant record, made when it is created: a tenant deleted and created again under
    #: the same id starts with a cold cache, and nobody can compute another tenant's salt from its id.
    salt: str = Field(default_factory=lambda: secrets.token_hex(16))

    @property
    def cache_salt(self) -> str:
        """Prefix-cache namespace of this tenant: blocks computed for one tenant never match another's."""
        return self.salt

    def public(self) -> dict[str, Any]:
        """The record as admins see it (the salt stays inside)."""
        return self.model_dump(exclude={"salt"})

    @property
    def has_prompt_policy(self) -> bool:
        """Whether the server shapes this tenant's prompts (a trusted system prompt, or client system
        messages refused), which a raw prompt would skip."""
        return bool(self.system_prompt) or not self.allow_client_system_prompt

    def may_send_raw_prompts(self) -> bool:
        return self.allow_raw_prompts or not self.has_prompt_policy

    def may_use(self, model: str) -> bool:
        """Whether the tenant may call the base model ``model`` (:func:`allowed` for adapters too)."""
        return not self.allowed_models or model in self.allowed_models


def allowed(tenant: TenantPolicy, model_id: str, base_model: str) -> bool:
    """Whether ``tenant`` may call ``model_id``, a request's ``model`` as resolved: ``base_model`` is the
    base model that runs it (``model_id`` itself for a base model, the adapter's base model for a LoRA
    adapter). A base model: on ``allowed_models``, or that list empty. An adapter: on
    ``allowed_adapters`` (or that list empty) **and** its base model allowed too, for an adapter runs
    the base model's weights: a tenant kept off a base model is kept off it through adapters as well.
    """
    base_allowed = not tenant.allowed_models or base_model in tenant.allowed_models
    if model_id == base_model:
        return base_allowed
    return base_allowed and (not tenant.allowed_adapters or model_id in tenant.allowed_adapters)


def may_know_missing(tenant: TenantPolicy, model_id: str) -> bool:
    """Whether a ``model`` that names nothing (no served model, no loaded adapter) answers ``tenant``
    404 ``model_not_found`` (True) or 403 ``model_not_allowed`` (False), the answer it gets for an
    adapter that exists and is not its own. False exactly when the tenant has an adapter allow-list that
    does not name ``model_id`` (nor does its model allow-list): otherwise 404 against 403 would tell it
    which adapter names other tenants have loaded. A tenant without an adapter list may use, and list,
    every adapter, so a missing name tells it nothing new.
    """
    return not tenant.allowed_adapters or model_id in tenant.allowed_adapters or model_id in tenant.allowed_models


class ApiKeyRecord(BaseModel):
    """A key as stored: never the key itself, only its id (public) and hash (the lookup)."""

    key_id: str
    tenant_id: str
    label: str = ""
    created_unix_s: int = 0
    revoked: bool = False


def valid_tenant_id(tenant_id: str) -> bool:
    return bool(TENANT_ID_PATTERN.fullmatch(tenant_id))
