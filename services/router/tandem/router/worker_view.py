"""The live workers, read from the registry through a short cache.

:class:`tandem.router.scheduler.Scheduler` awaits :meth:`CachedWorkerView.workers`
on every Schedule; at most once per ``refresh_interval_s`` that calls
:meth:`tandem.common.registry.WorkerRegistry.list_workers` (one Redis round
trip), so Schedule stays fast under load. A worker whose heartbeats stop is
gone after the registry TTL plus at most one refresh interval.

With ``refresh_in_background`` (the deployment, the fleet benchmark) a Schedule
never waits for that read: past the interval it gets the list it had and starts
a refresh task, which reads the records 64 per MGET and parses them in slices of
~0.2 ms between other work (at 1,000 workers a whole read took ~10 ms of the event
loop, and every Schedule that arrived meanwhile waited; records whose JSON did not
change since the last read are not parsed again). Only the first call, or one whose list is
older than ``max_stale_s``, waits.
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


#: A background refresh yields to the event loop after parsing for this long (a Schedule that
#: arrives meanwhile waits at most about that), and reads the records this many per MGET.
_PARSE_SLICE_S = 0.0002
_READ_BATCH = 64


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
        refresh_in_background: bool = False,
    ) -> None:
        self._source = source
        self._in_background = refresh_in_background
        self._background: asyncio.Task[None] | None = None
        # raw record JSON -> its parsed record, from the last read (unchanged records are not parsed again)
        self._parsed: dict[bytes, WorkerRecord] = {}
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
        if (
            self._in_background
            and self._workers is not None
            and self._clock() - self._fetched_at_s < self._max_stale_s
        ):
            if self._background is None or self._background.done():
                self._background = asyncio.get_running_loop().create_task(self._refresh_in_background())
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

    async def _refresh_in_background(self) -> None:
        async with self._refresh_lock:
            try:
                workers = await self._read()
            except BackendUnavailableError as exc:
                logger.warning("worker registry unreachable; keeping a list %.1f s old: %s",
                               self._clock() - self._fetched_at_s, exc)
                return
            except Exception:
                logger.exception("worker registry refresh failed")
                return
            self._workers = workers
            self._fetched_at_s = self._clock()

    async def _read(self) -> list[WorkerRecord]:
        """The source's list; from a registry that offers raw records, parsed a chunk at a time."""
        list_raw = getattr(self._source, "list_raw_records", None)
        if list_raw is None:
            return await self._source.list_workers()
        raws: list[bytes] = await list_raw(batch_size=_READ_BATCH)
        parsed: dict[bytes, WorkerRecord] = {}
        workers: list[WorkerRecord] = []
        slice_end_s = time.perf_counter() + _PARSE_SLICE_S
        for raw in raws:
            record = self._parsed.get(raw) or WorkerRecord.from_json(raw)
            parsed[raw] = record
            workers.append(record)
            if time.perf_counter() > slice_end_s:
                await asyncio.sleep(0)
                slice_end_s = time.perf_counter() + _PARSE_SLICE_S
        self._parsed = parsed
        workers.sort(key=lambda r: r.worker_id)
        return workers
