"""Usage accounting per tenant and model, persisted in Redis.

Called once per finished request (also aborted ones, with the tokens that were
actually generated) by the generation response's completion hook, and by the
``/v1/usage`` handlers and the admin CLI to read. Layout: hash
``<prefix>:gw:usage:<tenant>`` with fields ``<model>|<counter>`` (all time) and
``<prefix>:gw:usage:<tenant>:<YYYY-MM-DD>`` (UTC day, kept 400 days). ``<model>`` is the request's
``model`` as the client named it: a base model, or a LoRA adapter's name, which also gets the field
``<adapter>|base_model`` (its base model's name, written with every record, so a reader can add an
adapter's usage to its base model's: ``by_base_model`` in :meth:`UsageStore.tenant_usage`). The keys of the store
itself start with ``_`` (``_tenants``, ``_recorded:<request id>``), which no tenant id can: a
tenant named ``tenants`` once shared the set's key and broke every usage write.

Open records, so that a gateway that dies mid-request does not lose what it served. At admission
:meth:`UsageStore.open` writes the request's figures (hash ``_open:<request id>``, its id in the set
``_open_by:<replica>``, the replica in ``_replicas``); while the answer streams, :meth:`progress` writes
the number of generated tokens *before* they go to the client, so the record never holds fewer tokens
than the client got; :meth:`record` adds the final figures and deletes the open record in one step.
Each replica renews ``_alive:<replica>`` (:class:`tandem.gateway.usage_sweeper.UsageSweeper`); the
open records of a replica whose key expired (it was killed) are settled by any other replica, or by
its own successor, with the figures they last held (:meth:`settle_orphans`).
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
from tandem.gateway.tenancy.store import tenant_record_key, tenant_salt_guard_lua

logger = logging.getLogger(__name__)

COUNTERS = ("requests", "aborted_requests", "prompt_tokens", "completion_tokens", "cached_tokens")
_DAY_TTL_S = 400 * 24 * 3600
#: How long a request id stays marked as recorded (retries come within seconds).
_RECORDED_MARKER_TTL_S = 3600


@dataclass(frozen=True)
class UsageRecord:
    tenant_id: str
    #: As the client named it: a base model, or a LoRA adapter.
    model: str
    num_prompt_tokens: int
    num_completion_tokens: int
    num_cached_tokens: int
    aborted: bool
    #: Makes :meth:`UsageStore.record` idempotent across retries ("": no marker).
    request_id: str = ""
    #: The tenant record's salt when the request was admitted ("": no check, e.g. auth disabled): a
    #: record whose tenant was deleted (or deleted and created again) meanwhile is not added to it.
    tenant_salt: str = ""
    #: The base model that ran ``model`` when it is a LoRA adapter; "" (or ``model`` itself) for a base model.
    base_model: str = ""

    @property
    def adapter_base_model(self) -> str:
        """The base model to note beside ``model`` ("" when ``model`` is itself a base model)."""
        return self.base_model if self.base_model and self.base_model != self.model else ""


@dataclass(frozen=True)
class Orphan:
    """An open record of a dead replica, settled by :meth:`UsageStore.settle_orphans`."""

    request_id: str
    tenant_id: str
    #: As the client named it (its quota slot may be the model's too: tandem.gateway.quota).
    model: str = ""


#: Adds one request's counters to both hashes, once: a retry after a lost reply finds the marker and
#: adds nothing. KEYS: all-time hash, day hash, tenants set, marker ('' for none), open record, the open
#: records' set of its replica (both '' for none). ARGV: model, day TTL, marker TTL, tenant id, request
#: id, the tenant's salt, the tenant's record ('' for no check; an ARGV because the gateway's Redis user
#: may only read it, and a script's KEYS need write rights: tandem.common.redis_acl), an adapter's base
#: model ('' for a base model), then counter name / value pairs. A tenant deleted (or deleted and
#: created again) since the request was admitted gets nothing: its cached key may serve for
#: ``auth.cache_s`` after the deletion, and must not bring its usage back.
_RECORD_ONCE = (
    """
if KEYS[5] ~= '' then
  redis.call('DEL', KEYS[5])
  redis.call('SREM', KEYS[6], ARGV[5])
end
"""
    + tenant_salt_guard_lua(key="ARGV[7]", salt="ARGV[6]", refused="0")
    + """if KEYS[4] ~= '' and redis.call('SET', KEYS[4], '1', 'NX', 'EX', ARGV[3]) == false then
  return 0
end
for i = 9, #ARGV, 2 do
  local field = ARGV[1] .. '|' .. ARGV[i]
  redis.call('HINCRBY', KEYS[1], field, ARGV[i + 1])
  redis.call('HINCRBY', KEYS[2], field, ARGV[i + 1])
end
if ARGV[8] ~= '' then
  redis.call('HSET', KEYS[1], ARGV[1] .. '|base_model', ARGV[8])
  redis.call('HSET', KEYS[2], ARGV[1] .. '|base_model', ARGV[8])
end
redis.call('EXPIRE', KEYS[2], ARGV[2])
redis.call('SADD', KEYS[3], ARGV[4])
return 1
"""
)


#: Opens a request's record. KEYS: open record, its replica's set, the replicas set. ARGV: request id,
#: replica, record TTL (s), then field / value pairs. ``#!lua``: a Redis that refuses writes refuses it.
_OPEN = """#!lua
redis.call('HSET', KEYS[1], 'replica', ARGV[2], unpack(ARGV, 4))
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('SADD', KEYS[3], ARGV[2])
return 1
"""

#: Moves an open record's token count forward (never back; a settled record stays settled).
_PROGRESS = """#!lua
local current = redis.call('HGET', KEYS[1], 'completion')
if current and tonumber(current) < tonumber(ARGV[1]) then
  redis.call('HSET', KEYS[1], 'completion', ARGV[1])
end
return 1
"""

#: How long an open record may outlive its request (a safety net: records are settled in seconds).
OPEN_RECORD_TTL_S = 7 * 24 * 3600


class UsageStore:
    """Usage counters in Redis.

    :meth:`record` survives a Redis outage of up to ``retry_for_s``: it keeps retrying (it runs after
    the response, off the request path), and a request id makes the retry idempotent, so a write whose
    reply was lost is not counted twice.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        key_prefix: str,
        retry_for_s: float = 60.0,
        replica_id: str = "",
        fail_open: bool = False,
    ) -> None:
        self._redis = client
        self._gw = f"{key_prefix}:gw"
        self._p = f"{self._gw}:usage"
        self._retry_for_s = retry_for_s
        #: This gateway process, owner of the records it opens ('' in tools that only read or record).
        self.replica_id = replica_id
        self._fail_open = fail_open
        self._open: Any = client.register_script(_OPEN)
        self._progress: Any = client.register_script(_PROGRESS)
        self._record_once: Any = client.register_script(_RECORD_ONCE)
        self._key_prefix = key_prefix

    def _open_key(self, request_id: str) -> str:
        return f"{self._p}:_open:{request_id}"

    def _open_by_key(self, replica_id: str) -> str:
        return f"{self._p}:_open_by:{replica_id}"

    def alive_key(self, replica_id: str) -> str:
        return f"{self._p}:_alive:{replica_id}"

    @property
    def replicas_key(self) -> str:
        return f"{self._p}:_replicas"

    async def open(self, record: UsageRecord) -> bool:
        """Write ``record`` (its prompt figures, no completion yet) as this replica's open record; True
        once written. BackendUnavailableError when Redis cannot take it (down, or refusing writes): a
        request that could not be billed is not served — unless the gateway runs with fail_mode=open,
        where it is served unrecorded-until-the-end (False)."""
        if not self.replica_id or not record.request_id:
            raise ValueError("an open record needs a replica id and a request id")
        fields: dict[str, str | int] = {
            "tenant": record.tenant_id,
            "model": record.model,
            "prompt": record.num_prompt_tokens,
            "cached": record.num_cached_tokens,
            "completion": record.num_completion_tokens,
            "salt": record.tenant_salt,
            "base_model": record.adapter_base_model,
        }
        args: list[str | int] = [record.request_id, self.replica_id, OPEN_RECORD_TTL_S]
        for name, value in fields.items():
            args += [name, value]
        keys = [self._open_key(record.request_id), self._open_by_key(self.replica_id), self.replicas_key]
        try:
            with redis_errors("usage open"):
                await self._open(keys=keys, args=args)
        except BackendUnavailableError:
            if not self._fail_open:
                raise
            logger.warning("usage record not opened: redis down and fail_mode=open", extra={"tenant": record.tenant_id})
            return False
        return True

    async def progress(self, request_id: str, num_completion_tokens: int) -> None:
        """Raise the open record's token count to ``num_completion_tokens`` (raises BackendUnavailableError)."""
        with redis_errors("usage progress"):
            await self._progress(keys=[self._open_key(request_id)], args=[num_completion_tokens])

    async def discard(self, request_id: str) -> None:
        """Close an open record without billing it (the request failed before its first token). Never
        raises: a record left open is settled as an aborted request with 0 tokens once this replica is gone."""
        try:
            with redis_errors("usage discard"):
                await self._close_open(request_id, self.replica_id)
        except BackendUnavailableError as exc:
            logger.warning("open usage record not discarded: %s", exc, extra={"request_id": request_id})

    async def _close_open(self, request_id: str, replica_id: str) -> None:
        """Delete an open record and its entry in its replica's set, unbilled (raises redis errors)."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._open_key(request_id))
            pipe.srem(self._open_by_key(replica_id), request_id)
            await pipe.execute()

    async def renew_liveness(self, ttl_s: float) -> None:
        """Mark this replica alive for ``ttl_s`` (its open records are not anyone else's to settle)."""
        with redis_errors("usage liveness"):
            await self._redis.set(self.alive_key(self.replica_id), "1", px=int(ttl_s * 1000))

    async def drop_liveness(self) -> None:
        with redis_errors("usage liveness"):
            await self._redis.delete(self.alive_key(self.replica_id))

    async def settle_orphans(self) -> list[Orphan]:
        """Record the open records of every replica whose liveness key expired (it died mid-request),
        with the figures they last held; returns every orphan found (billed, or dropped for having no
        token), for the caller to free what else the dead replica held for them (quota slot, router
        reservation). Safe to run on every replica at once: each record is counted once
        (its request id marks it recorded)."""
        with redis_errors("usage orphans"):
            replicas = await self._redis.smembers(self.replicas_key)
        orphans: list[Orphan] = []
        for replica in sorted(str(r) for r in replicas):
            if replica == self.replica_id:
                continue
            with redis_errors("usage orphans"):
                if await self._redis.exists(self.alive_key(replica)):
                    continue
                request_ids = await self._redis.smembers(self._open_by_key(replica))
            for request_id in sorted(str(r) for r in request_ids):
                with redis_errors("usage orphans"):
                    fields = await self._redis.hgetall(self._open_key(request_id))
                    if fields:
                        orphans.append(Orphan(request_id, str(fields.get("tenant", "")), str(fields.get("model", ""))))
                    if not fields or not int(fields.get("completion", 0)):
                        # Settled meanwhile, or died before its first token: that costs nothing.
                        await self._close_open(request_id, replica)
                        continue
                record = UsageRecord(
                    tenant_id=str(fields["tenant"]),
                    model=str(fields["model"]),
                    num_prompt_tokens=int(fields["prompt"]),
                    num_completion_tokens=int(fields["completion"]),
                    num_cached_tokens=int(fields["cached"]),
                    aborted=True,
                    request_id=request_id,
                    tenant_salt=str(fields.get("salt", "")),
                    base_model=str(fields.get("base_model", "")),
                )
                await self._write(record, replica_id=replica)
                logger.warning(
                    "usage of a request of a dead gateway replica settled",
                    extra={"request_id": request_id, "replica": replica, "tenant": record.tenant_id},
                )
            with redis_errors("usage orphans"):
                if not await self._redis.scard(self._open_by_key(replica)):
                    await self._redis.srem(self.replicas_key, replica)
        return orphans

    async def record(self, record: UsageRecord) -> None:
        """Add one request's figures (and close its open record); retries while Redis is down, then logs
        and drops them (the open record, if any, is then settled once this replica is gone)."""
        delays = backoff_delays(within_s=self._retry_for_s, max_s=5.0)
        while True:
            try:
                await self._write(record, replica_id=self.replica_id)
                return
            except BackendUnavailableError as exc:
                delay_s = next(delays, None)
                if delay_s is None:
                    logger.warning(
                        "usage not recorded: %s",
                        exc,
                        extra={
                            "tenant": record.tenant_id,
                            "request_id": record.request_id,
                            "prompt_tokens": record.num_prompt_tokens,
                            "completion_tokens": record.num_completion_tokens,
                        },
                    )
                    return
                await asyncio.sleep(delay_s)

    async def _write(self, record: UsageRecord, *, replica_id: str) -> None:
        day = time.strftime("%Y-%m-%d", time.gmtime())
        values = {
            "requests": 1,
            "aborted_requests": int(record.aborted),
            "prompt_tokens": record.num_prompt_tokens,
            "completion_tokens": record.num_completion_tokens,
            "cached_tokens": record.num_cached_tokens,
        }
        has_open = bool(record.request_id and replica_id)
        keys = [
            f"{self._p}:{record.tenant_id}",
            f"{self._p}:{record.tenant_id}:{day}",
            f"{self._p}:_tenants",
            f"{self._p}:_recorded:{record.request_id}" if record.request_id else "",
            self._open_key(record.request_id) if has_open else "",
            self._open_by_key(replica_id) if has_open else "",
        ]
        args: list[str | int] = [
            record.model,
            _DAY_TTL_S,
            _RECORDED_MARKER_TTL_S,
            record.tenant_id,
            record.request_id,
            record.tenant_salt,
            tenant_record_key(self._key_prefix, record.tenant_id) if record.tenant_salt else "",
            record.adapter_base_model,
        ]
        for name, value in values.items():
            if value:
                args += [name, value]
        with redis_errors("usage record"):
            await self._record_once(keys=keys, args=args)

    async def tenant_usage(self, tenant_id: str, *, day: str | None = None) -> dict[str, Any]:
        """``{"tenant": id, "period": "all"|day, "data": [{"model", "base_model", counters…}],
        "by_base_model": [{"model", counters…}], "total": {counters…}}``.

        ``data``: one row per ``model`` the client named (a base model, or a LoRA adapter, whose
        ``base_model`` is the model that ran it; a base model's is itself). ``by_base_model``: the same
        counters added up per base model, adapters included. Each counter of ``total`` is the sum of
        ``data``'s, and of ``by_base_model``'s."""
        key = f"{self._p}:{tenant_id}" + (f":{day}" if day else "")
        with redis_errors("usage read"):
            raw = await self._redis.hgetall(key)
        per_model: dict[str, dict[str, int]] = {}
        base_of: dict[str, str] = {}
        for field, value in raw.items():
            model, _, counter = str(field).rpartition("|")
            if counter in COUNTERS:
                per_model.setdefault(model, dict.fromkeys(COUNTERS, 0))[counter] = int(value)
            elif counter == "base_model":
                base_of[model] = str(value)
        per_base: dict[str, dict[str, int]] = {}
        for model, counts in per_model.items():
            base_counts = per_base.setdefault(base_of.get(model, model), dict.fromkeys(COUNTERS, 0))
            for name in COUNTERS:
                base_counts[name] += counts[name]
        total = {name: sum(m[name] for m in per_model.values()) for name in COUNTERS}
        return {
            "object": "usage",
            "tenant": tenant_id,
            "period": day or "all",
            "data": [
                {"model": model, "base_model": base_of.get(model, model), **counts}
                for model, counts in sorted(per_model.items())
            ],
            "by_base_model": [{"model": model, **counts} for model, counts in sorted(per_base.items())],
            "total": total,
        }

    async def tenants(self) -> list[str]:
        with redis_errors("usage tenants"):
            return sorted(str(t) for t in await self._redis.smembers(f"{self._p}:_tenants"))
