"""The candidates of one role for one decision, as arrays: what the policies filter and score.

:class:`tandem.router.fleet.FleetTable` fills a :class:`PoolArrays` for every Schedule from arrays
it keeps in step with the registry, this replica's reservations and the other replicas' (a whole
pool in a few numpy operations: tens of microseconds at 1,000 workers);
:meth:`PoolArrays.from_view` builds one from a worker list and a
:class:`~tandem.router.budget.BudgetView` or any load view, one worker at a time (tests, small
lists). The policies (:mod:`tandem.router.policy`) read nothing else, so both paths score alike.
Pure data, no I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from tandem.common.registry import ROLE_DECODE, WorkerRecord
from tandem.router import budget as formulas

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


_MIX = np.uint64(0x9E3779B97F4A7C15)


def tie_order(worker_keys: U64, request_id: str) -> U64:
    """Rendezvous hashing: per worker, a pseudo-random rank for this request; the highest wins a tie.
    Equal workers share the traffic evenly, and every replica picks the same one."""
    mixed = (worker_keys ^ np.uint64(request_key(request_id))) * _MIX
    return mixed ^ (mixed >> np.uint64(29))


@dataclass
class PoolArrays:
    """Workers of one role (and model) with, per worker, what a decision reads. Arrays are float64."""

    role: str
    workers: Sequence[WorkerRecord]
    #: False when the caller has no budgets (a plain load view): scorers read neutral values.
    has_budget: bool
    capacity_tokens: F64
    load_tokens: F64
    recent_tokens: F64
    kv_fullness: F64
    #: Requests in flight on the worker: this replica's, plus the other replicas' where known.
    num_in_flight: F64
    #: Requests the worker's engine reported running or waiting at its last heartbeat.
    num_reported_requests: F64
    #: Prompt tokens of this request the worker holds in its prefix cache.
    cached_tokens: F64
    worker_keys: U64
    positions: Mapping[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.workers)

    @property
    def is_decode(self) -> bool:
        return self.role == ROLE_DECODE

    def need_tokens(self, num_prompt_tokens: int, max_tokens: int) -> F64:
        """Budget tokens the request would hold on each worker."""
        if self.is_decode:
            return np.full(len(self), float(num_prompt_tokens + max_tokens))
        return np.maximum(0.0, num_prompt_tokens - self.cached_tokens)

    def fits(self, need_tokens: F64) -> npt.NDArray[np.bool_]:
        if not self.has_budget:
            return np.ones(len(self), dtype=bool)
        return formulas.fits(self.capacity_tokens, self.load_tokens, need_tokens)  # type: ignore[return-value]

    def busy_fraction(self) -> F64:
        return formulas.busy_fraction(self.capacity_tokens, self.load_tokens, self.recent_tokens)

    def load_fraction(self) -> F64:
        return formulas.load_fraction(self.capacity_tokens, self.load_tokens)

    def position(self, worker_id: str) -> int | None:
        if self.positions:
            return self.positions.get(worker_id)
        for i, w in enumerate(self.workers):
            if w.worker_id == worker_id:
                return i
        return None

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
        :class:`~tandem.router.budget.BudgetView` gives budgets, any other view only in-flight counts."""
        members = [w for w in workers if w.role == role and w.model == model]
        n = len(members)
        budget = load if isinstance(load, formulas.BudgetView) else None
        cached = cached_tokens if cached_tokens is not None else (budget.cached_tokens if budget else {})

        def column(values: Sequence[float]) -> F64:
            return np.asarray(values, dtype=np.float64).reshape(n)

        return cls(
            role=role,
            workers=members,
            has_budget=budget is not None,
            capacity_tokens=column([budget.capacity_tokens(w) if budget else 0 for w in members]),
            load_tokens=column([budget.load_tokens(w) if budget else 0 for w in members]),
            recent_tokens=column([budget.recent_tokens(w.worker_id) if budget else 0.0 for w in members]),
            kv_fullness=column([budget.kv_fullness(w) if budget else 0.0 for w in members]),
            num_in_flight=column([load.num_in_flight(w.worker_id) for w in members]),
            num_reported_requests=column(
                [w.load.num_running_requests + w.load.num_waiting_requests for w in members]
            ),
            cached_tokens=column([cached.get(w.worker_id, 0) for w in members]),
            worker_keys=np.asarray([worker_key(w.worker_id) for w in members], dtype=np.uint64).reshape(n),
            positions={w.worker_id: i for i, w in enumerate(members)},
        )
