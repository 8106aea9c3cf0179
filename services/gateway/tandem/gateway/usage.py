"""Usage accounting per tenant and model, persisted in Redis.

Called once per finished request (also aborted ones, with the tokens that were
actually generated) by the generation response's completion hook, and by the
``/v1/usage`` handlers and the admin CLI to read. Layout: hash
``<prefix>:gw:usage:<tenant>`` with fields ``<model>|<counter>`` (all time) and
``<prefix>:gw:usage:<tenant>:<YYYY-MM-DD>`` (UTC day, kept 400 days). The keys of the store
itself start with ``_`` (``_tenants``, ``_recorded:<request id>``), which no tenant id can: a
tenant named ``tenants`` once shared the set's key and broke every usage write.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from tandem.common.backoff import backoff_delays
from tandem.common.errors import BackendUnavailableError
from tandem.gateway.redis_client import redis_errors

logger = logging.getLogger(__name__)

COUNTERS = ("requests", "aborted_requests", "prompt_tokens", "completion_tokens", "cached_tokens")
_DAY_TTL_S = 400 * 24 * 3600
#: How long a request id stays marked as recorded (retries come within seconds).
_RECORDED_MARKER_TTL_S = 3600


@dataclass(frozen=True)
class UsageRecord:
    tenant_id: str
    model: str
    num_prompt_tokens: int
    num_completion_tokens: int
    num_cached_tokens: int
    aborted: bool
    #: Makes :meth:`UsageStore.record` idempotent across retries ("": no marker).
    request_id: str = ""


#: Adds one request's counters to both hashes, once: a retry after a lost reply finds the marker and
#: adds nothing. KEYS: all-time hash, day hash, tenants set, marker ('' for none). ARGV: model, day TTL,
#: marker TTL, tenant id, then counter name / value pairs.
_RECORD_ONCE = """
if KEYS[4] ~= '' and redis.call('SET', KEYS[4], '1', 'NX', 'EX', ARGV[3]) == false then
  return 0
end
for i = 5, #ARGV, 2 do
  local field = ARGV[1] .. '|' .. ARGV[i]
  redis.call('HINCRBY', KEYS[1], field, ARGV[i + 1])
  redis.call('HINCRBY', KEYS[2], field, ARGV[i + 1])
end
redis.call('EXPIRE', KEYS[2], ARGV[2])
redis.call('SADD', KEYS[3], ARGV[4])
return 1
"""


class UsageStore:
    """Usage counters in Redis.

    :meth:`record` survives a Redis outage of up to ``retry_for_s``: it keeps retrying (it runs after
    the response, off the request path), and a request id makes the retry idempotent, so a write whose
    reply was lost is not counted twice.
    """

    def __init__(self, client: aioredis.Redis, *, key_prefix: str, retry_for_s: float = 60.0) -> None:
        self._redis = client
        self._p = f"{key_prefix}:gw:usage"
        self._retry_for_s = retry_for_s

    async def record(self, record: UsageRecord) -> None:
        """Add one request's figures; retries while Redis is down, then logs and drops them."""
        day = time.strftime("%Y-%m-%d", time.gmtime())
        values = {
            "requests": 1,
            "aborted_requests": int(record.aborted),
            "prompt_tokens": record.num_prompt_tokens,
            "completion_tokens": record.num_completion_tokens,
            "cached_tokens": record.num_cached_tokens,
        }
        keys = [
            f"{self._p}:{record.tenant_id}",
            f"{self._p}:{record.tenant_id}:{day}",
            f"{self._p}:_tenants",
            f"{self._p}:_recorded:{record.request_id}" if record.request_id else "",
        ]
        args: list[str | int] = [record.model, _DAY_TTL_S, _RECORDED_MARKER_TTL_S, record.tenant_id]
        for name, value in values.items():
            if value:
                args += [name, value]
        delays = backoff_delays(within_s=self._retry_for_s, max_s=5.0)
        while True:
            try:
                with redis_errors("usage record"):
                    await self._redis.eval(_RECORD_ONCE, len(keys), *keys, *args)
                return
            except BackendUnavailableError as exc:
                delay_s = next(delays, None)
                if delay_s is None:
                    logger.warning("usage not recorded: %s", exc, extra={"tenant": record.tenant_id, **values})
                    return
                await asyncio.sleep(delay_s)

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
            return sorted(str(t) for t in await self._redis.smembers(f"{self._p}:_tenants"))
