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
(:mod:`tandem.router.ledger`, a few milliseconds old), corrected by what
the worker itself reported at its last heartbeat: reservations older than a
heartbeat should appear in the report, so where the worker reports less the
difference is drift (a finished prefill, a caller that never released) and
is not counted; on decode a report above the ledger (requests placed by a
replica that died) counts in full.

The formulas are numpy expressions (:func:`load_tokens`, :func:`fits`,
:func:`busy_fraction`, :func:`kv_fullness`) that take one worker's numbers or
a whole pool's arrays alike: :class:`BudgetView` applies them to one worker,
:class:`tandem.router.fleet.FleetTable` to every worker of a pool at once, so
the two can never disagree.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from tandem.common.registry import ROLE_DECODE, WorkerRecord
from tandem.router.reservations import ReservationTable

#: A number or an array of them (one per worker of a pool).
Num = TypeVar("Num", float, npt.NDArray[np.float64])


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


# -- the formulas, for one worker or a whole pool ---------------------------------------------


def load_tokens(*, decode: bool, own: Num, own_young: Num, others: Num, others_young: Num, reported: Num) -> Num:
    """Budget tokens in use on a worker: reservations (this replica's and the others'), where those
    older than a heartbeat are capped by what the worker reported; on decode a report above the
    ledger counts in full (requests of a replica that died). Prefill reports prompt tokens,
    cached ones included, so there the report is only a cap."""
    young = own_young + others_young
    old = own + others - young
    capped = young + np.minimum(old, reported)
    return np.maximum(capped, reported) if decode else capped  # type: ignore[no-any-return]


def fits(capacity_tokens: Num, load: Num, need_tokens: Num) -> Num:
    """1 where ``need_tokens`` more fit (an idle worker takes any request, so a prompt larger than the
    budget is not refused forever; capacity 0 means unknown: no limit), else 0."""
    ok = (capacity_tokens <= 0) | (load == 0) | (load + need_tokens <= capacity_tokens)
    return ok  # type: ignore[no-any-return]


def load_fraction(capacity_tokens: Num, load: Num) -> Num:
    """Share of the budget in use, in [0, 1] (0 when the capacity is unknown)."""
    capacity = np.asarray(capacity_tokens, np.float64)
    fraction = np.zeros(np.broadcast(capacity, load).shape)
    # Divided only where the capacity is known (no errstate: entering it cost more than the division).
    np.divide(load, capacity, out=fraction, where=capacity > 0)
    return np.minimum(fraction, 1.0, out=fraction)  # type: ignore[return-value]


def busy_fraction(capacity_tokens: Num, load: Num, recent_tokens: Num) -> Num:
    """:func:`load_fraction` plus the work placed on the worker lately (decayed), in [0, 1]: between
    requests nothing is in flight, and this still tells a worker that just computed a long prompt
    from one that sat idle, so cold prompts spread out."""
    return load_fraction(capacity_tokens, load + recent_tokens)


def kv_fullness(
    *, decode: bool, load_fraction_: Num, kv_usage: Num, num_indexed_blocks: Num | None, num_kv_blocks: Num
) -> Num:
    """How full the worker's KV cache is, in [0, 1]: decode from its reservations and its report,
    prefill from the blocks its KV events say it holds (its report when that is unknown)."""
    if decode:
        return np.minimum(1.0, np.maximum(load_fraction_, kv_usage))  # type: ignore[no-any-return]
    reported = np.minimum(1.0, np.maximum(0.0, kv_usage))
    if num_indexed_blocks is None:
        return reported  # type: ignore[no-any-return]
    with np.errstate(divide="ignore", invalid="ignore"):
        indexed = np.minimum(1.0, np.divide(num_indexed_blocks, num_kv_blocks))
    return np.where(num_kv_blocks > 0, indexed, reported)  # type: ignore[return-value]


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
    replicas' loads). The scheduler's fleet table computes the same for whole pools."""

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

    def recent_tokens(self, worker_id: str) -> float:
        return self._reservations.recent_tokens(worker_id)

    def capacity_tokens(self, worker: WorkerRecord) -> int:
        """The worker's budget; 0 means unknown (no limit)."""
        return capacity_tokens(worker, self._config)

    def load_tokens(self, worker: WorkerRecord) -> int:
        worker_id = worker.worker_id
        load = self._load_tokens.get(worker_id)
        if load is None:
            load = self._load_tokens[worker_id] = int(
                load_tokens(
                    decode=worker.role == ROLE_DECODE,
                    own=float(self._own_tokens.get(worker_id, 0)),
                    own_young=float(self._young_tokens.get(worker_id, 0)),
                    others=float(self._others.others_tokens(worker_id)),
                    others_young=float(self._others.others_young_tokens(worker_id)),
                    reported=float(reported_tokens(worker)),
                )
            )
        return load

    def need_tokens(self, worker: WorkerRecord, num_prompt_tokens: int, max_tokens: int) -> int:
        """Tokens the request would hold on ``worker``."""
        if worker.role == ROLE_DECODE:
            return num_prompt_tokens + max_tokens
        return max(0, num_prompt_tokens - self.cached_tokens.get(worker.worker_id, 0))

    def fits(self, worker: WorkerRecord, num_tokens: int) -> bool:
        """Budget left for ``num_tokens`` more (see :func:`fits`)."""
        return bool(fits(float(self.capacity_tokens(worker)), float(self.load_tokens(worker)), float(num_tokens)))

    def load_fraction(self, worker: WorkerRecord) -> float:
        return float(load_fraction(float(self.capacity_tokens(worker)), float(self.load_tokens(worker))))

    def busy_fraction(self, worker: WorkerRecord) -> float:
        """See :func:`busy_fraction`."""
        return float(
            busy_fraction(
                float(self.capacity_tokens(worker)),
                float(self.load_tokens(worker)),
                self._reservations.recent_tokens(worker.worker_id),
            )
        )

    def kv_fullness(self, worker: WorkerRecord) -> float:
        """See :func:`kv_fullness`."""
        indexed = None if self._num_indexed_blocks is None else float(self._num_indexed_blocks(worker.worker_id))
        return float(
            kv_fullness(
                decode=worker.role == ROLE_DECODE,
                load_fraction_=self.load_fraction(worker),
                kv_usage=float(worker.load.kv_usage),
                num_indexed_blocks=indexed,
                num_kv_blocks=float(worker.num_kv_blocks),
            )
        )
