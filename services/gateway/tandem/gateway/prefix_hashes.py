"""The prompt's prefix-cache block hashes, computed here so that prompts never travel to the router.

Called by :meth:`tandem.gateway.orchestrator.Orchestrator` before each Schedule;
reads the engines' hashing configurations (block size, hash seed) from the
worker registry in Redis, refreshed every ``refresh_s``. The router needs only
these hashes (to look them up in its KV-event index) and the token count: the
prompt goes no further than it must (the gateway → router hop is mutual TLS to
the router's front, but behind it Ray Serve's proxy and replicas would see every
tenant's prompt in the clear, and the hop is plaintext where internal TLS is
turned off). Hashes of salted requests are keyed by the tenant's random cache salt,
which does not travel either. A LoRA adapter's request is hashed with the adapter's engine name
and path as vLLM hashes it, so its hashes meet only blocks computed with the same load of the
same adapter. The hashing (vLLM's, :mod:`tandem.common.block_hash`)
also moves off the router, which is one process per replica, onto the gateways.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from tandem.common.block_hash import HASH_ALGO_SHA256, BlockHasher
from tandem.common.registry import WorkerRecord
from tandem.v1 import router_pb2

logger = logging.getLogger(__name__)

#: Prompts longer than this are hashed off the event loop (sha256 over ~1k blocks takes milliseconds).
INLINE_MAX_TOKENS = 8192


class WorkerLister(Protocol):
    async def list_workers(self, *, role: str | None = None, model: str | None = None) -> list[WorkerRecord]: ...


class PromptHasher:
    def __init__(
        self,
        registry: WorkerLister,
        *,
        refresh_s: float = 5.0,
        timeout_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._registry = registry
        self._refresh_s = refresh_s
        self._timeout_s = timeout_s
        self._clock = clock
        self._configs: dict[str, list[tuple[int, str]]] = {}
        self._read_at_s = -float("inf")
        self._lock = asyncio.Lock()
        self._hashers: dict[tuple[int, str], BlockHasher] = {}

    async def _configs_for(self, model: str) -> list[tuple[int, str]]:
        async with self._lock:
            if self._clock() - self._read_at_s >= self._refresh_s:
                try:
                    workers = await asyncio.wait_for(self._registry.list_workers(), self._timeout_s)
                except Exception as exc:  # keep the last view; the router treats unknown configs as cold
                    logger.warning("worker registry unreadable for prefix hashes: %s", exc)
                else:
                    configs: dict[str, set[tuple[int, str]]] = {}
                    for w in workers:
                        if w.block_hash_algo == HASH_ALGO_SHA256 and w.block_size_tokens > 0:
                            configs.setdefault(w.model, set()).add((w.block_size_tokens, w.block_hash_seed))
                    self._configs = {m: sorted(c) for m, c in configs.items()}
                self._read_at_s = self._clock()
            return self._configs.get(model, [])

    async def hashes(
        self,
        model: str,
        prompt_token_ids: Sequence[int],
        cache_salt: str,
        *,
        adapter: str = "",
        adapter_path: str = "",
    ) -> list[router_pb2.PromptBlockHashes]:
        """The prompt's block hashes for every configuration the model's engines use; ``adapter`` (an
        engine name) and ``adapter_path``: the LoRA adapter the request runs with ("": the base model)."""
        configs = await self._configs_for(model)
        if not configs:
            return []
        args = (configs, prompt_token_ids, cache_salt, adapter, adapter_path)
        if len(prompt_token_ids) > INLINE_MAX_TOKENS:
            return await asyncio.to_thread(self._compute, *args)
        return self._compute(*args)

    def _compute(
        self,
        configs: list[tuple[int, str]],
        prompt_token_ids: Sequence[int],
        cache_salt: str,
        adapter: str,
        adapter_path: str,
    ) -> list[router_pb2.PromptBlockHashes]:
        out = []
        for block_size, seed in configs:
            hasher = self._hashers.get((block_size, seed))
            if hasher is None:
                hasher = self._hashers[(block_size, seed)] = BlockHasher(block_size, seed)
            out.append(
                router_pb2.PromptBlockHashes(
                    block_size_tokens=block_size,
                    hash_seed=seed,
                    hashes=hasher.block_hashes(
                        prompt_token_ids, cache_salt=cache_salt, lora_name=adapter, lora_path=adapter_path
                    ),
                )
            )
        return out
