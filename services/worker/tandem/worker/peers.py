"""The KV servers a decode worker may dial: the prefill workers of its model
that the registry lists, and no other address.

``PrefetchKV`` names the address to stream from, and ``Decode``'s KV handle
the address to pull from. Before, a decode worker dialled whatever a caller
named (server-side request forgery: any host:port on its network) and staged
what came back. Now the decode role asks :meth:`PrefillPeers.allows` first: a
``PrefetchKV`` to any other address is refused (an answer, not an error), and a
handle naming one is not used (the engine computes the prompt itself).

The list is the registry's (Redis) at most ``max_age_s`` old; an address not in
it makes one fresh read (at most one per ``min_refresh_interval_s``), so that a
prefill worker that registered a moment ago is found. While Redis is down the
last list read stays in force.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from tandem.common.errors import BackendUnavailableError
from tandem.common.registry import WorkerRecord

logger = logging.getLogger(__name__)


class PrefillPeers:
    def __init__(
        self,
        list_prefill_workers: Callable[[], Awaitable[list[WorkerRecord]]],
        *,
        max_age_s: float = 5.0,
        min_refresh_interval_s: float = 0.25,
    ) -> None:
        self._list = list_prefill_workers
        self._max_age_s = max_age_s
        self._min_refresh_interval_s = min_refresh_interval_s
        self._addresses: frozenset[str] = frozenset()
        self._read_s = -1e9
        self._lock = asyncio.Lock()

    async def allows(self, kv_address: str) -> bool:
        """Whether ``kv_address`` is the KV server of a registered prefill worker of this model."""
        now = time.monotonic()
        if kv_address in self._addresses and now - self._read_s < self._max_age_s:
            return True
        async with self._lock:
            if time.monotonic() - self._read_s >= self._min_refresh_interval_s:
                await self._refresh()
            return kv_address in self._addresses

    async def _refresh(self) -> None:
        try:
            records = await self._list()
        except BackendUnavailableError as exc:
            logger.warning("prefill workers not read from the registry (%s); keeping the last list", exc)
            return
        self._addresses = frozenset(r.kv_address for r in records if r.kv_address)
        self._read_s = time.monotonic()
