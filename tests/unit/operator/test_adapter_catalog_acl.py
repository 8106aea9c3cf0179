"""The operator's adapter sync (tandem_operator.adapters) against the real Redis on 127.0.0.1:6379, logged in
as a Redis user with only the rights the operator needs (the line proposed for tandem.common.redis_acl's
``operator`` component): it loads, keeps (no version bump) and unloads adapters, and is refused the rest.
Each test makes its own user and key prefix and deletes both after."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError
from tandem_operator.adapters import remove_managed, sync_adapters
from tandem_operator.spec import AdapterSpec

from tandem.common import redis_acl
from tandem.common.adapters import AdapterCatalog
from tandem.common.errors import BackendUnavailableError

REDIS_URL = "redis://127.0.0.1:6379/0"


def operator_rules(p: str) -> list[str]:
    """What the operator's code sends (AdapterCatalog.entries / put / remove; redis-py sends INCR as INCRBY) and
    nothing else."""
    return ["+ping", "+select", "+hgetall", "+hset", "+hdel", "+incrby", f"~{p}:adapters", f"~{p}:adapters:version"]


@pytest_asyncio.fixture
async def as_operator() -> AsyncIterator[tuple[AdapterCatalog, aioredis.Redis, aioredis.Redis, str]]:
    prefix = f"acltest-op-{uuid.uuid4().hex[:8]}"
    user, password = f"{prefix}-operator", uuid.uuid4().hex
    root = aioredis.Redis.from_url(REDIS_URL)
    await root.execute_command("ACL", "SETUSER", user, "reset", "on", f">{password}", "resetchannels",
                               *operator_rules(prefix))
    client = aioredis.Redis.from_url(f"redis://{user}:{password}@127.0.0.1:6379/0")
    yield AdapterCatalog(client, key_prefix=prefix), client, root, prefix
    await client.aclose()
    await root.execute_command("ACL", "DELUSER", user)
    await root.delete(f"{prefix}:adapters", f"{prefix}:adapters:version", f"{prefix}:gw:key:x")
    await root.aclose()


def _adapter(name: str, path: str) -> AdapterSpec:
    return AdapterSpec(name=name, base_model="smol", path=path)


async def test_the_operator_syncs_adapters_with_its_own_rights_only(
    as_operator: tuple[AdapterCatalog, aioredis.Redis, aioredis.Redis, str],
) -> None:
    catalog, client, root, prefix = as_operator
    wanted = [_adapter("tandem-test-a", "/models/adapters/a"), _adapter("tandem-test-b", "/models/adapters/b")]
    first = await sync_adapters(catalog, wanted, [], now_unix_s=1.0)
    assert first.put == ["tandem-test-a", "tandem-test-b"] and first.removed == []

    # The same spec again: nothing written, no version bumped (a bump discards the adapter's cached KV).
    again = await sync_adapters(catalog, wanted, first.managed, now_unix_s=2.0)
    assert again.put == [] and again.versions == first.versions
    assert int(await root.get(f"{prefix}:adapters:version")) == 2

    # b gone from the spec, a at new files: b unloaded, a reloaded under a newer version.
    changed = await sync_adapters(catalog, [_adapter("tandem-test-a", "/models/adapters/a2")], again.managed,
                                  now_unix_s=3.0)
    assert changed.put == ["tandem-test-a"] and changed.removed == ["tandem-test-b"]
    assert changed.versions["tandem-test-a"] > first.versions["tandem-test-a"]
    entries = await catalog.entries()
    assert set(entries) == {"tandem-test-a"} and entries["tandem-test-a"].path == "/models/adapters/a2"

    # A garbage entry (not JSON) reads as absent and is overwritten by the next sync.
    await root.hset(f"{prefix}:adapters", "tandem-test-a", "{not json")
    healed = await sync_adapters(catalog, [_adapter("tandem-test-a", "/models/adapters/a2")], changed.managed,
                                 now_unix_s=4.0)
    assert healed.put == ["tandem-test-a"] and (await catalog.entries())["tandem-test-a"].version > 0

    assert await remove_managed(catalog, healed.managed) == ["tandem-test-a"]
    assert await catalog.entries() == {}

    # Refused: tenants and keys, the registry, the router's ledger.
    for command in (["GET", f"{prefix}:gw:key:x"], ["SET", f"{prefix}:gw:key:x", "{}"],
                    ["SET", f"{prefix}:worker:fake", "{}"], ["PUBLISH", f"{prefix}:router:ledger", "forged"],
                    ["KEYS", "*"]):
        with pytest.raises(NoPermissionError):
            await client.execute_command(*command)


async def test_a_dead_redis_is_one_clear_error() -> None:
    catalog = AdapterCatalog.connect("redis://127.0.0.1:1/0", key_prefix="acltest-dead", timeout_s=0.5)
    try:
        with pytest.raises(BackendUnavailableError, match="adapter catalog unreachable"):
            await sync_adapters(catalog, [_adapter("a", "/a")], [], now_unix_s=0.0)
    finally:
        await catalog.aclose()


def test_redis_acl_gives_the_operator_these_rights_once_it_has_the_component() -> None:
    """The rules above are the ones proposed for tandem.common.redis_acl (helper D owns it); once the
    ``operator`` component is there, its rules must be these."""
    if "operator" not in redis_acl.COMPONENTS:
        pytest.skip("tandem.common.redis_acl has no operator component yet")
    assert redis_acl.rules("operator", "tandem") == ["resetchannels", *operator_rules("tandem")]
