"""Tenants and API keys in Redis.

Called by the admin CLI (create, list, revoke) and by the authenticator
(:meth:`TenantStore.lookup_key`); calls Redis. Layout under ``<prefix>:gw:``::

    tenants              set of tenant ids
    tenant:<id>          Tenant as JSON
    tenant:<id>:keys     set of key ids
    stored:<id>          the tenant's storage account (tandem.gateway.storage_quota), deleted with it
    keyid:<key id>       the key's SHA-256
    key:<sha256>         ApiKeyRecord as JSON (the lookup of every request)
"""

from __future__ import annotations

import time
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError, WatchError

from tandem.common.errors import BackendUnavailableError
from tandem.gateway.redis_client import redis_errors
from tandem.gateway.tenancy.keys import hash_key, new_api_key
from tandem.gateway.tenancy.models import ApiKeyRecord, Tenant, valid_tenant_id


def tenant_record_key(key_prefix: str, tenant_id: str) -> str:
    """Where the tenant's record (JSON, with its cache salt) lives."""
    return f"{key_prefix}:gw:tenant:{tenant_id}"


def tenant_salt_guard_lua(*, key: str, salt: str, refused: str) -> str:
    """A Lua statement that returns ``refused`` from the script unless the tenant record at ``key`` (a
    Lua expression, '' for no check) still holds the salt ``salt`` (a Lua expression). Writes on a
    tenant's behalf run it first: a tenant deleted (or deleted and created again) since its request
    was admitted, whose key a gateway may still have cached, gets nothing written."""
    return (
        f"if {key} ~= '' then\n"
        f"  local raw = redis.call('GET', {key})\n"
        f"  if not raw or cjson.decode(raw)['salt'] ~= {salt} then\n"
        f"    return {refused}\n"
        "  end\n"
        "end\n"
    )


class TenantError(ValueError):
    """An admin operation that cannot be done (unknown tenant, bad id)."""


class TenantStore:
    def __init__(self, client: aioredis.Redis, *, key_prefix: str) -> None:
        self._redis = client
        self._key_prefix = key_prefix
        self._p = f"{key_prefix}:gw"

    def _k(self, *parts: str) -> str:
        return ":".join((self._p, *parts))

    # -- tenants -------------------------------------------------------------------------------------

    async def put_tenant(self, tenant: Tenant) -> Tenant:
        """Create or replace a tenant."""
        if not valid_tenant_id(tenant.id):
            raise TenantError(f"tenant id {tenant.id!r}: use 1-63 of a-z 0-9 _ -, starting with a letter or digit")
        if not tenant.created_unix_s:
            tenant = tenant.model_copy(update={"created_unix_s": int(time.time())})
        with redis_errors("put tenant"):
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.set(tenant_record_key(self._key_prefix, tenant.id), tenant.model_dump_json())
                pipe.sadd(self._k("tenants"), tenant.id)
                await pipe.execute()
        return tenant

    async def get_tenant(self, tenant_id: str) -> Tenant | None:
        with redis_errors("get tenant"):
            raw = await self._redis.get(tenant_record_key(self._key_prefix, tenant_id))
        return None if raw is None else await self._loaded(raw)

    async def _loaded(self, raw: str | bytes) -> Tenant:
        """A stored tenant; one written before tenants had a salt gets its random salt now, once."""
        tenant = Tenant.model_validate_json(raw)
        if b'"salt"' in (raw if isinstance(raw, bytes) else raw.encode()):
            return tenant
        key = tenant_record_key(self._key_prefix, tenant.id)
        with redis_errors("salt tenant"):
            try:  # only if the record is still the one read: a concurrent writer's salt wins
                async with self._redis.pipeline(transaction=True) as pipe:
                    await pipe.watch(key)
                    if await pipe.get(key) == raw:
                        pipe.multi()  # type: ignore[no-untyped-call]
                        pipe.set(key, tenant.model_dump_json())
                        await pipe.execute()
                        return tenant
            except WatchError:
                pass
            except NoPermissionError as exc:
                # The gateway's Redis user may not write tenants (tandem.common.redis_acl); the admin's may.
                raise BackendUnavailableError(
                    f"tenant {tenant.id!r} predates cache salts and this Redis user may not salt it: "
                    "run `tandem-admin tenant list` once"
                ) from exc
            again = await self._redis.get(key)
        return tenant if again is None else Tenant.model_validate_json(again)

    async def update_tenant(self, tenant_id: str, **changes: Any) -> Tenant:
        tenant = await self.get_tenant(tenant_id)
        if tenant is None:
            raise TenantError(f"no tenant {tenant_id!r}")
        updated = Tenant.model_validate({**tenant.model_dump(), **changes})
        return await self.put_tenant(updated)

    async def list_tenants(self) -> list[Tenant]:
        with redis_errors("list tenants"):
            ids = sorted(str(i) for i in await self._redis.smembers(self._k("tenants")))
            raws = await self._redis.mget([tenant_record_key(self._key_prefix, i) for i in ids]) if ids else []
        return [await self._loaded(raw) for raw in raws if raw is not None]

    async def delete_tenant(self, tenant_id: str) -> int:
        """Remove a tenant, revoke all its keys and delete everything kept for it: conversations,
        usage counters and quota state (``tandem-admin tenant delete`` prints its usage first). A
        tenant created again under the same id starts empty. Returns the number of keys deleted."""
        if not valid_tenant_id(tenant_id):
            raise TenantError(f"tenant id {tenant_id!r} is not a tenant id")
        for record in await self.list_keys(tenant_id):
            await self.revoke_key(record.key_id)
        owned = [f"{self._p}:{space}:{tenant_id}:*" for space in ("conv", "usage", "quota")]
        with redis_errors("delete tenant"):
            doomed = [
                tenant_record_key(self._key_prefix, tenant_id),
                self._k("tenant", tenant_id, "keys"),
                self._k("usage", tenant_id),
                self._k("conv", tenant_id),  # the index of its conversations
                self._k("stored", tenant_id),  # its storage account (tandem.gateway.storage_quota)
            ]
            for pattern in owned:  # tenant ids hold no glob characters: the pattern is this tenant's alone
                doomed += [str(k) async for k in self._redis.scan_iter(match=pattern, count=1000)]
            async with self._redis.pipeline(transaction=True) as pipe:
                for i in range(0, len(doomed), 500):
                    pipe.delete(*doomed[i : i + 500])
                pipe.srem(self._k("tenants"), tenant_id)
                pipe.srem(self._k("usage", "_tenants"), tenant_id)
                results = await pipe.execute()
        return int(sum(results[:-2]))

    # -- keys ----------------------------------------------------------------------------------------

    async def create_key(self, tenant_id: str, *, label: str = "") -> tuple[ApiKeyRecord, str]:
        """A new key for the tenant: the record and the key itself (shown once, never stored)."""
        if await self.get_tenant(tenant_id) is None:
            raise TenantError(f"no tenant {tenant_id!r}")
        key_id, key = new_api_key()
        record = ApiKeyRecord(key_id=key_id, tenant_id=tenant_id, label=label, created_unix_s=int(time.time()))
        digest = hash_key(key)
        with redis_errors("create key"):
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.set(self._k("key", digest), record.model_dump_json())
                pipe.set(self._k("keyid", key_id), digest)
                pipe.sadd(self._k("tenant", tenant_id, "keys"), key_id)
                await pipe.execute()
        return record, key

    async def list_keys(self, tenant_id: str) -> list[ApiKeyRecord]:
        with redis_errors("list keys"):
            key_ids = sorted(str(k) for k in await self._redis.smembers(self._k("tenant", tenant_id, "keys")))
            digests = await self._redis.mget([self._k("keyid", k) for k in key_ids]) if key_ids else []
            raws = await self._redis.mget([self._k("key", str(d)) for d in digests if d]) if any(digests) else []
        return [ApiKeyRecord.model_validate_json(raw) for raw in raws if raw is not None]

    async def revoke_key(self, key_id: str) -> ApiKeyRecord:
        with redis_errors("revoke key"):
            digest = await self._redis.get(self._k("keyid", key_id))
            raw = await self._redis.get(self._k("key", str(digest))) if digest else None
            if digest is None or raw is None:
                raise TenantError(f"no key {key_id!r}")
            record = ApiKeyRecord.model_validate_json(raw).model_copy(update={"revoked": True})
            await self._redis.set(self._k("key", str(digest)), record.model_dump_json())
        return record

    async def lookup_key(self, key: str) -> tuple[ApiKeyRecord, Tenant] | None:
        """The key's record and tenant, or None for an unknown key (revoked ones are returned, flagged)."""
        with redis_errors("key lookup"):
            raw = await self._redis.get(self._k("key", hash_key(key)))
            if raw is None:
                return None
            record = ApiKeyRecord.model_validate_json(raw)
            tenant_raw = await self._redis.get(tenant_record_key(self._key_prefix, record.tenant_id))
        if tenant_raw is None:
            return None
        return record, await self._loaded(tenant_raw)
