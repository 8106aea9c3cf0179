"""The LoRA adapter catalog (tandem.common.adapters) against the real Redis."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tandem.common.adapters import AdapterCatalog, AdapterEntry, engine_name, split_engine_name
from tandem.common.registry import WorkerRecord
from tests.kit.redis import delete_prefix

REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest_asyncio.fixture
async def catalog() -> AsyncIterator[AdapterCatalog]:
    prefix = f"tandem-unit-{uuid.uuid4().hex[:8]}"
    catalog = AdapterCatalog.connect(REDIS_URL, key_prefix=prefix)
    try:
        yield catalog
    finally:
        await delete_prefix(catalog._redis, prefix)
        await catalog.aclose()


def test_engine_names_round_trip_and_refuse_what_is_not_one() -> None:
    assert split_engine_name(engine_name("sql-v2.1", 7)) == ("sql-v2.1", 7)
    for bad in ("plain", "x@", "@3", "x@v3", "bad name@3"):
        with pytest.raises(ValueError):
            split_engine_name(bad)


async def test_a_reload_under_the_same_name_gets_a_new_engine_name(catalog: AdapterCatalog) -> None:
    first = await catalog.put("sql", base_model="m", path="/a/sql", now_unix_s=1.0)
    other = await catalog.put("chat-2", base_model="m", path="/a/c", now_unix_s=1.0)
    again = await catalog.put("sql", base_model="m", path="/a/sql", now_unix_s=2.0)
    assert len({first.engine_name, other.engine_name, again.engine_name}) == 3
    assert again.version > first.version
    entries = await catalog.entries()
    assert entries == {"sql": again, "chat-2": other}
    assert await catalog.remove("sql") is True
    assert await catalog.remove("sql") is False
    assert set(await catalog.entries()) == {"chat-2"}


async def test_bad_names_and_garbage_entries_are_refused_or_skipped(catalog: AdapterCatalog) -> None:
    for bad in ("", "has space", "<|im_start|>", "a/b", "x" * 200):
        with pytest.raises(ValueError):
            await catalog.put(bad, base_model="m", path="/p", now_unix_s=0.0)
    good = await catalog.put("good", base_model="m", path="/p", now_unix_s=0.0)
    # An insider's garbage in the hash (not JSON, a wrong shape, an entry filed under another name)
    # is skipped, never served.
    await catalog._redis.hset(
        catalog._key,
        mapping={
            "junk": b"\xff not json",
            "shape": "[1, 2]",
            "alias": AdapterEntry("good", "m", "/evil", 99).to_json(),
        },
    )
    assert await catalog.entries() == {"good": good}


def test_a_worker_record_carries_its_adapters_through_json() -> None:
    record = WorkerRecord("w", "decode", "m", "a:1", max_adapters=2, adapters=("sql@3", "chat@4"))
    assert WorkerRecord.from_json(record.to_json()) == record
    assert WorkerRecord.from_json(WorkerRecord("w", "decode", "m", "a:1").to_json()).adapters == ()
