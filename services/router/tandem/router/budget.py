"""Token budgets: how many tokens each worker may still take.

The budget's formulas are :func:`tandem.router.kernels.budget_state` (load, busy and KV fullness per
worker) and :func:`tandem.router.kernels.eligible` (the filter), their only implementation; this
module holds what they are computed from. :class:`tandem.router.fleet.FleetTable` keeps those
numbers for every worker of a pool in arrays (the scheduler's path); :class:`BudgetView` reads them
one worker at a time from a reservation table and the other replicas' loads, for tests, tools and
the pools' gauges, into the same kernel.

* Prefill capacity is a number of *uncached prompt tokens in flight*
  (``prefill_tokens_in_flight``): what the engine must compute, not what it
  reads from its prefix cache, so cache hits stay cheap.
* Decode capacity is the engine's KV cache (``block_size_tokens x
  num_kv_blocks`` from its registry record) times ``decode_kv_fraction``;
  a request holds prompt plus ``max_tokens``.

Load on a worker = this replica's reservations (exact) + the other replicas'
(:mod:`tandem.router.ledger`, a few milliseconds old), corrected by what
the worker itself reported at its last heartbeat: reservations older than a
heartbeat should appear in the report, so where the worker reports less the
difference is drift (a finished prefill, a caller that never released) and
is not counted; on decode a report above the ledger (requests placed by a
replica that died) counts in full.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from tandem.common.registry import ROLE_DECODE, WorkerRecord
from tandem.router import kernels
from tandem.router.kernels import F64
from tandem.router.reservations import ReservationTable

#: No block counts from the KV index; no exclusions.
_NO_INDEX = np.zeros(0, np.int64)


class OtherReplicas(Protocol):
    def others_tokens(self, worker_id: str) -> int:
        """Budget tokens the other live router replicas hold on ``worker_id``."""
        ...

    def others_young_tokens(self, worker_id: str) -> int:
        """The part of :meth:`others_tokens` too recent for the worker's report to show."""
        ...


class NoOtherReplicas:
    def others_tokens(self, worker_id: str) -> int:
        return 0

    def others_young_tokens(self, worker_id: str) -> int:
        return 0


@dataclass(frozen=True)
class BudgetConfig:
    #: Uncached prompt tokens a prefill worker may have in flight.
    prefill_tokens_in_flight: int = 16_384
    #: Share of a decode worker's KV cache the router fills with reservations.
    decode_kv_fraction: float = 0.9


def capacity_tokens(worker: WorkerRecord, config: BudgetConfig) -> int:
    """The worker's budget; 0 means unknown (no limit)."""
    if worker.role == ROLE_DECODE:
        return int(worker.capacity_tokens * config.decode_kv_fraction)
    return config.prefill_tokens_in_flight


def reported_tokens(worker: WorkerRecord) -> int:
    """What the worker says it has in flight, in its role's budget unit."""
    if worker.role == ROLE_DECODE:
        return worker.load.num_kv_tokens_in_flight
    return worker.load.num_prompt_tokens_in_flight


class BudgetView:
    """Budgets of one decision, one worker at a time (reads the reservation table and the other
    replicas' loads once per worker, then :func:`tandem.router.kernels.budget_state`). The
    scheduler's fleet table computes the same for whole pools."""

    def __init__(
        self,
        reservations: ReservationTable,
        config: BudgetConfig,
        others: OtherReplicas | None = None,
        cached_tokens: Mapping[str, int] | None = None,
        num_indexed_blocks: Callable[[str], int] | None = None,
    ) -> None:
        self._reservations = reservations
        self._config = config
        self._others = others or NoOtherReplicas()
        # One decision asks about each worker several times: read the table once, memoize budgets.
        self._own_tokens, self._young_tokens = reservations.token_snapshot()
        self._budgets: dict[str, tuple[F64, kernels.Records]] = {}
        #: Prompt tokens cached per worker for the request being placed.
        self.cached_tokens: Mapping[str, int] = cached_tokens or {}
        self._num_indexed_blocks = num_indexed_blocks

    def num_in_flight(self, worker_id: str) -> int:
        return self._reservations.num_in_flight(worker_id)

    def recent_tokens(self, worker_id: str) -> float:
        return self._reservations.recent_tokens(worker_id)

    def capacity_tokens(self, worker: WorkerRecord) -> int:
        """The worker's budget; 0 means unknown (no limit)."""
        return capacity_tokens(worker, self._config)

    def budgets(self, decode: bool, workers: Sequence[WorkerRecord]) -> tuple[F64, kernels.Records]:
        """Capacities and budgets of ``workers`` (one role), in order."""
        n = len(workers)

        def column(values: Iterable[float]) -> F64:
            return np.fromiter(values, np.float64, count=n)

        ids = [w.worker_id for w in workers]
        reservations, others = self._reservations, self._others
        numbers = np.zeros(n, kernels.WORKER_NUMBERS)
        numbers["capacity_tokens"] = column(capacity_tokens(w, self._config) for w in workers)
        numbers["reported_tokens"] = column(reported_tokens(w) for w in workers)
        numbers["kv_usage"] = column(w.load.kv_usage for w in workers)
        numbers["num_kv_blocks"] = column(w.num_kv_blocks for w in workers)
        numbers["own_tokens"] = column(self._own_tokens.get(i, 0) for i in ids)
        numbers["own_young_tokens"] = column(self._young_tokens.get(i, 0) for i in ids)
        numbers["own_in_flight"] = column(reservations.num_in_flight(i) for i in ids)
        # Decayed to now already: at_s = now_s = 0 multiplies them by exactly 1. (The others' recent
        # tokens and requests are the fleet table's, not this view's.)
        numbers["recent_tokens"] = column(reservations.recent_tokens(i) for i in ids)
        numbers["others_tokens"] = column(others.others_tokens(i) for i in ids)
        numbers["others_young_tokens"] = column(others.others_young_tokens(i) for i in ids)
        numbers["index_slot"] = np.arange(n)
        indexed = _NO_INDEX
        if not decode and self._num_indexed_blocks is not None:
            indexed = np.fromiter(map(self._num_indexed_blocks, ids), np.int64, count=n)
        out = np.empty(n, kernels.BUDGETS)
        kernels.budget_state(decode, numbers, 0.0, 1.0, indexed, out)
        return numbers["capacity_tokens"], out

    def _one(self, worker: WorkerRecord) -> tuple[F64, kernels.Records]:
        found = self._budgets.get(worker.worker_id)
        if found is None:
            found = self._budgets[worker.worker_id] = self.budgets(worker.role == ROLE_DECODE, [worker])
        return found

    def load_tokens(self, worker: WorkerRecord) -> int:
        return int(self._one(worker)[1]["load_tokens"][0])

    def need_tokens(self, worker: WorkerRecord, num_prompt_tokens: int, max_tokens: int) -> int:
        """Tokens the request would hold on ``worker``."""
        if worker.role == ROLE_DECODE:
            return num_prompt_tokens + max_tokens
        return max(0, num_prompt_tokens - self.cached_tokens.get(worker.worker_id, 0))

    def fits(self, worker: WorkerRecord, num_tokens: int) -> bool:
        """Budget left for ``num_tokens`` more (see :func:`tandem.router.kernels.eligible`)."""
        capacity, budgets = self._one(worker)
        ok = np.empty(1, np.bool_)
        # As a decode need (the prompt plus nothing): num_tokens exactly, whatever the role.
        kernels.eligible(True, float(num_tokens), 0.0, capacity, budgets["load_tokens"], np.zeros(1), _NO_INDEX, ok)
        return bool(ok[0])

    def load_fraction(self, worker: WorkerRecord) -> float:
        return float(self._one(worker)[1]["load_fraction"][0])

    def busy_fraction(self, worker: WorkerRecord) -> float:
        """See :data:`tandem.router.kernels.BUDGETS`."""
        return float(self._one(worker)[1]["busy_fraction"][0])

    def kv_fullness(self, worker: WorkerRecord) -> float:
        """See :data:`tandem.router.kernels.BUDGETS`."""
        return float(self._one(worker)[1]["kv_fullness"][0])
