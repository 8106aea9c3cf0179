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

A worker that leaves (it drains, its engine dies, or the supervisor that saw it die removes it:
tandem.common.registry.WorkerRegistry.unregister) bumps the registry's removals counter. With
``removal_check_interval_s`` the view reads that counter (one small GET, in the background) that
often and reads the whole list at once when it changed, so the router stops placing on a worker
that is gone within about that interval plus one read, not ``refresh_interval_s`` later (issue 37:
within 1 s of its death; measured in tests/faults/test_engine_death.py). A worker that dies
without anyone unregistering it still drops out when its record expires (the registry's TTL).

A Schedule for a model that no worker in the cached list serves does not fail
on that list: its workers may have registered since the last read.
:meth:`CachedWorkerView.workers_now` reads the registry for it (one such read at a time, at most
one every ``MIN_FORCED_READ_INTERVAL_S``; callers that arrived before a read began share it), and a
key (the model) that was still unknown after such a read is answered from the cache for the next
``refresh_interval_s``, so a stream of requests for a model nobody serves costs one read per
interval, not one each.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from tandem.common.errors import BackendUnavailableError
from tandem.common.registry import REJECT_LOG_INTERVAL_S, InvalidWorkerRecordError, WorkerRecord

logger = logging.getLogger(__name__)


class WorkerSource(Protocol):
    """Where the worker list comes from (the Redis WorkerRegistry, or a fake in tests)."""

    async def list_workers(self, *, role: str | None = None, model: str | None = None) -> list[WorkerRecord]: ...


#: A background refresh yields to the event loop after parsing for this long (a Schedule that
#: arrives meanwhile waits at most about that), and reads the records this many per MGET.
_PARSE_SLICE_S = 0.0002
_READ_BATCH = 64
#: Reads for :meth:`CachedWorkerView.workers_now` start at least this far apart.
MIN_FORCED_READ_INTERVAL_S = 0.05
#: Keys remembered as still unknown after a read (the oldest are forgotten past this many).
_MAX_UNKNOWN_KEYS = 1024


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
        removal_check_interval_s: float = 0.0,
    ) -> None:
        self._source = source
        self._in_background = refresh_in_background
        self._background: asyncio.Task[None] | None = None
        # The registry's removals counter (module docstring): read every removal_check_interval_s, in
        # the background; 0, or a source without one, never.
        self._removals_of: Callable[[], Awaitable[int]] | None = (
            getattr(source, "removals", None) if removal_check_interval_s > 0 and refresh_in_background else None
        )
        self._removal_check_interval_s = removal_check_interval_s
        self._removals_checked_at_s = -float("inf")
        self._removals: int | None = None
        self._removals_check: asyncio.Task[None] | None = None
        # raw record JSON -> its parsed record, from the last read (unchanged records are not parsed again)
        self._parsed: dict[bytes, WorkerRecord] = {}
        self._reject_logged_s = -REJECT_LOG_INTERVAL_S
        #: Records skipped so far because they failed their checks (tandem.common.registry).
        self.num_rejected = 0
        self._refresh_interval_s = refresh_interval_s
        self._max_stale_s = max_stale_s
        self._clock = clock
        self._workers: list[WorkerRecord] | None = None
        self._fetched_at_s = 0.0
        # One refresh at a time: concurrent Schedules wait for it instead of
        # each sending its own Redis round trip.
        self._refresh_lock = asyncio.Lock()
        self._forced_lock = asyncio.Lock()
        #: When the last read for workers_now began (clock), and the keys still unknown after one.
        self._forced_at_s = -float("inf")
        self._unknown: dict[str, float] = {}

    def _is_fresh(self) -> bool:
        return self._workers is not None and self._clock() - self._fetched_at_s < self._refresh_interval_s

    async def workers(self) -> list[WorkerRecord]:
        if self._removals_of is not None:
            self._maybe_check_removals()
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

    async def workers_now(self, key: str = "") -> list[WorkerRecord]:
        """The registry's list read now, for a caller the cached list cannot serve (``key``: what it
        looks for, e.g. a model); see the module docstring. Remember a key still unknown after it with
        :meth:`still_unknown`. Raises :class:`BackendUnavailableError` only with no list at all."""
        arrived_s = self._clock()
        seen_s = self._unknown.get(key)
        if self._workers is not None and seen_s is not None and arrived_s - seen_s < self._refresh_interval_s:
            return self._workers
        async with self._forced_lock:
            if self._workers is not None and self._forced_at_s >= arrived_s:
                return self._workers  # a read that began after this caller arrived has just ended
            wait_s = self._forced_at_s + MIN_FORCED_READ_INTERVAL_S - self._clock()
            if wait_s > 0:
                await asyncio.sleep(wait_s)
            self._forced_at_s = self._clock()
            async with self._refresh_lock:
                try:
                    workers = await self._read()
                except BackendUnavailableError:
                    if self._workers is None:
                        raise
                    return self._workers
                self._workers = workers
                self._fetched_at_s = self._clock()
                return workers

    def still_unknown(self, key: str) -> None:
        """``key`` was not in the list :meth:`workers_now` gave: answer it from the cache for a while."""
        if len(self._unknown) >= _MAX_UNKNOWN_KEYS:
            self._unknown.pop(next(iter(self._unknown)))
        self._unknown[key] = self._clock()

    def _maybe_check_removals(self) -> None:
        now_s = self._clock()
        if now_s - self._removals_checked_at_s < self._removal_check_interval_s:
            return
        if self._removals_check is not None and not self._removals_check.done():
            return
        self._removals_checked_at_s = now_s
        self._removals_check = asyncio.get_running_loop().create_task(self._check_removals())

    async def _check_removals(self) -> None:
        """Read the removals counter; when a worker left since the last look, read the list now."""
        assert self._removals_of is not None
        try:
            removals = await self._removals_of()
        except BackendUnavailableError:
            return  # the list's own refresh says so
        except Exception:
            logger.exception("worker registry removals check failed")
            return
        changed = self._removals is not None and removals != self._removals
        self._removals = removals
        if changed and self._workers is not None:
            await self._refresh_in_background()

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
            record = self._parsed.get(raw)
            if record is None:
                try:
                    record = WorkerRecord.from_json(raw)
                except InvalidWorkerRecordError as exc:
                    # One bad record (a worker's Redis user can write any) must not hide the others.
                    self.num_rejected += 1
                    if self._clock() - self._reject_logged_s >= REJECT_LOG_INTERVAL_S:
                        self._reject_logged_s = self._clock()
                        logger.warning("skipping a worker record (logged once a minute): %s", exc)
                    continue
            parsed[raw] = record
            workers.append(record)
            if time.perf_counter() > slice_end_s:
                await asyncio.sleep(0)
                slice_end_s = time.perf_counter() + _PARSE_SLICE_S
        self._parsed = parsed
        workers.sort(key=lambda r: r.worker_id)
        return workers
