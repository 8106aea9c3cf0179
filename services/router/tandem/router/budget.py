"""Token budgets: how many tokens each worker may still take.

:class:`tandem.router.scheduler.Scheduler` builds a :class:`BudgetView` for
every decision; the policies (:mod:`tandem.router.policy`) filter on
:meth:`BudgetView.fits` and score on :meth:`BudgetView.busy_fraction` and
:meth:`BudgetView.kv_fullness` (the cache-aware policy) or the number of
requests in flight (least-loaded).

* Prefill capacity is a number of *uncached prompt tokens in flight*
  (``prefill_tokens_in_flight``): what the engine must compute, not what it
  reads from its prefix cache, so cache hits stay cheap.
* Decode capacity is the engine's KV cache (``block_size_tokens x
  num_kv_blocks`` from its registry record) times ``decode_kv_fraction``;
  a request holds prompt plus ``max_tokens``.

Load on a worker = this replica's reservations (exact) + the other replicas'
(:mod:`tandem.router.replica_sync`, a sync interval old), corrected by what
the worker itself reported at its last heartbeat: reservations older than a
heartbeat should appear in the report, so where the worker reports less the
difference is drift (a finished prefill, a caller that never released) and
is not counted; on decode a report above the ledger (requests placed by a
replica that died) counts in full.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from tandem.common.registry import ROLE_DECODE, WorkerRecord
from tandem.router.reservations import ReservationTable


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


class BudgetView:
    """Budgets of one decision (reads the reservation table and the other replicas' loads)."""

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
        # One decision asks about each worker several times: read the table once, memoize loads.
        self._own_tokens, self._young_tokens = reservations.token_snapshot()
        self._load_tokens: dict[str, int] = {}
        #: Prompt tokens cached per worker for the request being placed.
        self.cached_tokens: Mapping[str, int] = cached_tokens or {}
        self._num_indexed_blocks = num_indexed_blocks

    def num_in_flight(self, worker_id: str) -> int:
        return self._reservations.num_in_flight(worker_id)

    def capacity_tokens(self, worker: WorkerRecord) -> int:
        """The worker's budget; 0 means unknown (no limit)."""
        if worker.role == ROLE_DECODE:
            return int(worker.capacity_tokens * self._config.decode_kv_fraction)
        return self._config.prefill_tokens_in_flight

    def load_tokens(self, worker: WorkerRecord) -> int:
        worker_id = worker.worker_id
        load = self._load_tokens.get(worker_id)
        if load is not None:
            return load
        own_young = self._young_tokens.get(worker_id, 0)
        others_young = self._others.others_young_tokens(worker_id)
        young = own_young + others_young
        old = (
            self._own_tokens.get(worker_id, 0) - own_young + self._others.others_tokens(worker_id) - others_young
        )
        if worker.role == ROLE_DECODE:
            reported = worker.load.num_kv_tokens_in_flight
            load = max(young + min(old, reported), reported)
        else:
            # Prefill reports prompt tokens, cached ones included: only a cap on old reservations.
            load = young + min(old, worker.load.num_prompt_tokens_in_flight)
        self._load_tokens[worker_id] = load
        return load

    def need_tokens(self, worker: WorkerRecord, num_prompt_tokens: int, max_tokens: int) -> int:
        """Tokens the request would hold on ``worker``."""
        if worker.role == ROLE_DECODE:
            return num_prompt_tokens + max_tokens
        return max(0, num_prompt_tokens - self.cached_tokens.get(worker.worker_id, 0))

    def fits(self, worker: WorkerRecord, num_tokens: int) -> bool:
        """Budget left for ``num_tokens`` more; an idle worker takes any request, so a
        prompt larger than the budget is not refused forever."""
        capacity = self.capacity_tokens(worker)
        if capacity <= 0:
            return True
        load = self.load_tokens(worker)
        return load == 0 or load + num_tokens <= capacity

    def load_fraction(self, worker: WorkerRecord) -> float:
        capacity = self.capacity_tokens(worker)
        if capacity <= 0:
            return 0.0
        return min(1.0, self.load_tokens(worker) / capacity)

    def busy_fraction(self, worker: WorkerRecord) -> float:
        """:meth:`load_fraction` plus the work placed on the worker lately (decayed), in [0, 1]:
        between requests nothing is in flight, and this still tells a worker that just
        computed a long prompt from one that sat idle, so cold prompts spread out."""
        capacity = self.capacity_tokens(worker)
        if capacity <= 0:
            return 0.0
        recent = self._reservations.recent_tokens(worker.worker_id)
        return min(1.0, (self.load_tokens(worker) + recent) / capacity)

    def kv_fullness(self, worker: WorkerRecord) -> float:
        """How full the worker's KV cache is, in [0, 1]: decode from its reservations
        and its report, prefill from the blocks its KV events say it holds."""
        if worker.role == ROLE_DECODE:
            return min(1.0, max(self.load_fraction(worker), worker.load.kv_usage))
        if worker.num_kv_blocks <= 0 or self._num_indexed_blocks is None:
            return min(1.0, max(0.0, worker.load.kv_usage))
        return min(1.0, self._num_indexed_blocks(worker.worker_id) / worker.num_kv_blocks)
