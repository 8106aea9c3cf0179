"""The gateway sends the router the prompt's block hashes, never its token ids or the tenant's salt:
hashes for each hashing configuration the model's engines registered, equal to what the router itself
computes (the equality with vLLM's own hashes is tested in tests/unit/common and against real engines
in tests/integration/test_local_prefill.py)."""

from __future__ import annotations

from typing import Any

from tandem.common.block_hash import BlockHasher
from tandem.common.registry import WorkerRecord
from tandem.gateway.prefix_hashes import PromptHasher


class Registry:
    def __init__(self, records: list[WorkerRecord]) -> None:
        self.records = records
        self.calls = 0
        self.fail = False

    async def list_workers(self, *, role: str | None = None, model: str | None = None) -> list[WorkerRecord]:
        self.calls += 1
        if self.fail:
            raise ConnectionError("redis down")
        return list(self.records)


def worker(worker_id: str, *, model: str = "m", block_size: int = 4, seed: str = "s", algo: str = "sha256") -> Any:
    return WorkerRecord(
        worker_id,
        "prefill",
        model,
        "127.0.0.1:1",
        block_hash_algo=algo,
        block_hash_seed=seed,
        block_size_tokens=block_size,
    )


async def test_hashes_per_configuration_equal_the_routers_own() -> None:
    registry = Registry(
        [
            worker("a"),
            worker("b"),  # same configuration: one list
            worker("c", block_size=8, seed="other"),
            worker("d", algo="xxhash"),  # not reproducible: no list
            worker("e", model="other-model", block_size=2),
        ]
    )
    hasher = PromptHasher(registry)
    prompt = list(range(100, 121))  # 21 tokens: 5 blocks of 4, 2 of 8
    sent = await hasher.hashes("m", prompt, "salt-1")
    assert [(h.block_size_tokens, h.hash_seed) for h in sent] == [(4, "s"), (8, "other")]
    assert list(sent[0].hashes) == BlockHasher(4, "s").block_hashes(prompt, cache_salt="salt-1")
    assert list(sent[1].hashes) == BlockHasher(8, "other").block_hashes(prompt, cache_salt="salt-1")
    assert list(sent[0].hashes) != BlockHasher(4, "s").block_hashes(prompt, cache_salt="salt-2")
    # Nothing of the prompt or the salt is in what is sent.
    wire = b"".join(h.SerializeToString() for h in sent)
    assert b"salt-1" not in wire and bytes(prompt[:4]) not in wire


async def test_the_registry_is_read_once_per_refresh_and_its_outage_keeps_the_last_view() -> None:
    now = [0.0]
    registry = Registry([worker("a")])
    hasher = PromptHasher(registry, refresh_s=5.0, clock=lambda: now[0])
    prompt = list(range(8))
    first = await hasher.hashes("m", prompt, "")
    await hasher.hashes("m", prompt, "")
    assert registry.calls == 1
    now[0] = 6.0
    registry.fail = True
    assert await hasher.hashes("m", prompt, "") == first  # last view kept
    assert registry.calls == 2
    assert await hasher.hashes("unknown-model", prompt, "") == []  # cold, not an error
