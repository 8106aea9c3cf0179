"""Each tenant's storage quota: a byte account of what the gateway keeps in Redis on its behalf.

One tenant must not be able to fill the shared Redis (at ``maxmemory`` every tenant's requests get 503),
so what a tenant stores is bounded in bytes, per tenant (docs/tenancy.md, "Storage quota"). Today the
only such store is :mod:`tandem.gateway.conversations`; a later one (say Responses API chains) plugs in
the same way:

* its Lua scripts, which alone write and delete its items, keep the account with the functions of
  :data:`ACCOUNT_LUA` (an item's bytes are set whenever the item changes, and set to 0 when it is
  deleted, evicted or found expired), so that the account is exact after every script;
* it frees room in the tenant's account before it refuses anything (its least recently used items
  go first), and a write never leaves the account above the tenant's limit;
* before a request that will store something is admitted, the caller checks with
  :meth:`StorageQuota.check` that what the request would leave in its item fits the limit at all, so
  that a request that can never be stored is refused (413 ``storage_quota_exceeded``) before any token
  is generated and before anything is charged.

Layout: the hash ``<prefix>:gw:stored:<tenant>``: ``total`` (bytes), and one field per item,
``<store>:<item id>`` (``conv:<conversation id>``) → its bytes. Item names hold a ``:``, so none is
``total``. The hash lives as long as its longest-lived item (each script extends it, :func:`stored_keep`).

What a byte is: the length of what is stored (a turn's JSON) plus a fixed overhead per entry and per
item (:data:`ENTRY_OVERHEAD_BYTES`, :data:`ITEM_OVERHEAD_BYTES`), so that many tiny entries cannot hide
Redis's own per-entry cost; measured against Redis's ``MEMORY USAGE`` in
``tests/unit/gateway/test_storage_quota.py`` (within ±25% from 40-byte to 50 KB turns; the rest is the
allocator's size classes).
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.gateway.errors import StorageQuotaExceededError
from tandem.gateway.tenancy.models import TenantPolicy

#: ``tenancy.default_max_stored_bytes_per_tenant``'s default.
DEFAULT_MAX_STORED_BYTES = 16 * 1024 * 1024
#: Counted for each stored entry (a conversation turn) on top of its own bytes: Redis's list node and
#: allocator overhead, ~3 to ~150 bytes an entry (measured with MEMORY USAGE on Redis 7.0).
ENTRY_OVERHEAD_BYTES = 16
#: Counted once per stored item (a conversation): its key, its index entry and its account field.
ITEM_OVERHEAD_BYTES = 256


def account_key(key_prefix: str, tenant_id: str) -> str:
    """The tenant's byte account (a hash: ``total`` and one field per stored item)."""
    return f"{key_prefix}:gw:stored:{tenant_id}"


#: Lua functions for every script that writes or deletes a tenant's stored items (prepend to the script).
#: ``stored_set(account, item, num_bytes)``: the item now holds ``num_bytes`` (0: it is gone); returns
#: the new total. ``stored_total(account)``. ``stored_keep(account, ttl_s)``: the account lives at least
#: ``ttl_s`` more (as long as the item just written).
ACCOUNT_LUA = """
local function stored_set(account, item, num_bytes)
  local old = tonumber(redis.call('HGET', account, item) or 0)
  if num_bytes > 0 then
    redis.call('HSET', account, item, num_bytes)
  elseif old > 0 then
    redis.call('HDEL', account, item)
  end
  if num_bytes == old then
    return tonumber(redis.call('HGET', account, 'total') or 0)
  end
  return redis.call('HINCRBY', account, 'total', num_bytes - old)
end
local function stored_total(account)
  return tonumber(redis.call('HGET', account, 'total') or 0)
end
local function stored_keep(account, ttl_s)
  if redis.call('TTL', account) < ttl_s then
    redis.call('EXPIRE', account, ttl_s)
  end
end
"""


@dataclass(frozen=True)
class StorageQuota:
    """Each tenant's limit: its policy's ``max_stored_bytes``, else the gateway's default. Built once by
    :func:`tandem.gateway.app.build_app`; used by the request preparation (:meth:`check`) and by the
    stores' writes (:meth:`limit_bytes`)."""

    #: ``tenancy.default_max_stored_bytes_per_tenant``.
    default_max_stored_bytes: int

    def limit_bytes(self, tenant: TenantPolicy) -> int:
        if tenant.max_stored_bytes is not None:
            return tenant.max_stored_bytes
        return self.default_max_stored_bytes

    def check(self, tenant: TenantPolicy, num_item_bytes: int, *, what: str, param: str) -> None:
        """Refuse a request that would leave ``num_item_bytes`` in one stored item (``what``, for the
        message) when that alone is over the tenant's limit: no eviction of other items could make
        room. Raises :class:`StorageQuotaExceededError`."""
        limit = self.limit_bytes(tenant)
        if num_item_bytes <= limit:
            return
        raise StorageQuotaExceededError(
            f"{what} would hold about {num_item_bytes} bytes after this request, more than this tenant "
            f"may store ({limit} bytes), even with all its other conversations forgotten. Start a new "
            "conversation (another conversation_id), send less text or a lower max_tokens, or ask the "
            "operator for a larger storage quota.",
            param=param,
        )
