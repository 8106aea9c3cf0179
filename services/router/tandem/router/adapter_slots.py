"""LoRA adapter slots as the router sees them: which workers can serve an adapter request, which
hold its adapter now, which have a free slot, and what this replica placed there lately.

A worker reports ``WorkerRecord.max_adapters`` (vLLM's ``max_loras``; 0: LoRA off) and
``WorkerRecord.adapters`` (engine names loaded now, least recently used first) at every heartbeat,
so the record lags a placement by up to a heartbeat plus the router's registry refresh. Without
help, a burst for a cold adapter would then load it on every worker (each decision sees "not
resident anywhere" and spreads by load). :class:`AdapterOverlay` closes that gap: the placer notes
every adapter placement (:meth:`AdapterOverlay.placed`), and for :data:`OVERLAY_S` after it this
replica treats the adapter as loaded on that worker, most recently used, evicting the worker's
least recently used one when its slots are full, exactly as vLLM's LRU cache of adapters does.
After that the record shows it (or shows that the worker evicted it since). Other replicas learn
of it from the record only: at most one load per replica per burst.

Who calls what: :class:`tandem.router.fleet.FleetTable` keeps a :class:`PoolAdapters` per pool in
step with the records (slots, adapters loaded, which workers hold each adapter: updated for the
records a heartbeat changed, not per decision); :class:`tandem.router.placement.Placer` hands its
overlay to each pool of an adapter request (:attr:`tandem.router.pool.PoolArrays.overlay`); the
filter (:meth:`tandem.router.policy.RoutingPolicy.eligible`) keeps the workers with
:attr:`AdapterColumns.capable`, and :class:`tandem.router.scorers.AdapterAffinity` scores
:attr:`AdapterColumns.resident` and :attr:`AdapterColumns.free_slot`. Base-model requests (adapter
"") never build these columns. An adapter request's columns cost a few numpy operations plus one
Python step per holder of the adapter and per worker with overlay entries (a 1,000-worker pool read
record by record took ~315 us on this host; from :class:`PoolAdapters`, microseconds).

A worker's record that names garbage (an adapter list longer than its slots, names that are not
engine names) is read as it is: more names than slots count as full, an unknown name is simply not
the request's. A worker that dies takes its overlay entries with it at expiry; nothing here does
I/O or raises.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from tandem.common.registry import WorkerRecord

#: How long a placement counts as loading the adapter on its worker before the worker's record must
#: show it: the workers' heartbeat (1 s by default, ``RegistrySettings.heartbeat_interval_s``), the
#: router's registry refresh (0.5 s) and the load itself (vLLM reports an adapter once loaded),
#: with room to spare.
OVERLAY_S = 5.0

#: Entries kept at most (oldest dropped first): a bound on memory under any burst.
MAX_OVERLAY_ENTRIES = 100_000

Bools = npt.NDArray[np.bool_]
F64 = npt.NDArray[np.float64]


@dataclass(frozen=True)
class AdapterColumns:
    """Per worker of one pool, for one adapter (in the pool's order)."""

    #: LoRA on (``max_adapters`` > 0): the only workers an adapter request may go to.
    capable: Bools
    #: The adapter is loaded there (its record, or a placement of this replica not yet in it).
    resident: Bools
    #: Fewer adapters loaded than slots: loading this one evicts nothing.
    free_slot: Bools


@dataclass
class PoolAdapters:
    """What a pool's records say of adapters, per worker (in the pool's order), kept in step in place."""

    #: ``max_adapters`` and how many adapters are loaded.
    slots: F64
    num_loaded: F64
    #: Engine name -> positions of the workers whose record lists it.
    holders: dict[str, set[int]]

    @classmethod
    def build(cls, workers: Sequence[WorkerRecord]) -> PoolAdapters:
        n = len(workers)
        holders: dict[str, set[int]] = {}
        for i, w in enumerate(workers):
            for name in w.adapters:
                holders.setdefault(name, set()).add(i)
        return cls(
            slots=np.fromiter((w.max_adapters for w in workers), np.float64, n),
            num_loaded=np.fromiter((len(w.adapters) for w in workers), np.float64, n),
            holders=holders,
        )

    def update(self, i: int, old: WorkerRecord, new: WorkerRecord) -> None:
        """Position ``i``'s record changed from ``old`` to ``new``."""
        self.slots[i] = new.max_adapters
        self.num_loaded[i] = len(new.adapters)
        if old.adapters == new.adapters:
            return
        for name in old.adapters:
            positions = self.holders.get(name)
            if positions is not None:
                positions.discard(i)
                if not positions:
                    del self.holders[name]
        for name in new.adapters:
            self.holders.setdefault(name, set()).add(i)


class AdapterOverlay:
    """This replica's adapter placements of the last :data:`OVERLAY_S` (see the module docstring).
    Not thread-safe; used from the replica's event loop."""

    def __init__(self, ttl_s: float = OVERLAY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        #: (worker id, engine name) -> when placed, in placement order (oldest first).
        self._placed: dict[tuple[str, str], float] = {}
        #: worker id -> its entries' engine names, in placement order (oldest first).
        self._by_worker: dict[str, dict[str, float]] = {}

    def __len__(self) -> int:
        return len(self._placed)

    def placed(self, worker_id: str, adapter: str) -> None:
        """A request for ``adapter`` was placed on ``worker_id`` now (it loads or uses it)."""
        if not adapter:
            return
        now_s = self._clock()
        self._expire(now_s)
        key = (worker_id, adapter)
        self._placed.pop(key, None)
        self._placed[key] = now_s
        entries = self._by_worker.setdefault(worker_id, {})
        entries.pop(adapter, None)
        entries[adapter] = now_s
        if len(self._placed) > MAX_OVERLAY_ENTRIES:
            (old_worker, old_adapter), _ = next(iter(self._placed.items()))
            self._forget(old_worker, old_adapter)

    def loaded(self, worker: WorkerRecord) -> tuple[str, ...]:
        """The adapters ``worker`` holds as this replica believes, least recently used first: its
        record's, then this replica's recent placements there moved to the end, the oldest dropped
        beyond its slots (vLLM's LRU)."""
        entries = self._by_worker.get(worker.worker_id)
        if not entries:
            return worker.adapters
        horizon_s = self._clock() - self.ttl_s
        recent = [name for name, at_s in entries.items() if at_s > horizon_s]
        if not recent:
            return worker.adapters
        order = [name for name in worker.adapters if name not in entries or entries[name] <= horizon_s]
        order.extend(recent)
        slots = worker.max_adapters
        return tuple(order[-slots:]) if 0 < slots < len(order) else tuple(order)

    def columns(
        self,
        workers: Sequence[WorkerRecord],
        adapter: str,
        positions: Mapping[str, int] | None = None,
        records: PoolAdapters | None = None,
    ) -> AdapterColumns:
        """:class:`AdapterColumns` of ``workers`` for ``adapter``; ``positions`` (worker id -> position)
        and ``records`` (:class:`PoolAdapters` of ``workers``) are built here when not given."""
        if records is None:
            records = PoolAdapters.build(workers)
        capable = records.slots > 0
        resident = np.zeros(len(workers), np.bool_)
        for i in records.holders.get(adapter, ()):
            resident[i] = True
        resident &= capable
        free_slot = records.num_loaded < records.slots
        if self._by_worker:
            if positions is None:
                positions = {w.worker_id: i for i, w in enumerate(workers)}
            for worker_id in self._by_worker:
                j = positions.get(worker_id)
                if j is None:
                    continue
                loaded = self.loaded(workers[j])
                resident[j] = capable[j] and adapter in loaded
                free_slot[j] = len(loaded) < records.slots[j]
        return AdapterColumns(capable, resident, free_slot)

    def _expire(self, now_s: float) -> None:
        horizon_s = now_s - self.ttl_s
        while self._placed:
            (worker_id, adapter), at_s = next(iter(self._placed.items()))
            if at_s > horizon_s:
                return
            self._forget(worker_id, adapter)

    def _forget(self, worker_id: str, adapter: str) -> None:
        self._placed.pop((worker_id, adapter), None)
        entries = self._by_worker.get(worker_id)
        if entries is not None:
            entries.pop(adapter, None)
            if not entries:
                del self._by_worker[worker_id]


def record_columns(
    workers: Sequence[WorkerRecord], adapter: str, records: PoolAdapters | None = None
) -> AdapterColumns:
    """:class:`AdapterColumns` from the workers' records alone (no overlay)."""
    return _NO_OVERLAY.columns(workers, adapter, None, records)


#: An overlay nothing is ever placed in.
_NO_OVERLAY = AdapterOverlay()
