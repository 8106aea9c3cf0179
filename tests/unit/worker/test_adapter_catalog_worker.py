"""The worker reads the real adapter catalog (Redis, tandem.common.adapters) under its own ACL user
(tandem.common.redis_acl: HGETALL of ``<prefix>:adapters``, nothing else of it), and its residency
skips the garbage a hash can hold (JSON that does not parse, an entry filed under another name, a
version of 0) instead of failing every adapter request."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc
import pytest
import redis.asyncio as aioredis

from tandem.common.adapters import AdapterCatalog, AdapterEntry
from tandem.common.errors import BackendUnavailableError
from tandem.worker.adapters import AdapterRefused, AdapterResidency
from tests.kit.redis import AclUsers, acl_users

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]

REDIS_URL = "redis://127.0.0.1:6379/0"
MODEL = "SmolLM2-135M-Instruct"


class _Engine:
    def __init__(self) -> None:
        self.added: list[str] = []

    async def add_adapter(self, entry: AdapterEntry) -> None:
        self.added.append(entry.engine_name)

    async def remove_adapter(self, entry: AdapterEntry) -> None:
        pass


@pytest.fixture
async def users() -> AsyncIterator[AclUsers]:
    async with acl_users(REDIS_URL, label="adapters") as made:
        yield made


async def test_the_worker_reads_the_catalog_under_its_own_user_and_skips_garbage(users: AclUsers) -> None:
    admin = AdapterCatalog(aioredis.Redis.from_url(REDIS_URL), key_prefix=users.key_prefix)
    worker = AdapterCatalog.connect(users.url("worker"), key_prefix=users.key_prefix)
    raw = aioredis.Redis.from_url(REDIS_URL)
    try:
        good = await admin.put("tandem-test-a", base_model=MODEL, path="/adapters/a", now_unix_s=time.time())
        key = f"{users.key_prefix}:adapters"
        await raw.hset(key, "broken", "{not json 🙃")
        await raw.hset(key, "liar", AdapterEntry("tandem-test-a", MODEL, "/elsewhere", 99).to_json())
        await raw.hset(key, "zero", AdapterEntry("zero", MODEL, "/adapters/z", 0).to_json())
        engine = _Engine()
        residency = AdapterResidency(engine, worker.entries, model=MODEL, max_adapters=2)
        async with residency.use(good.engine_name) as entry:
            assert entry == good
        for refused_name in ("broken@1", "liar@99", "tandem-test-a@99", "zero@0"):
            with pytest.raises(AdapterRefused) as refused:
                async with residency.use(refused_name):
                    pass
            assert refused.value.code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT)
        assert engine.added == [good.engine_name]
        # Read-only: a worker cannot load or unload an adapter for the fleet.
        with pytest.raises(BackendUnavailableError, match="no permissions"):
            await worker.put("evil", base_model=MODEL, path="/tmp/evil", now_unix_s=0.0)
        with pytest.raises(BackendUnavailableError, match="no permissions"):
            await worker.remove("tandem-test-a")
        assert sorted(await admin.entries()) == ["tandem-test-a", "zero"]  # "broken" and "liar" do not parse as theirs
    finally:
        await worker.aclose()
        await admin.aclose()
        await raw.aclose()
