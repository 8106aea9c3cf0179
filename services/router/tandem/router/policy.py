"""Placement policies: filter → score → pick, one worker per role.

:class:`tandem.router.scheduler.Scheduler` calls :meth:`RoutingPolicy.choose_in` once per role
(decode, then prefill unless the decode worker prefills alone) for every Schedule, with the role's
pool as arrays (:class:`tandem.router.pool.PoolArrays`, kept by :mod:`tandem.router.fleet`):

* **filter**: :func:`tandem.router.kernels.eligible`, the token budget left and the request's
  excluded workers (shared by every policy);
* **score**: the policy's :meth:`RoutingPolicy.scores`, in [0, 1] per worker; ``cache_aware`` (the
  default) adds up its scorers (:mod:`tandem.router.scorers`: prefix locality, token load, KV
  headroom, and any a deployment adds) by the weights of :class:`CacheAwareWeights`;
* **pick**: :func:`tandem.router.kernels.pick`, the best score, where ties (within
  :meth:`RoutingPolicy.tolerance`) go to the highest rendezvous hash of (request id, worker id):
  equal workers share the traffic, and every router replica picks the same worker for the same
  request, with no shared state.

Filter and pick are compiled and each scorer is a few numpy operations, so a decision costs about
the same at 10 workers or 1,000 (see :mod:`tandem.router.kernels` for the figures).
:meth:`RoutingPolicy.choose` and :meth:`RoutingPolicy.score` take a plain worker list and a load view
instead (tests, tools), and build the same arrays one worker at a time. Policies are chosen by name
from configuration (:func:`create_policy`) and call nothing else; see ``services/router/README.md``.

Adding a policy: subclass :class:`RoutingPolicy`, override :meth:`~RoutingPolicy.scores`, register
it in :data:`POLICIES`. Adding a scorer to ``cache_aware``: :mod:`tandem.router.scorers`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field, model_validator

from tandem.common.registry import WorkerRecord
from tandem.router import kernels
from tandem.router.pool import F64, PoolArrays, request_key
from tandem.router.scorers import SCORERS, Scorer


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
    #: Place a decode worker that prefills the prompt itself (a local prefill's replacement: nothing was
    #: streamed, no prefill worker holds KV): decode budget only, a local prefill whatever the threshold.
    local_prefill_only: bool = False
    #: The LoRA adapter the request names: its engine name (``NAME@VERSION``, tandem.common.adapters);
    #: "": the base model. Placed only on workers with LoRA on, preferring those that hold it.
    adapter: str = ""

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens or len(self.prompt_token_ids)


class LoadView(Protocol):
    """This replica's own view of the load it has placed (see ReservationTable)."""

    def num_in_flight(self, worker_id: str) -> int:
        """Requests this replica placed on ``worker_id`` and that are neither released nor expired."""
        ...


#: A request that avoids no worker.
_NO_EXCLUSIONS: npt.NDArray[np.int64] = np.zeros(0, np.int64)


@dataclass(frozen=True)
class ScoredWorker:
    """A candidate and its score in [0, 1] (higher is better)."""

    worker: WorkerRecord
    score: float
    #: Its index in the pool it was chosen from (-1: unknown).
    position: int = -1


class RoutingPolicy(ABC):
    """Chooses one worker of a role for a request.

    Methods are called in the replica's event loop, synchronously, on every
    Schedule: they must not block or do I/O. :meth:`pick` may update the
    policy's own rotation state; :meth:`eligible` and :meth:`scores` must be free
    of side effects.
    """

    #: Name used in configuration (``TANDEM_ROUTER_POLICY``).
    name: ClassVar[str]

    def __init__(self) -> None:
        self._num_picks_by_role: dict[str, int] = {}

    # -- over a pool's arrays (the scheduler) ------------------------------------------------

    def choose_in(self, request: ScheduleRequest, pool: PoolArrays) -> ScoredWorker | None:
        """The worker of ``pool`` for ``request``, or None when none passes the filter."""
        ok = self.eligible(request, pool)
        scores = self.scores(request, pool)
        i = self.pick(request, pool, scores, ok)
        if i < 0:
            return None
        return ScoredWorker(pool.workers[i], float(scores[i]), i)

    def eligible(self, request: ScheduleRequest, pool: PoolArrays) -> npt.NDArray[np.bool_]:
        """Workers that may take ``request`` at all: not excluded, and token budget left (the pool
        holds the right role and model already)."""
        excluded = _NO_EXCLUSIONS
        if request.exclude_worker_ids:
            positions = (pool.position(worker_id) for worker_id in request.exclude_worker_ids)
            excluded = np.fromiter((i for i in positions if i is not None), np.int64)
        ok = np.empty(len(pool), np.bool_)
        kernels.eligible(
            pool.is_decode,
            float(request.num_tokens),
            float(request.max_tokens),
            pool.capacity_tokens,
            pool.load_tokens,
            pool.cached_tokens,
            excluded,
            ok,
        )
        if request.adapter:
            ok &= pool.adapter_columns(request.adapter).capable
        return ok

    @abstractmethod
    def scores(self, request: ScheduleRequest, pool: PoolArrays) -> F64:
        """How good each worker of ``pool`` is for ``request``, in [0, 1] (1 is best)."""

    #: Scores closer than this to the best count as a tie (0: only equal scores).
    tie_tolerance: ClassVar[float] = 0.0

    def tolerance(self, request: ScheduleRequest, pool: PoolArrays) -> float:
        """How close to the best score counts as a tie for this decision (:attr:`tie_tolerance`)."""
        return self.tie_tolerance

    def pick(self, request: ScheduleRequest, pool: PoolArrays, scores: F64, ok: npt.NDArray[np.bool_]) -> int:
        """The best-scored of the ``ok`` workers (-1: none); a tie (within :meth:`tolerance`) goes to
        the highest rendezvous hash of the request and worker ids, the same in every replica."""
        key = np.uint64(request_key(request.request_id))
        return int(kernels.pick(ok, scores, self.tolerance(request, pool), pool.worker_keys, key))

    # -- over a worker list (tests, tools) ----------------------------------------------------

    def choose(
        self, request: ScheduleRequest, role: str, workers: Sequence[WorkerRecord], load: LoadView
    ) -> ScoredWorker | None:
        """The worker of ``role`` for ``request``, or None when no worker passes the filter."""
        return self.choose_in(request, PoolArrays.from_view(role, request.model, workers, load))

    def filter(
        self, request: ScheduleRequest, role: str, workers: Sequence[WorkerRecord], load: LoadView
    ) -> list[WorkerRecord]:
        """Workers that may take ``request`` at all: right role, right model, not
        excluded, and (with a :class:`BudgetView`) token budget left."""
        pool = PoolArrays.from_view(role, request.model, workers, load)
        ok = self.eligible(request, pool)
        return [w for w, fits in zip(pool.workers, ok, strict=True) if fits]

    def score(self, request: ScheduleRequest, worker: WorkerRecord, load: LoadView) -> float:
        """How good ``worker`` is for ``request``, in [0, 1] (1 is best)."""
        pool = PoolArrays.from_view(worker.role, worker.model, [worker], load)
        return float(self.scores(request, pool)[0])


def reported_load(worker: WorkerRecord) -> int:
    """Requests the worker's engine said it runs or queues at its last heartbeat."""
    return worker.load.num_running_requests + worker.load.num_waiting_requests


class LeastLoadedPolicy(RoutingPolicy):
    """Balance: prefer the worker with the fewest requests.

    The load of a worker is the larger of the in-flight count the router knows (fresh, and every
    replica's where the replicas share their reservations) and the engine-reported count (sees
    everyone, but a heartbeat old). Among equal loads the lower reported count wins, then the
    rendezvous tie-break in :meth:`RoutingPolicy.pick`.
    """

    name = "least_loaded"

    #: Weight of the reported-load tiebreak; below 1 so it never outweighs one whole request.
    _TIEBREAK_WEIGHT = 0.5

    def scores(self, request: ScheduleRequest, pool: PoolArrays) -> F64:
        reported = pool.num_reported_requests
        effective = np.maximum(pool.num_in_flight, reported)
        tiebreak = self._TIEBREAK_WEIGHT * reported / (1.0 + reported)
        return 1.0 / (1.0 + effective + tiebreak)


class RoundRobinPolicy(RoutingPolicy):
    """Every candidate scores the same, and picks rotate through them in worker-id order."""

    name = "round_robin"

    def scores(self, request: ScheduleRequest, pool: PoolArrays) -> F64:
        return np.ones(len(pool))

    def pick(self, request: ScheduleRequest, pool: PoolArrays, scores: F64, ok: npt.NDArray[np.bool_]) -> int:
        ordered = sorted((int(i) for i in np.flatnonzero(ok)), key=lambda i: pool.workers[i].worker_id)
        if not ordered:
            return -1
        num_picks = self._num_picks_by_role.get(pool.role, 0)
        self._num_picks_by_role[pool.role] = num_picks + 1
        return ordered[num_picks % len(ordered)]


class CacheAwareWeights(BaseModel):
    """Scorer weights of ``cache_aware`` by scorer name (``TANDEM_ROUTER_WEIGHTS__PREFIX_LOCALITY=...``).

    A scorer runs where its weight is above 0; ``decode_<name>``, where set, is ``<name>``'s weight
    on decode pools. A scorer added to :mod:`tandem.router.scorers` is configured by one more weight
    of its name (an extra field, e.g. ``TANDEM_ROUTER_WEIGHTS__SAME_ZONE=2``)."""

    model_config = ConfigDict(extra="allow")

    #: Affinity: share of the prompt already in the prefill worker's prefix cache.
    prefix_locality: float = Field(3.0, ge=0)
    #: Affinity on decode: share of the prompt the decode worker already holds (fewer KV bytes to pull,
    #: and a follow-up turn whose prompt it mostly holds runs there alone, with no handoff).
    decode_prefix_locality: float = Field(1.0, ge=0)
    #: Balance: 1 - (budget tokens in flight + tokens placed lately, decayed) / budget.
    token_load: float = Field(1.0, ge=0)
    #: Balance: 1 - how full the worker's KV cache is.
    kv_headroom: float = Field(0.5, ge=0)
    # Scorers with a default weight of their own (Scorer.default_weight: adapter_affinity, 2) run
    # unless a weight of their name here says otherwise (TANDEM_ROUTER_WEIGHTS__ADAPTER_AFFINITY=0).

    @model_validator(mode="after")
    def _extra_weights_name_scorers(self) -> CacheAwareWeights:
        extra = self.__pydantic_extra__ or {}
        for name, weight in extra.items():
            if name.removeprefix("decode_") not in SCORERS:
                raise ValueError(f"no scorer named {name!r}; known: {', '.join(sorted(SCORERS))}")
            extra[name] = value = float(weight)  # from the environment it is a string
            if not value >= 0:
                raise ValueError(f"the weight of {name!r} must be >= 0, not {weight!r}")
        return self

    def by_role(self, decode: bool) -> dict[str, float]:
        """Scorer name → weight on one kind of pool, in configuration order (built-ins first); scorers
        with a default weight that configuration does not name are not listed (see :meth:`in_effect`)."""
        weights = {**self.model_dump(), **(self.model_extra or {})}
        by_name: dict[str, float] = {}
        for name, weight in weights.items():
            if name.startswith("decode_"):
                continue
            by_name[name] = float(weights.get(f"decode_{name}", weight) if decode else weight)
        return by_name

    def in_effect(self, decode: bool) -> dict[str, float]:
        """:meth:`by_role`, then every scorer with a default weight (:attr:`Scorer.default_weight`) that
        configuration does not name, at that weight."""
        by_name = self.by_role(decode)
        for name, scorer in SCORERS.items():
            if scorer.default_weight > 0 and name not in by_name:
                by_name[name] = scorer.default_weight
        return by_name


@dataclass(frozen=True)
class _WeightedScorers:
    """The scorers of one kind of pool with a weight above 0, and their weights in the same order."""

    scorers: tuple[Scorer, ...]
    weights: F64
    #: Per subset of the scorers that apply to a request (as a mask), that subset (built once).
    _subsets: dict[tuple[bool, ...], _WeightedScorers] = field(default_factory=dict, compare=False)

    @classmethod
    def build(cls, weights: Mapping[str, float]) -> _WeightedScorers:
        # A weight of 0 adds exactly nothing to the weighted sum (nor to the total): skipped.
        chosen = [(SCORERS[name](), w) for name, w in weights.items() if w > 0]
        return cls(tuple(s for s, _ in chosen), np.array([w for _, w in chosen], np.float64))

    def for_request(self, request: ScheduleRequest) -> _WeightedScorers:
        """The scorers that apply to ``request`` (:meth:`Scorer.applies`), in the same order."""
        mask = tuple(s.applies(request) for s in self.scorers)
        if all(mask):
            return self
        subset = self._subsets.get(mask)
        if subset is None:
            kept = [k for k, keep in enumerate(mask) if keep]
            subset = _WeightedScorers(tuple(self.scorers[k] for k in kept), self.weights[kept].copy())
            self._subsets[mask] = subset
        return subset


class CacheAwarePolicy(RoutingPolicy):
    """Prefer the worker that already holds the longest prefix of the prompt.

    On prefill the locality weight outweighs both balance scorers together, so a request
    stays on its cache-warm worker until that worker's budget is spent (the filter then
    drops it) and only then spreads; cold requests go where the load and the KV cache are
    lightest. On decode, locality weighs as much as token load (``decode_prefix_locality``):
    a conversation's next turn returns to the decode worker holding its history unless that
    worker is much busier. Without budgets (a plain load view) every scorer reads as neutral.
    """

    name = "cache_aware"

    #: A score moves by (tokens / budget) x its weight with every placement: differences below a few
    #: requests' worth say nothing about which worker is better, and deciding on them made router
    #: replicas that see each other's placements a few milliseconds late disagree (the fleet benchmark:
    #: 49 % agreement with exact ties, the decode workers' scores within 0.001 of each other; 95 % with
    #: 0.02). Near-equal workers then share the traffic by the rendezvous tie-break.
    tie_tolerance: ClassVar[float] = 0.02

    def tolerance(self, request: ScheduleRequest, pool: PoolArrays) -> float:
        """:attr:`tie_tolerance` where token scores say something; 0 where they cannot (a request
        without a token count, a pool without budgets): there only the in-flight counts differ, by
        less than the tolerance, and they decide exactly (fewest in flight wins)."""
        if request.num_tokens == 0 or not pool.has_budget:
            return 0.0
        return self.tie_tolerance

    def __init__(self, weights: CacheAwareWeights | None = None) -> None:
        super().__init__()
        self.weights = weights or CacheAwareWeights()
        self._prefill = _WeightedScorers.build(self.weights.in_effect(decode=False))
        self._decode = _WeightedScorers.build(self.weights.in_effect(decode=True))

    def scorers(self, request: ScheduleRequest, worker: WorkerRecord, load: LoadView) -> dict[str, float]:
        """Each scorer's value in [0, 1] for one worker (for tests and the placement reason)."""
        pool = PoolArrays.from_view(worker.role, worker.model, [worker], load)
        weighted = (self._decode if pool.is_decode else self._prefill).for_request(request)
        return {s.name: float(s.scores(request, pool)[0]) for s in weighted.scorers}

    #: Share of the score given to fewer requests in flight: breaks ties between workers
    #: whose token scores are equal (requests without prompt tokens, pools without budgets:
    #: :meth:`tolerance` is 0 there), never more.
    _TIEBREAK = 0.01

    def scores(self, request: ScheduleRequest, pool: PoolArrays) -> F64:
        weighted = (self._decode if pool.is_decode else self._prefill).for_request(request)
        rows = np.empty((len(weighted.scorers), len(pool)))
        for k, scorer in enumerate(weighted.scorers):
            rows[k] = scorer.scores(request, pool)
        out = np.empty(len(pool))
        kernels.weighted_scores(rows, weighted.weights, pool.num_in_flight, self._TIEBREAK, out)
        return out


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
