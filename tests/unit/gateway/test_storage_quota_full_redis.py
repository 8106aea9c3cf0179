"""Issue 38's reproduction: one tenant storing many large conversations filled the shared Redis (the
chart's runs at ``maxmemory`` with ``noeviction``), and then every tenant's requests got 503.

Scaled down on a private redis-server: Redis gets 768 KiB of room above what the stack uses once warm,
and one tenant sends 300 conversations of ~3.5 KB each (~1 MB). Before the storage quota the tenant
grew without a byte bound until Redis refused writes: its own requests and then another tenant's got 503
``backend_unavailable``. With its quota (128 KiB) its least recently used conversations are forgotten
instead: it is always served, what Redis holds for it stays within the quota, and the other tenant is
served.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.kit.gateway import MODEL
from tests.kit.redis import start_redis

HOG_QUOTA_BYTES = 128 * 1024


@pytest.fixture
def private_redis_url(unused_tcp_port: int) -> Iterator[str]:
    proc = start_redis(unused_tcp_port, "--appendonly", "no", "--maxmemory-policy", "noeviction")
    try:
        yield f"redis://127.0.0.1:{unused_tcp_port}/0"
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def edge_overrides(private_redis_url: str) -> dict[str, Any]:
    return {"redis": {"url": private_redis_url}}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_one_tenant_storing_many_large_conversations_cannot_fill_redis_for_everyone(edge: Any) -> None:
    hog = await edge.tenant("hog", max_stored_bytes=HOG_QUOTA_BYTES)
    polite = await edge.tenant("polite")
    other = {"model": MODEL, "conversation_id": "mine", "messages": [{"role": "user", "content": "hello"}]}
    # Warm: Redis's own buffers for the stack's connections and scripts (~450 KB) are in use before the cap.
    assert (await edge.client.post("/v1/chat/completions", json=other, headers=bearer(polite))).status_code == 200
    await edge.settled()
    info = await edge.redis.info("memory")
    await edge.redis.config_set("maxmemory", int(info["used_memory"]) + 768 * 1024)

    statuses: list[int] = []
    for i in range(300):
        body = {
            "model": MODEL,
            "conversation_id": f"c{i}",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": f"{i} " + "x" * 3500}],
        }
        statuses.append((await edge.client.post("/v1/chat/completions", json=body, headers=bearer(hog))).status_code)
        await edge.settled()
    served = await edge.client.post("/v1/chat/completions", json=other, headers=bearer(polite))

    assert served.status_code == 200, served.text  # before the quota: 503 backend_unavailable
    assert set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}
    num_used_bytes = 0
    async for key in edge.redis.scan_iter(match=f"{edge.key_prefix}:gw:conv:hog*"):
        num_used_bytes += int(await edge.redis.memory_usage(key, samples=0))
    assert num_used_bytes <= 1.25 * HOG_QUOTA_BYTES, num_used_bytes
    from tandem.gateway.storage_quota import account_key  # here: the test also runs on the code before it

    assert int(await edge.redis.hget(account_key(edge.key_prefix, "hog"), "total")) <= HOG_QUOTA_BYTES
    # The newest conversations are the ones kept.
    assert await edge.app.state.services.conversations.history("hog", "c299")
