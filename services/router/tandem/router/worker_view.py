"""The live workers, read from the registry through a short cache.

:class:`tandem.router.scheduler.Scheduler` awaits :meth:`CachedWorkerView.workers`
on every Schedule; at most once per ``refresh_interval_s`` that calls
:meth:`tandem.common.registry.WorkerRegistry.list_workers` (one Redis round
trip), so Schedule stays fast under load. A worker whose heartbeats stop is
gone after the registry TTL plus at most one refresh interval.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from tandem.common.errors import BackendUnavailableError
from tandem.common.registry import WorkerRecord

logger = logging.getLogger(__name__)


class WorkerSource(Protocol):
    """Where the worker list comes from (the Redis WorkerRegistry, or a fake in tests)."""

    async def list_workers(self, *, role: str | None = None, model: str | None = None) -> list[WorkerRecord]: ...


class CachedWorkerView:
    """All live workers, refreshed at most every ``refresh_interval_s``.

    When the registry is unreachable the last list is served for up to
    ``max_stale_s`` (the registry's TTL: older records would have expired
    anyway); after that :class:`BackendUnavailableError` propagates.
    """

    def __init__(
        self,
        source: WorkerSource,
        *,
        refresh_interval_s: float,
        max_stale_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._source = source
        self._refresh_interval_s = refresh_interval_s
        self._max_stale_s = max_stale_s
        self._clock = clock
        self._workers: list[WorkerRecord] | None = None
        self._fetched_at_s = 0.0
        # One refresh at a time: concurrent Schedules wait for it instead of
        # each sending its own Redis round trip.
        self._refresh_lock = asyncio.Lock()

    def _is_fresh(self) -> bool:
        return self._workers is not None and self._clock() - self._fetched_at_s < self._refresh_interval_s

    async def workers(self) -> list[WorkerRecord]:
        if self._is_fresh():
            assert self._workers is not None
            return self._workers
        async with self._refresh_lock:
            if self._is_fresh():
                assert self._workers is not None
                return self._workers
            try:
                workers = await self._source.list_workers()
            except BackendUnavailableError:
                age_s = self._clock() - self._fetched_at_s
                if self._workers is not None and age_s < self._max_stale_s:
                    logger.warning("worker registry unreachable; using a list %.1f s old", age_s)
                    return self._workers
                raise
            self._workers = workers
            self._fetched_at_s = self._clock()
            return workers
