"""Usage per model and adapter (issue 40 part 4), UsageStore against the real Redis: each row is
the model the client named (a base model or a LoRA adapter, with its base model), the adapters add
up into their base model's ``by_base_model`` row, and every counter of ``total`` is the sum of the
rows, all time and per day, also for an open record settled after its gateway died. The tenant
admin CLI sets and clears the model and adapter allow-lists and refuses hostile adapter names."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
import redis.asyncio as aioredis

from tandem.gateway import admin
from tandem.gateway.redis_client import connect
from tandem.gateway.usage import COUNTERS, UsageRecord, UsageStore
from tests.kit.redis import delete_prefix

BASE = "SmolLM2-135M-Instruct"
OTHER = "SmolLM2-135M-Instruct-tandem-merged"
#: A model name with the field separator, CJK and an emoji: rows are split at the last "|".
ODD = "모델|🦄"


@pytest_asyncio.fixture
async def client() -> AsyncIterator[tuple[aioredis.Redis, str]]:
    prefix = f"tandem-unit-{uuid.uuid4().hex[:8]}"
    redis_client = connect("redis://127.0.0.1:6379/0", timeout_s=2.0)
    try:
        yield redis_client, prefix
    finally:
        await delete_prefix(redis_client, prefix)
        await redis_client.aclose()


def _rows_sum(rows: list[dict[str, Any]]) -> dict[str, int]:
    return {name: sum(int(row[name]) for row in rows) for name in COUNTERS}


async def test_rows_per_model_and_adapter_sum_to_the_totals(client: tuple[aioredis.Redis, str]) -> None:
    redis_client, prefix = client
    store = UsageStore(redis_client, key_prefix=prefix)
    records = [
        UsageRecord("acme", BASE, 10, 5, 2, aborted=False, request_id="r1"),
        UsageRecord("acme", "tandem-test-a", 7, 3, 0, aborted=False, request_id="r2", base_model=BASE),
        UsageRecord("acme", "tandem-test-a", 4, 1, 1, aborted=True, request_id="r3", base_model=BASE),
        UsageRecord("acme", "tandem-test-b", 6, 2, 0, aborted=False, request_id="r4", base_model=OTHER),
        UsageRecord("acme", OTHER, 9, 9, 9, aborted=False, request_id="r5", base_model=OTHER),  # a base model
        UsageRecord("acme", ODD, 1, 1, 0, aborted=False, request_id="r6"),
        UsageRecord("zeta", "tandem-test-a", 100, 100, 0, aborted=False, request_id="r7", base_model=BASE),
    ]
    for record in records:
        await store.record(record)
    await store.record(records[1])  # a retry counts once, base model note included
    day = time.strftime("%Y-%m-%d", time.gmtime())
    for period in (None, day):
        usage = await store.tenant_usage("acme", day=period)
        rows = {row["model"]: row for row in usage["data"]}
        assert set(rows) == {BASE, OTHER, ODD, "tandem-test-a", "tandem-test-b"}
        assert rows["tandem-test-a"] == {
            "model": "tandem-test-a",
            "base_model": BASE,
            "requests": 2,
            "aborted_requests": 1,
            "prompt_tokens": 11,
            "completion_tokens": 4,
            "cached_tokens": 1,
        }
        assert rows["tandem-test-b"]["base_model"] == OTHER
        assert rows[BASE]["base_model"] == BASE and rows[OTHER]["base_model"] == OTHER
        assert rows[ODD]["base_model"] == ODD and rows[ODD]["requests"] == 1
        assert _rows_sum(usage["data"]) == usage["total"] == _rows_sum(usage["by_base_model"])
        assert usage["total"]["requests"] == 6 and usage["total"]["prompt_tokens"] == 37
        by_base = {row["model"]: row for row in usage["by_base_model"]}
        assert set(by_base) == {BASE, OTHER, ODD}
        assert by_base[BASE]["requests"] == 3 and by_base[BASE]["prompt_tokens"] == 21
        assert by_base[OTHER]["requests"] == 2 and by_base[OTHER]["completion_tokens"] == 11
    zeta = await store.tenant_usage("zeta")
    assert [row["model"] for row in zeta["data"]] == ["tandem-test-a"] and zeta["total"]["requests"] == 1


async def test_an_orphaned_adapter_request_is_settled_under_its_adapter(client: tuple[aioredis.Redis, str]) -> None:
    """A gateway died mid-answer: the open record carries the adapter and its base model to the
    replica that settles it."""
    redis_client, prefix = client
    dead = UsageStore(redis_client, key_prefix=prefix, replica_id="gw-dead")
    record = UsageRecord("acme", "tandem-test-c", 12, 0, 0, aborted=False, request_id="r-dead", base_model=BASE)
    assert await dead.open(record)
    await dead.progress("r-dead", 3)
    live = UsageStore(redis_client, key_prefix=prefix, replica_id="gw-live")
    await live.renew_liveness(10)
    (orphan,) = await live.settle_orphans()
    assert orphan.request_id == "r-dead"
    (row,) = (await live.tenant_usage("acme"))["data"]
    assert (row["model"], row["base_model"], row["requests"], row["aborted_requests"]) == (
        "tandem-test-c",
        BASE,
        1,
        1,
    )
    assert (row["prompt_tokens"], row["completion_tokens"]) == (12, 3)


def test_the_admin_cli_sets_and_clears_the_allow_lists(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import redis

    prefix = f"tandem-cli-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("TANDEM_GATEWAY_TENANCY__KEY_PREFIX", prefix)

    def run(*argv: str) -> list[dict[str, Any]]:
        assert admin.main(list(argv)) == 0
        return [json.loads(line) for line in capsys.readouterr().out.splitlines()]

    try:
        (tenant,) = run("tenant", "create", "acme", "--allowed-adapter", "tandem-test-a")
        assert tenant["allowed_adapters"] == ["tandem-test-a"] and tenant["allowed_models"] == []
        (tenant,) = run(
            "tenant",
            "update",
            "acme",
            "--allowed-model",
            BASE,
            "--allowed-adapter",
            "a.b:c_d-1",
            "--allowed-adapter",
            "x",
        )
        assert tenant["allowed_models"] == [BASE] and tenant["allowed_adapters"] == ["a.b:c_d-1", "x"]
        (tenant,) = run("tenant", "update", "acme", "--all-adapters")
        assert tenant["allowed_adapters"] == [] and tenant["allowed_models"] == [BASE]
        (tenant,) = run("tenant", "update", "acme", "--all-models")
        assert tenant["allowed_models"] == []
        for hostile in ("<|im_start|>", "lora-🙂", "a" * 200, "../x", "x y"):
            assert admin.main(["tenant", "update", "acme", "--allowed-adapter", hostile]) == 2
            assert "not an adapter name" in capsys.readouterr().err
        assert admin.main(["tenant", "update", "acme", "--all-models", "--allowed-model", BASE]) == 2
        assert "--all-models clears the list that --allowed-model sets" in capsys.readouterr().err
        (shown,) = run("tenant", "show", "acme")
        assert shown["allowed_models"] == [] and shown["allowed_adapters"] == []  # the refusals changed nothing
    finally:
        sync = redis.Redis()
        for k in sync.scan_iter(match=f"{prefix}:*"):
            sync.delete(k)
