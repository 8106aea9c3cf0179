"""The quota seam. Route handlers call :meth:`Quota.admit` after the prompt is
built and before the router is asked; the generation response calls
:meth:`Quota.settle` exactly once when the request ends, however it ends."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from tandem.gateway.tenancy.models import TenantPolicy


@dataclass(frozen=True)
class Admission:
    """An admitted request's reservation, and the figures for the ``x-ratelimit-*`` headers."""

    tenant_id: str
    request_id: str
    num_input_tokens: int
    num_reserved_output_tokens: int
    policy: TenantPolicy
    headers: dict[str, str] = field(default_factory=dict)
    #: False when nothing was charged (unlimited tenant, or Redis down with fail_mode=open).
    charged: bool = True
    #: The charge on the request's model's own limits (``TenantPolicy.model_quotas``), settled with this.
    model_part: Admission | None = None


class Quota(Protocol):
    async def precheck(self, tenant_id: str, policy: TenantPolicy, min_input_tokens: int, *, model: str = "") -> None:
        """Before any prompt is built: RateLimitedError (429) when no stream slot is free or the buckets
        cannot pay for ``min_input_tokens`` and one output token, the tenant's or (with ``model``, as the
        request names it) that model's. Charges nothing; a Redis outage is left to :meth:`admit` (which
        fails closed or open as configured)."""
        ...

    async def admit(
        self,
        tenant_id: str,
        policy: TenantPolicy,
        request_id: str,
        num_input_tokens: int,
        num_output_tokens: int,
        *,
        model: str = "",
    ) -> Admission:
        """Charge the prompt and reserve ``num_output_tokens`` on the tenant's limits and on ``model``'s
        (its entry in ``policy.model_quotas``, if any); RateLimitedError (429) when over either (then
        nothing stays charged), BackendUnavailableError (503) when the quota cannot be checked."""
        ...

    async def settle(self, admission: Admission, num_output_tokens: int, *, served: bool = True) -> None:
        """Refund the unused reservation and free the concurrency slot; a request not ``served`` (it
        failed before its first token) gets its input charge back too. Never raises."""
        ...

    async def free_slot(self, tenant_id: str, request_id: str, model: str = "") -> None:
        """Free a request's concurrency slot (the tenant's, and ``model``'s if the tenant limits it)
        without refunding anything: its gateway died before it could settle (called by the usage
        sweeper). Idempotent; raises BackendUnavailableError."""
        ...
