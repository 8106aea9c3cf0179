"""What a tenant is allowed: quotas, models, priority and its trusted prompt.

Plain pydantic models, stored as JSON in Redis by :mod:`.store`, read by the
route handlers, the quota and the prompt assembly. No logic beyond defaults.
"""

from __future__ import annotations

import re
import secrets
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

#: The router's admission classes, highest first (sent as ``tandem-priority`` gRPC metadata).
PriorityClass = Literal["interactive", "standard", "batch"]
TENANT_ID_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
ANONYMOUS_TENANT_ID = "anonymous"


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
    #: Models this tenant may call; empty: every served model.
    allowed_models: list[str] = Field(default_factory=list)
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
        return not self.allowed_models or model in self.allowed_models


class ApiKeyRecord(BaseModel):
    """A key as stored: never the key itself, only its id (public) and hash (the lookup)."""

    key_id: str
    tenant_id: str
    label: str = ""
    created_unix_s: int = 0
    revoked: bool = False


def valid_tenant_id(tenant_id: str) -> bool:
    return bool(TENANT_ID_PATTERN.match(tenant_id))
