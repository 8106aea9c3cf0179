"""Usage accounting per tenant and model, persisted in Redis.

Called once per finished request (also aborted ones, with the tokens that were
actually generated) by the generation response's completion hook, and by the
``/v1/usage`` handlers and the admin CLI to read. Layout: hash
``<prefix>:gw:usage:<tenant>`` with fields ``<model>|<counter>`` (all time) and
``<prefix>:gw:usage:<tenant>:<YYYY-MM-DD>`` (UTC day, kept 400 days).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from tandem.common.errors import BackendUnavailableError
from tandem.gateway.redis_client import redis_errors

logger = logging.getLogger(__name__)

COUNTERS = ("requests", "aborted_requests", "prompt_tokens", "completion_tokens", "cached_tokens")
_DAY_TTL_S = 400 * 24 * 3600


@dataclass(frozen=True)
class UsageRecord:
    tenant_id: str
    model: str
    num_prompt_tokens: int
    num_completion_tokens: int
    num_cached_tokens: int
    aborted: bool


class UsageStore:
    def __init__(self, client: aioredis.Redis, *, key_prefix: str) -> None:
        self._redis = client
        self._p = f"{key_prefix}:gw:usage"

    async def record(self, record: UsageRecord) -> None:
        """Add one request's figures. Logs and drops them when Redis is down (the request already ran)."""
        day = time.strftime("%Y-%m-%d", time.gmtime())
        values = {
            "requests": 1,
            "aborted_requests": int(record.aborted),
            "prompt_tokens": record.num_prompt_tokens,
            "completion_tokens": record.num_completion_tokens,
            "cached_tokens": record.num_cached_tokens,
        }
        try:
            with redis_errors("usage record"):
                async with self._redis.pipeline(transaction=True) as pipe:
                    for key in (f"{self._p}:{record.tenant_id}", f"{self._p}:{record.tenant_id}:{day}"):
                        for name, value in values.items():
                            if value:
                                pipe.hincrby(key, f"{record.model}|{name}", value)
                    pipe.expire(f"{self._p}:{record.tenant_id}:{day}", _DAY_TTL_S)
                    pipe.sadd(f"{self._p}:tenants", record.tenant_id)
                    await pipe.execute()
        except BackendUnavailableError as exc:
            logger.warning("usage not recorded: %s", exc, extra={"tenant": record.tenant_id, **values})

    async def tenant_usage(self, tenant_id: str, *, day: str | None = None) -> dict[str, Any]:
        """``{"tenant": id, "period": "all"|day, "data": [{"model", counters…}], "total": {counters…}}``."""
        key = f"{self._p}:{tenant_id}" + (f":{day}" if day else "")
        with redis_errors("usage read"):
            raw = await self._redis.hgetall(key)
        per_model: dict[str, dict[str, int]] = {}
        for field, value in raw.items():
            model, _, counter = str(field).rpartition("|")
            if counter in COUNTERS:
                per_model.setdefault(model, dict.fromkeys(COUNTERS, 0))[counter] = int(value)
        total = {name: sum(m[name] for m in per_model.values()) for name in COUNTERS}
        return {
            "object": "usage",
            "tenant": tenant_id,
            "period": day or "all",
            "data": [{"model": model, **counts} for model, counts in sorted(per_model.items())],
            "total": total,
        }

    async def tenants(self) -> list[str]:
        with redis_errors("usage tenants"):
            return sorted(str(t) for t in await self._redis.smembers(f"{self._p}:tenants"))
