"""Worker-list intake: the registry's worker list as the list decisions use.

:class:`tandem.router.scheduler.Scheduler` asks :meth:`WorkerIntake.workers` at each Schedule and
each poll of the admission queue, and :meth:`WorkerIntake.fleet_for` at each decision. The intake
reads the cached list (:mod:`tandem.router.worker_view`), rebuilds the
:class:`tandem.router.fleet.FleetTable` when the workers change (only updates it when their loads
alone changed), and keeps the KV-event subscriptions in step with the list
(:mod:`tandem.router.kv_subscriber`; without a subscriber, it drops gone workers from the index).
A model missing from the cached list is read from the registry on demand (it may have registered
since the last read).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from tandem.common.registry import WorkerRecord
from tandem.router.budget import BudgetConfig
from tandem.router.fleet import FleetTable
from tandem.router.kv_index import KVIndex
from tandem.router.kv_subscriber import KVEventSubscriber
from tandem.router.ledger import Ledger
from tandem.router.reservations import ReservationTable

logger = logging.getLogger(__name__)

#: From this many workers, a newer registry list in which only the workers' loads changed is taken
#: in the background, ``UPDATE_SLICE_S`` at a time between other work; smaller fleets take it at once.
#: Measured (2026-12-05, the fleet benchmark, 1,000 SIMULATED workers): taking the ~500 records a
#: refresh brings in one go held the Schedule that found them for 0.38 ms on average, up to 2.5 ms,
#: and every Schedule queued behind it.
SLICED_UPDATE_MIN_WORKERS = 256
UPDATE_SLICE_S = 0.0002
_UPDATE_CHUNK = 32


class WorkerView(Protocol):
    async def workers(self) -> list[WorkerRecord]: ...


class FreshWorkerView(WorkerView, Protocol):
    """A view that can also read the registry now (:class:`tandem.router.worker_view.CachedWorkerView`)."""

    async def workers_now(self, key: str = "") -> list[WorkerRecord]: ...

    def still_unknown(self, key: str) -> None: ...


class WorkerIntake:
    """Owns the worker list decisions use and its fleet table. Not thread-safe."""

    def __init__(
        self,
        view: WorkerView,
        budget: BudgetConfig,
        reservations: ReservationTable,
        index: KVIndex,
        subscriber: KVEventSubscriber | None,
        ledger: Ledger | None,
        on_new_list: Callable[[], None],
    ) -> None:
        self._view = view
        #: The same view where it can read the registry on demand (a model missing from its list).
        self._fresh_view: FreshWorkerView | None = (
            view if hasattr(view, "workers_now") and hasattr(view, "still_unknown") else None  # type: ignore[assignment]
        )
        self._budget = budget
        self._reservations = reservations
        self._index = index
        self._subscriber = subscriber
        self._ledger = ledger
        #: Called when a newer list is taken (new reports, maybe new workers: budget may have freed).
        self._on_new_list = on_new_list
        self.last_workers: list[WorkerRecord] | None = None
        #: A newer list being taken in the background (:meth:`_take_in_slices`).
        self.taking: asyncio.Task[None] | None = None
        #: The last worker list as arrays (rebuilt when the list changes).
        self.fleet: FleetTable | None = None

    async def workers_for(self, model: str) -> list[WorkerRecord]:
        """The list decisions use, read again from the registry when it has no worker of ``model``."""
        workers = await self.workers()
        fleet = self.fleet
        if fleet is not None and not fleet.serves(model) and self._fresh_view is not None:
            # No worker of this model in the cached list: it may have registered since the last read.
            fresh = await self._fresh_view.workers_now(model)
            if fresh is not self.last_workers:
                if self.taking is not None:
                    self.taking.cancel()  # an older list's loads: this one is newer
                    self.taking = None
                workers = self._take(fresh)
            if self.fleet is None or not self.fleet.serves(model):
                self._fresh_view.still_unknown(model)
        return workers

    def model_label(self, model: str) -> str:
        """The model as a metric label only when a live worker serves it: a caller's name adds no label
        value (so a model whose pools are both at zero is labelled "")."""
        fleet = self.fleet
        return model if fleet is not None and fleet.serves(model) else ""

    async def refresh(self) -> None:
        """Read the registry (through the view's cache); returns once the list read is the one
        decisions use."""
        await self.workers()
        if self.taking is not None:
            await asyncio.shield(self.taking)

    async def workers(self) -> list[WorkerRecord]:
        workers = await self._view.workers()
        if workers is self.last_workers:
            return workers
        if self.taking is not None and not self.taking.done():
            assert self.last_workers is not None
            return self.last_workers  # a newer list is being taken in the background
        fleet = self.fleet
        if (
            fleet is not None
            and self.last_workers is not None
            and len(workers) >= SLICED_UPDATE_MIN_WORKERS
            and len(workers) == len(fleet.workers)
        ):
            self.taking = asyncio.get_running_loop().create_task(self._take_in_slices(workers, fleet))
            return self.last_workers
        return self._take(workers)

    def _take(self, workers: list[WorkerRecord]) -> list[WorkerRecord]:
        """Make ``workers`` the list decisions use, at once."""
        self.last_workers = workers
        self._on_new_list()
        if self.fleet is not None and self.fleet.update(workers):
            return workers  # only loads changed: the same workers, the same KV-event publishers
        self.fleet = self._build_fleet(workers)
        if self._subscriber is not None:
            self._subscriber.sync(workers)
        else:
            live = {w.worker_id for w in workers}
            for worker_id in self._index.workers():
                if worker_id not in live:
                    self._index.remove_worker(worker_id)
        return workers

    async def _take_in_slices(self, workers: list[WorkerRecord], fleet: FleetTable) -> None:
        """Take a large fleet's newer list a slice at a time (see ``SLICED_UPDATE_MIN_WORKERS``):
        decisions meanwhile use the list they had, its workers' loads updated as they are reached. A
        list whose workers changed, not only their loads, is taken at once."""
        try:
            slice_end_s = time.perf_counter() + UPDATE_SLICE_S
            positions: list[int] = []
            for start in range(0, len(workers), _UPDATE_CHUNK):
                found = fleet.changed_positions(workers, start, start + _UPDATE_CHUNK)
                if found is None:
                    self._take(workers)
                    return
                positions += found
                if time.perf_counter() >= slice_end_s:
                    await asyncio.sleep(0)
                    slice_end_s = time.perf_counter() + UPDATE_SLICE_S
                    if self.fleet is not fleet:
                        return  # replaced meanwhile: the next read starts afresh
            for start in range(0, len(positions), _UPDATE_CHUNK):
                fleet.take_records(workers, positions[start : start + _UPDATE_CHUNK])
                if time.perf_counter() >= slice_end_s:
                    await asyncio.sleep(0)
                    slice_end_s = time.perf_counter() + UPDATE_SLICE_S
                    if self.fleet is not fleet:
                        return
            fleet.workers = workers
            self.last_workers = workers
            self._on_new_list()
        except Exception:  # the next read tries again; decisions keep the list they have
            logger.exception("taking the registry's newer worker list failed")

    def _build_fleet(self, workers: Sequence[WorkerRecord]) -> FleetTable:
        return FleetTable.build(workers, self._budget, self._reservations, self._ledger)

    def fleet_for(self, workers: Sequence[WorkerRecord]) -> FleetTable:
        """The fleet table of ``workers``, brought up to date with every reservation change since the
        last decision (this replica's and the other replicas')."""
        fleet = self.fleet
        if fleet is None or fleet.workers is not workers:
            fleet = self.fleet = self._build_fleet(workers)
        fleet.refresh_own(self._reservations.drain_changed(), self._reservations)
        if self._ledger is not None:
            fleet.refresh_others(self._ledger.drain_changed(), self._ledger)
        return fleet
