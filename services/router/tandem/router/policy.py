"""Placement policies: filter → score → pick, one worker per role.

:class:`tandem.router.scheduler.Scheduler` calls :meth:`RoutingPolicy.choose`
once per role (prefill, then decode) for every Schedule RPC. Policies are
chosen by name from configuration (:func:`create_policy`); they see plain
:class:`~tandem.common.registry.WorkerRecord` values and a :class:`LoadView`
of this replica's reservations, and call nothing else.

The scheduler passes a :class:`tandem.router.budget.BudgetView` as the load
view: the shared filter then also drops workers without token budget left.
``cache_aware`` (the default) scores prefix locality, token load and KV
headroom, each in [0, 1], weighted by :class:`CacheAwareWeights`; see
``services/router/README.md``.

Adding a policy: subclass :class:`RoutingPolicy`, override
:meth:`~RoutingPolicy.score`, register it in :data:`POLICIES`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from pydantic import BaseModel, Field

from tandem.common.registry import ROLE_DECODE, WorkerRecord
from tandem.router.budget import BudgetView


@dataclass(frozen=True)
class ScheduleRequest:
    """A ``tandem.v1.ScheduleRequest`` decoded from the wire by the deployment:
    what the scheduler and the policies see."""

    request_id: str
    model: str
    num_prompt_tokens: int = 0
    max_tokens: int = 0
    tenant: str = ""
    prompt_token_ids: tuple[int, ...] = ()
    cache_salt: str = ""
    #: The prompt's block hashes per engine hashing configuration (block size, hash seed), as the
    #: gateway sends them instead of the token ids; when empty, hashed here from the token ids.
    prompt_block_hashes: Mapping[tuple[int, str], Sequence[int]] = field(default_factory=dict)
    #: Workers to avoid, e.g. one that just failed this request.
    exclude_worker_ids: frozenset[str] = frozenset()
    #: Admission priority class ("" = the tenant's or the default class).
    priority: str = ""
    #: Place a decode worker only: the prefill already ran on this worker, which holds the KV (a dead
    #: decode worker's replacement); decode budget only, and the placement's prefill names this worker.
    #: "": a normal Schedule.
    prefill_done_on_worker_id: str = ""

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens or len(self.prompt_token_ids)


class LoadView(Protocol):
    """This replica's own view of the load it has placed (see ReservationTable)."""

    def num_in_flight(self, worker_id: str) -> int:
        """Requests this replica placed on ``worker_id`` and that are neither released nor expired."""
        ...


@dataclass(frozen=True)
class ScoredWorker:
    """A candidate and its score in [0, 1] (higher is better)."""

    worker: WorkerRecord
    score: float


class RoutingPolicy(ABC):
    """Chooses one worker of a role for a request.

    Methods are called in the replica's event loop, synchronously, on every
    Schedule: they must not block or do I/O. :meth:`pick` may update the
    policy's own rotation state; :meth:`filter` and :meth:`score` must be free
    of side effects.
    """

    #: Name used in configuration (``TANDEM_ROUTER_POLICY``).
    name: ClassVar[str]

    def __init__(self) -> None:
        self._num_picks_by_role: dict[str, int] = {}

    def choose(
        self, request: ScheduleRequest, role: str, workers: Sequence[WorkerRecord], load: LoadView
    ) -> ScoredWorker | None:
        """The worker of ``role`` for ``request``, or None when no worker passes the filter."""
        candidates = self.filter(request, role, workers, load)
        if not candidates:
            return None
        return self.pick(role, [ScoredWorker(w, self.score(request, w, load)) for w in candidates])

    def filter(
        self, request: ScheduleRequest, role: str, workers: Sequence[WorkerRecord], load: LoadView
    ) -> list[WorkerRecord]:
        """Workers that may take ``request`` at all: right role, right model, not
        excluded, and (with a :class:`BudgetView`) token budget left."""
        candidates = [
            w
            for w in workers
            if w.role == role and w.model == request.model and w.worker_id not in request.exclude_worker_ids
        ]
        if isinstance(load, BudgetView):
            n = request.num_tokens
            candidates = [w for w in candidates if load.fits(w, load.need_tokens(w, n, request.max_tokens))]
        return candidates

    @abstractmethod
    def score(self, request: ScheduleRequest, worker: WorkerRecord, load: LoadView) -> float:
        """How good ``worker`` is for ``request``, in [0, 1] (1 is best)."""

    def pick(self, role: str, scored: Sequence[ScoredWorker]) -> ScoredWorker:
        """The best-scored worker; ties rotate, so equal workers share the traffic."""
        best_score = max(s.score for s in scored)
        tied = sorted((s for s in scored if s.score == best_score), key=lambda s: s.worker.worker_id)
        num_picks = self._num_picks_by_role.get(role, 0)
        self._num_picks_by_role[role] = num_picks + 1
        return tied[num_picks % len(tied)]


def reported_load(worker: WorkerRecord) -> int:
    """Requests the worker's engine said it runs or queues at its last heartbeat."""
    return worker.load.num_running_requests + worker.load.num_waiting_requests


class LeastLoadedPolicy(RoutingPolicy):
    """Balance: prefer the worker with the fewest requests.

    The load of a worker is the larger of this replica's in-flight count
    (fresh, but blind to other router replicas) and the engine-reported count
    (sees everyone, but a heartbeat old). Among equal loads the lower reported
    count wins, then the rotation in :meth:`RoutingPolicy.pick`.
    """

    name = "least_loaded"

    #: Weight of the reported-load tiebreak; below 1 so it never outweighs one whole request.
    _TIEBREAK_WEIGHT = 0.5

    def score(self, request: ScheduleRequest, worker: WorkerRecord, load: LoadView) -> float:
        num_reported = reported_load(worker)
        num_effective = max(load.num_in_flight(worker.worker_id), num_reported)
        tiebreak = self._TIEBREAK_WEIGHT * num_reported / (1 + num_reported)
        return 1.0 / (1.0 + num_effective + tiebreak)


class RoundRobinPolicy(RoutingPolicy):
    """Every candidate scores the same, so :meth:`RoutingPolicy.pick` rotates through them."""

    name = "round_robin"

    def score(self, request: ScheduleRequest, worker: WorkerRecord, load: LoadView) -> float:
        return 1.0


class CacheAwareWeights(BaseModel):
    """Scorer weights of ``cache_aware`` (``TANDEM_ROUTER_WEIGHTS__PREFIX_LOCALITY=...``)."""

    #: Affinity: share of the prompt already in the worker's prefix cache (prefill only).
    prefix_locality: float = Field(3.0, ge=0)
    #: Balance: 1 - (budget tokens in flight + tokens placed lately, decayed) / budget.
    token_load: float = Field(1.0, ge=0)
    #: Balance: 1 - how full the worker's KV cache is.
    kv_headroom: float = Field(0.5, ge=0)


class CacheAwarePolicy(RoutingPolicy):
    """Prefer the worker that already holds the longest prefix of the prompt.

    The locality weight outweighs both balance scorers together, so a request
    stays on its cache-warm worker until that worker's budget is spent (the
    filter then drops it) and only then spreads; cold requests go where the
    load and the KV cache are lightest. Without a :class:`BudgetView` (unit
    tests of other seams) every scorer reads as neutral.
    """

    name = "cache_aware"

    def __init__(self, weights: CacheAwareWeights | None = None) -> None:
        super().__init__()
        self.weights = weights or CacheAwareWeights()

    def scorers(self, request: ScheduleRequest, worker: WorkerRecord, load: LoadView) -> dict[str, float]:
        """Each scorer's value in [0, 1] (for tests and the placement reason)."""
        locality, token_load, kv_headroom = self._scorers(request, worker, load)
        return {"prefix_locality": locality, "token_load": token_load, "kv_headroom": kv_headroom}

    @staticmethod
    def _scorers(request: ScheduleRequest, worker: WorkerRecord, load: LoadView) -> tuple[float, float, float]:
        if not isinstance(load, BudgetView):
            return 0.0, 1.0, 1.0
        num_tokens = request.num_tokens
        locality = 0.0
        if worker.role != ROLE_DECODE and num_tokens:
            locality = min(1.0, load.cached_tokens.get(worker.worker_id, 0) / num_tokens)
        return locality, 1.0 - load.busy_fraction(worker), 1.0 - load.kv_fullness(worker)

    #: Share of the score given to fewer requests in flight: breaks ties between workers
    #: whose token scores are equal (e.g. requests without prompt tokens), never more.
    _TIEBREAK = 0.01

    def score(self, request: ScheduleRequest, worker: WorkerRecord, load: LoadView) -> float:
        w = self.weights
        locality, token_load, kv_headroom = self._scorers(request, worker, load)
        w_locality = 0.0 if worker.role == ROLE_DECODE else w.prefix_locality
        total = w_locality + w.token_load + w.kv_headroom
        weighted = 1.0
        if total > 0:
            weighted = (w_locality * locality + w.token_load * token_load + w.kv_headroom * kv_headroom) / total
        fewer_in_flight = 1.0 / (1.0 + load.num_in_flight(worker.worker_id))
        return (1.0 - self._TIEBREAK) * weighted + self._TIEBREAK * fewer_in_flight


#: Policies by configuration name.
POLICIES: Mapping[str, Callable[[CacheAwareWeights], RoutingPolicy]] = {
    LeastLoadedPolicy.name: lambda _weights: LeastLoadedPolicy(),
    RoundRobinPolicy.name: lambda _weights: RoundRobinPolicy(),
    CacheAwarePolicy.name: CacheAwarePolicy,
}

DEFAULT_POLICY = CacheAwarePolicy.name


def create_policy(name: str, weights: CacheAwareWeights | None = None) -> RoutingPolicy:
    """A fresh policy by configuration name; ValueError names the known ones."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
    return factory(weights or CacheAwareWeights())
