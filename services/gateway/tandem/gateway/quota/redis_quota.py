"""Token-bucket quotas in Redis, shared by every gateway replica.

Called by the route handlers (admit) and the generation response (settle);
calls Redis through two Lua scripts (``admit.lua``, ``settle.lua``) so that the
check and the charge are one atomic step: N replicas racing for a tenant's last
tokens admit no more than the bucket holds. A request is charged its prompt
tokens plus its whole ``max_tokens`` at admission; settle refunds what was not
generated, also when the client went away half-way. A replica that dies between
the two keeps the reservation charged (it refills within a minute); its
concurrency slot is freed by the usage sweeper of a live replica once the dead
one's liveness key expires (:meth:`RedisQuota.free_slot`), and else expires with
its lease.

Redis keys (prefix ``<prefix>:gw:quota:<tenant>:``): ``in`` and ``out`` buckets
(hash ``tokens``, ``ts``), ``streams`` (zset request id → lease end, ms), and
``admitted:<request id>``, a marker from admission to settlement that makes both
scripts idempotent: the Redis client sends a command again when its connection
broke (:mod:`tandem.common.redis_retry`), and a retried admission is charged once
and a retried settlement refunds once.

Per model and adapter: a tenant's ``model_quotas`` give a model (as requests name it: a base model
or a LoRA adapter) limits of its own, kept in the same four keys under
``<prefix>:gw:quota:<tenant>:model:<sha256 of the name, 16 hex>:`` and charged by the same scripts
after the tenant's own; a request refused there gets the tenant's charge back at once (both or
neither stay charged). The model's keys are the tenant's, deleted with it. A dead replica's model
slots are freed by :meth:`RedisQuota.free_slot` too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
from importlib import resources
from typing import Any

import redis.asyncio as aioredis

from tandem.common.errors import BackendUnavailableError
from tandem.gateway.errors import RateLimitedError
from tandem.gateway.quota.base import Admission
from tandem.gateway.redis_client import redis_errors
from tandem.gateway.tenancy.models import TenantPolicy

logger = logging.getLogger(__name__)

_UNLIMITED = -1


def _script(name: str) -> str:
    return resources.files("tandem.gateway.quota").joinpath(name).read_text()


def format_reset(seconds: float) -> str:
    """OpenAI's reset format: ``250ms``, ``12s``, ``6m0s``."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    whole = math.ceil(seconds)
    return f"{whole // 60}m{whole % 60}s" if whole >= 60 else f"{whole}s"


def ratelimit_headers(policy: TenantPolicy, input_left: int, output_left: int, streams_in_use: int) -> dict[str, str]:
    headers: dict[str, str] = {}
    limits: list[tuple[str, int, int]] = []
    if policy.input_tokens_per_minute is not None:
        limits.append(("input-tokens", policy.input_tokens_per_minute, max(0, input_left)))
    if policy.output_tokens_per_minute is not None:
        limits.append(("output-tokens", policy.output_tokens_per_minute, max(0, output_left)))
    for name, cap, left in limits:
        headers[f"x-ratelimit-limit-{name}"] = str(cap)
        headers[f"x-ratelimit-remaining-{name}"] = str(left)
        headers[f"x-ratelimit-reset-{name}"] = format_reset((cap - left) * 60 / cap)
    if limits:
        headers["x-ratelimit-limit-tokens"] = str(sum(cap for _, cap, _ in limits))
        headers["x-ratelimit-remaining-tokens"] = str(sum(left for _, _, left in limits))
        headers["x-ratelimit-reset-tokens"] = format_reset(max((cap - left) * 60 / cap for _, cap, left in limits))
    if policy.max_concurrent_streams is not None:
        headers["x-ratelimit-limit-streams"] = str(policy.max_concurrent_streams)
        headers["x-ratelimit-remaining-streams"] = str(max(0, policy.max_concurrent_streams - streams_in_use))
    return headers


def _limit(value: int | None) -> int:
    return _UNLIMITED if value is None else value


def model_scope(tenant_id: str, model: str) -> str:
    """The quota keys' middle part for ``model``'s limits of ``tenant_id`` (tenant ids hold no ``:``)."""
    return f"{tenant_id}:model:{hashlib.sha256(model.encode()).hexdigest()[:16]}"


class RedisQuota:
    def __init__(self, client: aioredis.Redis, *, key_prefix: str, lease_s: float, fail_open: bool = False) -> None:
        self._redis = client
        self._p = f"{key_prefix}:gw:quota"
        self._lease_ms = int(lease_s * 1000)
        self._fail_open = fail_open
        self._admit: Any = client.register_script(_script("admit.lua"))
        self._settle: Any = client.register_script(_script("settle.lua"))
        self._peek: Any = client.register_script(_script("peek.lua"))

    def _keys(self, tenant_id: str) -> tuple[str, str, str]:
        base = f"{self._p}:{tenant_id}"
        return f"{base}:in", f"{base}:out", f"{base}:streams"

    def _marker(self, tenant_id: str, request_id: str) -> str:
        return f"{self._p}:{tenant_id}:admitted:{request_id}"

    @staticmethod
    def unlimited(policy: TenantPolicy) -> bool:
        return (
            policy.input_tokens_per_minute is None
            and policy.output_tokens_per_minute is None
            and policy.max_concurrent_streams is None
        )

    async def precheck(self, tenant_id: str, policy: TenantPolicy, min_input_tokens: int, *, model: str = "") -> None:
        await self._precheck_one(tenant_id, policy, min_input_tokens)
        model_policy = policy.model_policy(model)
        if model_policy is not None:
            await self._precheck_one(model_scope(tenant_id, model), model_policy, min_input_tokens, model=model)

    async def _precheck_one(
        self, tenant_id: str, policy: TenantPolicy, min_input_tokens: int, *, model: str = ""
    ) -> None:
        if self.unlimited(policy):
            return
        in_key, out_key, streams_key = self._keys(tenant_id)
        args = [
            _limit(policy.input_tokens_per_minute),
            _limit(policy.output_tokens_per_minute),
            min_input_tokens,
            _limit(policy.max_concurrent_streams),
        ]
        try:
            with redis_errors("quota precheck"):
                reply = await self._peek(keys=[in_key, out_key, streams_key], args=args)
        except BackendUnavailableError:
            return  # admit decides, with the configured fail mode
        if int(reply[0]):
            return
        input_left, output_left, streams_in_use = map(int, reply[3:])
        headers = ratelimit_headers(policy, input_left, output_left, streams_in_use)
        raise _rate_limited(str(reply[1]), int(reply[2]) / 1000, policy, min_input_tokens, 1, headers, model=model)

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
        admission = await self._admit_one(tenant_id, policy, request_id, num_input_tokens, num_output_tokens)
        model_policy = policy.model_policy(model)
        if model_policy is None:
            return admission
        scope = model_scope(tenant_id, model)
        try:
            part = await self._admit_one(
                scope, model_policy, request_id, num_input_tokens, num_output_tokens, model=model
            )
        except BaseException:
            await self.settle(admission, 0, served=False)  # refused on the model's limits: nothing stays charged
            raise
        return dataclasses.replace(admission, model_part=part)

    async def _admit_one(
        self,
        tenant_id: str,
        policy: TenantPolicy,
        request_id: str,
        num_input_tokens: int,
        num_output_tokens: int,
        *,
        model: str = "",
    ) -> Admission:
        admission = Admission(tenant_id, request_id, num_input_tokens, num_output_tokens, policy)
        if self.unlimited(policy):
            # Nothing to charge. The request is still billed: its usage record, opened next, is what
            # turns it away when Redis refuses writes.
            return Admission(tenant_id, request_id, num_input_tokens, num_output_tokens, policy, charged=False)
        args = [
            _limit(policy.input_tokens_per_minute),
            _limit(policy.output_tokens_per_minute),
            num_input_tokens,
            num_output_tokens,
            _limit(policy.max_concurrent_streams),
            request_id,
            self._lease_ms,
        ]
        try:
            with redis_errors("quota admission"):
                reply = await self._admit(keys=[*self._keys(tenant_id), self._marker(tenant_id, request_id)], args=args)
        except BackendUnavailableError:
            if self._fail_open:
                logger.warning("quota unchecked: redis down and fail_mode=open", extra={"tenant": tenant_id})
                return Admission(tenant_id, request_id, num_input_tokens, num_output_tokens, policy, charged=False)
            raise
        ok, reason, wait_ms, input_left, output_left, streams_in_use = (
            int(reply[0]),
            str(reply[1]),
            *map(int, reply[2:]),
        )
        headers = ratelimit_headers(policy, input_left, output_left, streams_in_use)
        if ok:
            return Admission(
                admission.tenant_id,
                request_id,
                num_input_tokens,
                num_output_tokens,
                policy,
                headers=headers,
            )
        raise _rate_limited(reason, wait_ms / 1000, policy, num_input_tokens, num_output_tokens, headers, model=model)

    async def settle(self, admission: Admission, num_output_tokens: int, *, served: bool = True) -> None:
        await self._settle_one(admission, num_output_tokens, served=served)
        if admission.model_part is not None:
            await self._settle_one(admission.model_part, num_output_tokens, served=served)

    async def _settle_one(self, admission: Admission, num_output_tokens: int, *, served: bool) -> None:
        if not admission.charged:
            return
        refund = max(0, admission.num_reserved_output_tokens - num_output_tokens)
        input_refund = 0 if served else admission.num_input_tokens
        in_key, out_key, streams_key = self._keys(admission.tenant_id)
        try:
            with redis_errors("quota settle"):
                await self._settle(
                    keys=[out_key, streams_key, self._marker(admission.tenant_id, admission.request_id), in_key],
                    args=[
                        _limit(admission.policy.output_tokens_per_minute),
                        refund,
                        admission.request_id,
                        _limit(admission.policy.input_tokens_per_minute),
                        input_refund,
                    ],
                )
        except BackendUnavailableError as exc:
            # The slot's lease expires by itself; the unrefunded tokens refill within a minute.
            logger.warning("quota settle failed: %s", exc, extra={"request_id": admission.request_id})

    async def free_slot(self, tenant_id: str, request_id: str, model: str = "") -> None:
        # With ``model``, its slot too: the tenant may have limited it (an absent key is no harm).
        scopes = [tenant_id, model_scope(tenant_id, model)] if model else [tenant_id]
        with redis_errors("quota free slot"):
            async with self._redis.pipeline(transaction=True) as pipe:
                for scope in scopes:
                    pipe.zrem(self._keys(scope)[2], request_id)
                    pipe.delete(self._marker(scope, request_id))  # a late settle refunds nothing
                await pipe.execute()


def _rate_limited(
    reason: str,
    wait_s: float,
    policy: TenantPolicy,
    num_input_tokens: int,
    num_output_tokens: int,
    headers: dict[str, str],
    *,
    model: str = "",
) -> RateLimitedError:
    """The 429 of a refusal on the tenant's limits, or (``model``) on that model's own."""
    error = _rate_limited_error(reason, wait_s, policy, num_input_tokens, num_output_tokens, headers)
    if not model:
        return error
    message = f"For the model `{model}`: {error.args[0] if error.args else error}"
    return RateLimitedError(message, kind=error.kind, retry_after_s=error.retry_after_s, headers=error.headers)


def _rate_limited_error(
    reason: str,
    wait_s: float,
    policy: TenantPolicy,
    num_input_tokens: int,
    num_output_tokens: int,
    headers: dict[str, str],
) -> RateLimitedError:
    retry_after_s = max(1, math.ceil(wait_s))
    if reason == "streams":
        message = (
            f"Concurrency limit reached: {policy.max_concurrent_streams} requests at a time. "
            f"Please try again in {retry_after_s}s."
        )
        return RateLimitedError(message, kind="requests", retry_after_s=retry_after_s, headers=headers)
    if reason.endswith("_too_large"):
        which = "input" if reason.startswith("input") else "output"
        cap = policy.input_tokens_per_minute if which == "input" else policy.output_tokens_per_minute
        asked = num_input_tokens if which == "input" else num_output_tokens
        message = (
            f"Request too large: {asked} {which} tokens requested, the limit is {cap} {which} tokens per minute. "
            "Reduce the prompt or max_tokens."
        )
        return RateLimitedError(message, kind="tokens", retry_after_s=60, headers=headers)
    which = "input" if reason == "input_tokens" else "output"
    cap = policy.input_tokens_per_minute if which == "input" else policy.output_tokens_per_minute
    message = (
        f"Rate limit reached for {which} tokens per minute: limit {cap}, requested "
        f"{num_input_tokens if which == 'input' else num_output_tokens}. Please try again in {retry_after_s}s."
    )
    return RateLimitedError(message, kind="tokens", retry_after_s=retry_after_s, headers=headers)
