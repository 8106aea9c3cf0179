"""Redis ACL users per component (tandem.common.redis_acl) against the real Redis on 127.0.0.1:6379.

What each component must be refused, and that a worker registers, refreshes, lists and leaves under
its own user. The gateway's and the router's whole Redis paths run under their users in
tests/unit/gateway/test_redis_acl.py and tests/unit/router/test_redis_acl.py; the admin CLI's below.
Each test makes its own users (``acltest-<hex>-<component>``) and deletes them and its keys after.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError

from tandem.common import redis_acl
from tandem.common.registry import ROLE_DECODE, WorkerRecord, WorkerRegistry
from tandem.common.settings import RedisSettings
from tests.kit.redis import AclUsers, acl_denials, acl_users

REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest_asyncio.fixture
async def users() -> AsyncIterator[AclUsers]:
    async with acl_users(REDIS_URL) as made:
        yield made


def client(users: AclUsers, component: str) -> aioredis.Redis:
    return aioredis.Redis.from_url(users.url(component))


# -- what each user is refused -------------------------------------------------------------------

#: (component, command, key or channel): writes that would let a component take over another's role.
FORBIDDEN = [
    # minting an API key, or changing a tenant's quota, is the admin's alone
    ("gateway", ["SET", "{p}:gw:key:" + "ab" * 32, "{}"], "mint an API key"),
    ("gateway", ["SET", "{p}:gw:tenant:acme", "{}"], "rewrite a tenant"),
    ("gateway", ["SET", "{p}:gw:keyid:k1", "x"], "map a key id"),
    ("gateway", ["SADD", "{p}:gw:tenants", "evil"], "add a tenant"),
    ("router", ["SET", "{p}:gw:key:" + "ab" * 32, "{}"], "mint an API key"),
    ("worker", ["SET", "{p}:gw:key:" + "ab" * 32, "{}"], "mint an API key"),
    ("worker", ["GET", "{p}:gw:key:" + "ab" * 32], "read API keys"),
    # a fake worker that would receive prompts: only workers register
    ("gateway", ["SET", "{p}:worker:fake", "{}"], "register a worker"),
    ("gateway", ["ZADD", "{p}:workers", "1", "fake"], "index a worker"),
    ("router", ["SET", "{p}:worker:fake", "{}"], "register a worker"),
    ("router", ["ZADD", "{p}:workers", "1", "fake"], "index a worker"),
    ("admin", ["SET", "{p}:worker:fake", "{}"], "register a worker"),
    # the router ledger's channel and keys are the router's
    ("gateway", ["PUBLISH", "{p}:router:ledger", "forged"], "publish on the ledger"),
    ("worker", ["PUBLISH", "{p}:router:ledger", "forged"], "publish on the ledger"),
    ("gateway", ["SET", "{p}:router:ledger:r1", "forged"], "forge a ledger snapshot"),
    # the gateway's quotas, usage and conversations are not the router's or a worker's
    ("router", ["HSET", "{p}:gw:quota:acme:in", "tokens", "1000000"], "refill a quota"),
    ("worker", ["HINCRBY", "{p}:gw:usage:acme", "m|prompt_tokens", "-5"], "rewrite usage"),
    ("router", ["LRANGE", "{p}:gw:conv:acme:c1", "0", "-1"], "read a conversation"),
    # nobody administers Redis itself, or reaches other stacks' keys
    ("admin", ["ACL", "SETUSER", "{p}-evil", "on", "+@all", "~*"], "create a user"),
    ("gateway", ["CONFIG", "SET", "maxmemory", "1"], "reconfigure Redis"),
    ("gateway", ["FLUSHALL"], "drop every key"),
    ("admin", ["GET", "other-stack:gw:key:x"], "read another prefix"),
    ("gateway", ["EVAL", "return 1", "0"], "run an unregistered script by EVAL"),
    # the adapter catalog: written by the admin, the gateway's admin API and the operator, through
    # AdapterCatalog's commands only; the operator may touch nothing else
    ("worker", ["HSET", "{p}:adapters", "evil", "{}"], "load an adapter"),
    ("router", ["HGETALL", "{p}:adapters"], "read the adapter catalog"),
    ("gateway", ["DEL", "{p}:adapters"], "drop the adapter catalog"),
    ("gateway", ["SET", "{p}:adapters:version", "0"], "rewind the adapter versions"),
    ("admin", ["DEL", "{p}:adapters"], "drop the adapter catalog"),
    ("operator", ["GET", "{p}:gw:key:" + "ab" * 32], "read API keys"),
    ("operator", ["SET", "{p}:worker:fake", "{}"], "register a worker"),
    ("operator", ["DEL", "{p}:adapters"], "drop the adapter catalog"),
]


@pytest.mark.parametrize(("component", "command", "what"), FORBIDDEN, ids=[f"{c}-{w}" for c, _, w in FORBIDDEN])
async def test_each_component_is_refused_what_is_not_its_job(
    users: AclUsers, component: str, command: list[str], what: str
) -> None:
    conn = client(users, component)
    try:
        with pytest.raises(NoPermissionError):
            await conn.execute_command(*[part.replace("{p}", users.key_prefix) for part in command])
    finally:
        await conn.aclose()


async def test_a_script_of_the_gateway_cannot_write_what_its_user_may_not(users: AclUsers) -> None:
    """Scripts run with the caller's rights: a loaded script cannot mint a key either."""
    conn = client(users, "gateway")
    try:
        sha = await conn.script_load("return redis.call('SET', ARGV[1], '{}')")
        with pytest.raises(Exception, match=r"can't access|NOPERM|no permissions"):
            await conn.evalsha(sha, 0, f"{users.key_prefix}:gw:key:{'cd' * 32}")
    finally:
        await conn.aclose()
    admin = aioredis.Redis.from_url(REDIS_URL)
    try:
        assert await admin.exists(f"{users.key_prefix}:gw:key:{'cd' * 32}") == 0
    finally:
        await admin.aclose()


# -- the worker: its own registration ----------------------------------------------------------


async def test_a_worker_registers_refreshes_lists_and_leaves_under_its_own_user(users: AclUsers) -> None:
    registry = WorkerRegistry(users.url("worker"), key_prefix=users.key_prefix, ttl_s=5.0)
    reader = WorkerRegistry(users.url("gateway"), key_prefix=users.key_prefix, ttl_s=5.0)
    record = WorkerRecord(worker_id="decode-0", role=ROLE_DECODE, model="m", address="127.0.0.1:1")
    try:
        await registry.heartbeat(record)
        await registry.heartbeat(record)
        assert [r.worker_id for r in await registry.list_workers()] == ["decode-0"]
        assert [r.worker_id for r in await reader.list_workers()] == ["decode-0"]
        await registry.unregister("decode-0")
        assert await reader.list_workers() == []
    finally:
        await registry.aclose()
        await reader.aclose()
    admin = aioredis.Redis.from_url(REDIS_URL)
    try:
        assert await acl_denials(admin, users.key_prefix) == []
    finally:
        await admin.aclose()


async def test_readers_prune_an_expired_worker_from_the_index(users: AclUsers) -> None:
    """The gateway and the router may ZREM the index (and nothing else there): an id whose record
    expired is dropped by the first reader."""
    admin = aioredis.Redis.from_url(REDIS_URL)
    try:
        await admin.zadd(f"{users.key_prefix}:workers", {"gone": 1})
        for component in ("gateway", "router"):
            reader = WorkerRegistry(users.url(component), key_prefix=users.key_prefix)
            try:
                assert await reader.list_workers() == []
            finally:
                await reader.aclose()
            assert await admin.zcard(f"{users.key_prefix}:workers") == 0
            await admin.zadd(f"{users.key_prefix}:workers", {"gone": 1})
        assert await acl_denials(admin, users.key_prefix) == []
    finally:
        await admin.aclose()


# -- the admin CLI -------------------------------------------------------------------------------


async def test_the_admin_cli_manages_tenants_keys_and_usage_under_its_own_user(users: AclUsers) -> None:
    from tandem.gateway.admin import build_parser, run
    from tandem.gateway.settings import GatewaySettings

    settings = GatewaySettings(redis={"url": users.url("admin")}, tenancy={"key_prefix": users.key_prefix})

    async def admin(*argv: str) -> list[dict[str, object]]:
        args: argparse.Namespace = build_parser().parse_args(list(argv))
        return await run(args, settings)

    await admin("tenant", "create", "acme", "--output-tokens-per-minute", "1000")
    await admin("tenant", "update", "acme", "--max-concurrent-streams", "2")
    [created] = await admin("key", "create", "acme", "--label", "ci")
    assert str(created["api_key"]).startswith("tdm_")
    assert [k["key_id"] for k in await admin("key", "list", "acme")] == [created["key_id"]]
    [shown] = await admin("tenant", "show", "acme")
    assert shown["max_concurrent_streams"] == 2
    assert [t["id"] for t in await admin("tenant", "list")] == ["acme"]
    await admin("usage", "acme")
    await admin("usage")
    await admin("key", "revoke", str(created["key_id"]))
    _, deleted = await admin("tenant", "delete", "acme")
    assert deleted["deleted"] == "acme"
    conn = aioredis.Redis.from_url(REDIS_URL)
    try:
        assert await acl_denials(conn, users.key_prefix) == []
    finally:
        await conn.aclose()


def test_the_admin_cli_logged_in_as_the_gateway_says_which_user_to_use(
    users: AclUsers, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tandem.gateway.admin import main

    monkeypatch.setenv("TANDEM_GATEWAY_REDIS__URL", users.url("gateway"))
    monkeypatch.setenv("TANDEM_GATEWAY_TENANCY__KEY_PREFIX", users.key_prefix)
    assert main(["tenant", "create", "acme"]) == 4
    assert "Log in as the admin user" in capsys.readouterr().err


async def test_only_the_admin_salts_a_tenant_written_before_salts(users: AclUsers) -> None:
    """The gateway may not rewrite a tenant: an unsalted (legacy) record is a clear 503 for it, and
    any ``tandem-admin`` read salts it once."""
    from tandem.common.errors import BackendUnavailableError
    from tandem.gateway.redis_client import connect
    from tandem.gateway.tenancy.store import TenantStore

    raw = json.dumps({"id": "old", "name": "old"})
    seed = aioredis.Redis.from_url(REDIS_URL)
    gateway = connect(users.url("gateway"), timeout_s=2.0)
    admin = connect(users.url("admin"), timeout_s=2.0)
    try:
        await seed.set(f"{users.key_prefix}:gw:tenant:old", raw)
        with pytest.raises(BackendUnavailableError, match="tandem-admin tenant list"):
            await TenantStore(gateway, key_prefix=users.key_prefix).get_tenant("old")
        salted = await TenantStore(admin, key_prefix=users.key_prefix).get_tenant("old")
        assert salted is not None and salted.salt
        again = await TenantStore(gateway, key_prefix=users.key_prefix).get_tenant("old")
        assert again is not None and again.salt == salted.salt
    finally:
        await seed.aclose()
        await gateway.aclose()
        await admin.aclose()


async def test_the_admin_cli_and_the_operator_manage_adapters_under_their_own_users(users: AclUsers) -> None:
    from tandem.common.adapters import AdapterCatalog
    from tandem.gateway.admin import build_parser, run
    from tandem.gateway.settings import GatewaySettings

    settings = GatewaySettings(
        redis={"url": users.url("admin")},
        tenancy={"key_prefix": users.key_prefix},
        registry={"key_prefix": users.key_prefix},
    )

    async def admin(*argv: str) -> list[dict[str, object]]:
        args: argparse.Namespace = build_parser().parse_args(list(argv))
        return await run(args, settings)

    [loaded] = await admin("adapter", "load", "acme-lora", "/adapters/acme")
    assert loaded["engine_name"] == f"acme-lora@{loaded['version']}"
    assert [a["name"] for a in await admin("adapter", "list")] == ["acme-lora"]
    operator = AdapterCatalog.connect(users.url("operator"), key_prefix=users.key_prefix)
    gateway = AdapterCatalog.connect(users.url("gateway"), key_prefix=users.key_prefix)
    worker = AdapterCatalog.connect(users.url("worker"), key_prefix=users.key_prefix)
    try:
        await operator.put("ops-lora", base_model="m", path="/adapters/ops", now_unix_s=0.0)
        assert set(await operator.entries()) == {"acme-lora", "ops-lora"}
        await gateway.put("api-lora", base_model="m", path="/adapters/api", now_unix_s=0.0)  # the admin API
        assert set(await worker.entries()) == {"acme-lora", "ops-lora", "api-lora"}
        assert await gateway.remove("api-lora") and await operator.remove("ops-lora")
    finally:
        for catalog in (operator, gateway, worker):
            await catalog.aclose()
    await admin("adapter", "unload", "acme-lora")
    assert await admin("adapter", "list") == []
    conn = aioredis.Redis.from_url(REDIS_URL)
    try:
        assert await acl_denials(conn, users.key_prefix) == []
    finally:
        await conn.aclose()


# -- the rules themselves ------------------------------------------------------------------------


def test_user_names_carry_the_prefix_and_prefixes_that_would_widen_a_pattern_are_refused() -> None:
    assert redis_acl.username("gateway", "tandem") == "tandem-gateway"
    names = [redis_acl.username(c, "t") for c in redis_acl.COMPONENTS]
    assert names == ["t-gateway", "t-router", "t-worker", "t-admin", "t-operator", "t-raygcs"]
    for bad in ("", "tan*", "a b", "x~y", "p:q", "a" * 65):
        with pytest.raises(ValueError):
            redis_acl.rules("gateway", bad)
    with pytest.raises(ValueError):
        redis_acl.username("playground", "tandem")


def test_rules_name_commands_one_by_one_never_a_category_or_every_key() -> None:
    for component in redis_acl.COMPONENTS:
        rules = redis_acl.rules(component, "tandem")
        assert rules[0] == "resetchannels"
        assert not [r for r in rules if r.startswith(("+@", "allcommands", "allkeys", "~*", "&*", "allchannels"))]
        # The Ray head's user: Ray's hashes of the prefix's storage namespace, and DEL of its probe key alone.
        scoped = ("tandem:", "~RAYtandem-raygcs@") if component == redis_acl.RAY_GCS else ("tandem:",)
        patterns = [r for r in rules if ("~" in r or r.startswith("&")) and r != "(~DUMMY +del)"]
        assert all(any(s in r for s in scoped) for r in patterns)
    assert not [r for r in redis_acl.rules("gateway", "tandem") if r in ("~tandem:gw:key:*", "~tandem:gw:tenant:*")]


def test_an_acl_file_line_holds_the_password_only_as_its_sha256() -> None:
    line = redis_acl.acl_file_line("router", "tandem", "s3cret")
    assert line.startswith("user tandem-router on #") and "s3cret" not in line
    assert "&tandem:router:ledger" in line


# -- credentials from settings -------------------------------------------------------------------


def test_username_and_password_file_go_into_the_connection_url(tmp_path: Path) -> None:
    password_file = tmp_path / "password"
    password_file.write_text("p@ss:w/rd\n")
    settings = RedisSettings(
        url="rediss://:old@redis.example:6380/2?ssl_ca_certs=/ca.crt",
        username="tandem-gateway",
        password_file=password_file,
    )
    from redis.connection import parse_url

    parsed = parse_url(settings.connection_url())  # type: ignore[no-untyped-call]
    assert (parsed["username"], parsed["password"], parsed["host"], parsed["port"], parsed["db"]) == (
        "tandem-gateway",
        "p@ss:w/rd",
        "redis.example",
        6380,
        2,
    )
    assert parsed["ssl_ca_certs"] == "/ca.crt"
    assert settings.address() == "rediss://redis.example:6380/2"
    assert RedisSettings(url="redis://u:pw@h:1/0").connection_url() == "redis://u:pw@h:1/0"


async def test_a_user_logs_in_with_the_password_from_its_file(users: AclUsers, tmp_path: Path) -> None:
    from urllib.parse import urlsplit

    parts = urlsplit(users.url("worker"))
    (tmp_path / "password").write_text(f"{parts.password}\n")
    settings = RedisSettings(url=REDIS_URL, username=str(parts.username), password_file=tmp_path / "password")
    conn = aioredis.Redis.from_url(settings.connection_url())
    try:
        assert await conn.set(f"{users.key_prefix}:worker:w1", "{}")  # as the worker: the default user could too
        with pytest.raises(NoPermissionError):
            await conn.set(f"{users.key_prefix}:gw:key:x", "{}")  # ... but not as the worker
    finally:
        await conn.aclose()
