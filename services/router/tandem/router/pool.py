"""The candidates of one role for one decision, as arrays: what the policies filter and score.

:class:`tandem.router.fleet.FleetTable` fills a :class:`PoolArrays` for every Schedule from arrays
it keeps in step with the registry, this replica's reservations and the other replicas' (a whole
pool in one compiled call, :func:`tandem.router.kernels.budget_state`: microseconds at 1,000
workers); :meth:`PoolArrays.from_view` builds one from a worker list and a
:class:`~tandem.router.budget.BudgetView` or any load view, reading the view one worker at a time
(tests, small lists) into the same kernel. The policies (:mod:`tandem.router.policy`) and scorers
(:mod:`tandem.router.scorers`) read nothing else, so both paths score alike. Pure data, no I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from tandem.common.registry import ROLE_DECODE, WorkerRecord
from tandem.router.adapter_slots import AdapterColumns, AdapterOverlay, PoolAdapters, record_columns
from tandem.router.budget import BudgetView
from tandem.router.kernels import Records

F64 = npt.NDArray[np.float64]
U64 = npt.NDArray[np.uint64]


class InFlightView(Protocol):
    """The least a load view offers: this replica's in-flight count per worker."""

    def num_in_flight(self, worker_id: str) -> int: ...


def worker_key(worker_id: str) -> int:
    """A stable 64-bit key of a worker id (the same in every replica and process: ties between equal
    workers are broken by it, so that replicas agree without sharing any state)."""
    return int.from_bytes(hashlib.blake2b(worker_id.encode(), digest_size=8).digest(), "little")


def request_key(request_id: str) -> int:
    """A stable 64-bit key of a request id (see :func:`worker_key`)."""
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8, person=b"req").digest(), "little")


@dataclass
class PoolArrays:
    """Workers of one role (and model) with, per worker, what a decision reads. Arrays are float64,
    contiguous or (from the kernels' records) strided."""

    role: str
    workers: Sequence[WorkerRecord]
    #: False when the caller has no budgets (a plain load view): the budget columns are 0 (no limit)
    #: and the cache-aware scorers read neutral values.
    has_budget: bool
    #: The worker's budget; 0: unknown, no limit.
    capacity_tokens: F64
    load_tokens: F64
    recent_tokens: F64
    #: See :data:`tandem.router.kernels.BUDGETS`.
    busy_fraction: F64
    kv_fullness: F64
    #: Requests in flight on the worker: this replica's, plus the other replicas' where known.
    num_in_flight: F64
    #: Requests the worker's engine reported running or waiting at its last heartbeat.
    num_reported_requests: F64
    #: Prompt tokens of this request the worker holds in its prefix cache.
    cached_tokens: F64
    worker_keys: U64
    positions: Mapping[str, int] = field(default_factory=dict)
    #: This replica's recent adapter placements (:mod:`tandem.router.adapter_slots`), set by the placer;
    #: None: the workers' records alone.
    overlay: AdapterOverlay | None = None
    #: What the records say of adapters, kept by the fleet table (None: read from the records).
    adapters: PoolAdapters | None = None
    _adapter_columns: dict[str, AdapterColumns] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.workers)

    def adapter_columns(self, adapter: str) -> AdapterColumns:
        """Which workers can serve, hold, or have a free slot for ``adapter`` (an engine name), built
        once per pool and adapter: only adapter requests pay for it."""
        columns = self._adapter_columns.get(adapter)
        if columns is None:
            overlay = self.overlay
            if overlay is None:
                columns = record_columns(self.workers, adapter, self.adapters)
            else:
                columns = overlay.columns(self.workers, adapter, self.positions or None, self.adapters)
            self._adapter_columns[adapter] = columns
        return columns

    @property
    def is_decode(self) -> bool:
        return self.role == ROLE_DECODE

    def position(self, worker_id: str) -> int | None:
        if self.positions:
            return self.positions.get(worker_id)
        for i, w in enumerate(self.workers):
            if w.worker_id == worker_id:
                return i
        return None

    @classmethod
    def of_budgets(
        cls,
        role: str,
        workers: Sequence[WorkerRecord],
        capacity_tokens: F64,
        budgets: Records,
        num_reported_requests: F64,
        cached_tokens: F64,
        worker_keys: U64,
        positions: Mapping[str, int],
        adapters: PoolAdapters | None = None,
    ) -> PoolArrays:
        """A pool with budgets, from :func:`tandem.router.kernels.budget_state`'s output (its columns
        are views of the records)."""
        return cls(
            role=role,
            workers=workers,
            has_budget=True,
            capacity_tokens=capacity_tokens,
            load_tokens=budgets["load_tokens"],
            recent_tokens=budgets["recent_tokens"],
            busy_fraction=budgets["busy_fraction"],
            kv_fullness=budgets["kv_fullness"],
            num_in_flight=budgets["num_in_flight"],
            num_reported_requests=num_reported_requests,
            cached_tokens=cached_tokens,
            worker_keys=worker_keys,
            positions=positions,
            adapters=adapters,
        )

    @classmethod
    def from_view(
        cls,
        role: str,
        model: str,
        workers: Sequence[WorkerRecord],
        load: InFlightView,
        cached_tokens: Mapping[str, int] | None = None,
    ) -> PoolArrays:
        """The workers of ``role`` serving ``model``, one at a time from ``load``: a
        :class:`~tandem.router.budget.BudgetView` gives budgets (the same kernel as the fleet's),
        any other view only in-flight counts."""
        members = [w for w in workers if w.role == role and w.model == model]
        n = len(members)
        budget = load if isinstance(load, BudgetView) else None
        cached = cached_tokens if cached_tokens is not None else (budget.cached_tokens if budget else {})
        positions = {w.worker_id: i for i, w in enumerate(members)}
        num_reported_requests = np.array(
            [w.load.num_running_requests + w.load.num_waiting_requests for w in members], np.float64
        ).reshape(n)
        cached_column = np.array([cached.get(w.worker_id, 0) for w in members], np.float64).reshape(n)
        keys = np.array([worker_key(w.worker_id) for w in members], np.uint64).reshape(n)
        if budget is not None:
            capacity, budgets = budget.budgets(role == ROLE_DECODE, members)
            return cls.of_budgets(
                role, members, capacity, budgets, num_reported_requests, cached_column, keys, positions
            )
        zeros = np.zeros(n)
        return cls(
            role=role,
            workers=members,
            has_budget=False,
            capacity_tokens=zeros,
            load_tokens=zeros,
            recent_tokens=zeros,
            busy_fraction=zeros,
            kv_fullness=zeros,
            num_in_flight=np.array([load.num_in_flight(w.worker_id) for w in members], np.float64).reshape(n),
            num_reported_requests=num_reported_requests,
            cached_tokens=cached_column,
            worker_keys=keys,
            positions=positions,
        )
