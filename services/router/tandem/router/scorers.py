"""Scorers: the "score" of filter → score → pick, one class each.

:class:`tandem.router.policy.CacheAwarePolicy` asks each configured scorer for one value per worker
of a pool, in [0, 1] (1 is best), and adds them up by the weights of
:class:`tandem.router.policy.CacheAwareWeights` (in :func:`tandem.router.kernels.weighted_scores`).
As in llm-d's router, each scorer says which kind it is: *affinity* (where this request's data
already is), *balance* (how loaded a worker is), or *distribution* (spreading for its own sake).

Adding a scorer is one class and one line of configuration::

    class SameZone(Scorer):
        name = "same_zone"  # its weight: TANDEM_ROUTER_WEIGHTS__SAME_ZONE=2
        kind = "affinity"

        def scores(self, request, pool):
            return np.array([1.0 if zone_of(w) == "a" else 0.0 for w in pool.workers])

A subclass registers itself under its ``name`` (see :data:`SCORERS`); the policy builds every
scorer whose weight is above 0 (a ``decode_<name>`` weight, where set, replaces ``<name>``'s on
decode pools). ``tests/unit/router/test_scorers.py`` adds one and sees placement change.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar, Literal

import numpy as np

from tandem.router.pool import F64, PoolArrays

if TYPE_CHECKING:  # policy.py builds the scorers
    from tandem.router.policy import ScheduleRequest

ScorerKind = Literal["affinity", "balance", "distribution"]

#: Scorer classes by configuration name (every subclass of :class:`Scorer` with a name).
SCORERS: dict[str, type[Scorer]] = {}


class Scorer(ABC):
    """How good each worker of a pool is for one request, in [0, 1] (1 is best).

    Called by the policy in the replica's event loop, synchronously, on every Schedule, once per
    pool (decode, then prefill): no I/O, no side effects, and a few numpy operations over the pool's
    arrays (:class:`~tandem.router.pool.PoolArrays`) rather than a Python call per worker (pools
    hold up to ~1,000 workers). Built with no arguments."""

    #: Configuration name: the weight's field in :class:`~tandem.router.policy.CacheAwareWeights`.
    name: ClassVar[str]
    kind: ClassVar[ScorerKind]
    #: Its weight where configuration names none (0: off unless configured).
    default_weight: ClassVar[float] = 0.0

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            if cls.name in SCORERS:
                raise ValueError(f"a scorer named {cls.name!r} exists already: {SCORERS[cls.name].__qualname__}")
            SCORERS[cls.name] = cls

    @abstractmethod
    def scores(self, request: ScheduleRequest, pool: PoolArrays) -> F64:
        """One value in [0, 1] per worker of ``pool`` (in the pool's order)."""

    def applies(self, request: ScheduleRequest) -> bool:
        """Whether this scorer counts for ``request`` at all (False: it is left out of the weighted
        mean, weight and all, as if its weight were 0)."""
        return True


class PrefixLocality(Scorer):
    """Affinity: the share of the prompt already in the worker's prefix cache (prefill), or that the
    decode worker already holds (fewer KV bytes to pull, and a follow-up turn whose prompt it mostly
    holds runs there alone). 0 without budgets or a token count."""

    name = "prefix_locality"
    kind = "affinity"

    def scores(self, request: ScheduleRequest, pool: PoolArrays) -> F64:
        num_tokens = request.num_tokens
        if not pool.has_budget or not num_tokens:
            return np.zeros(len(pool))
        return np.minimum(1.0, pool.cached_tokens / num_tokens)


class TokenLoad(Scorer):
    """Balance: 1 - (budget tokens in flight + tokens placed lately, decayed) / budget (1 without
    budgets)."""

    name = "token_load"
    kind = "balance"

    def scores(self, request: ScheduleRequest, pool: PoolArrays) -> F64:
        if not pool.has_budget:
            return np.ones(len(pool))
        return 1.0 - pool.busy_fraction


class KVHeadroom(Scorer):
    """Balance: 1 - how full the worker's KV cache is (1 without budgets)."""

    name = "kv_headroom"
    kind = "balance"

    def scores(self, request: ScheduleRequest, pool: PoolArrays) -> F64:
        if not pool.has_budget:
            return np.ones(len(pool))
        return 1.0 - pool.kv_fullness


class AdapterAffinity(Scorer):
    """Affinity for LoRA requests: 1 where the request's adapter is loaded (the worker's record, or a
    placement of this replica that its record does not show yet, :mod:`tandem.router.adapter_slots`),
    :attr:`FREE_SLOT` where loading it evicts nothing, 0 where it evicts the worker's least recently
    used adapter. Its weight (:attr:`default_weight`, 2) is above what the two balance scorers can differ by
    between a loaded worker and one that must evict (1.5), so a popular adapter stays on the workers
    that hold it until the filter drops them for budget, and only then spreads; between a loaded
    worker and a free slot it is half that, so a loaded worker much busier than an empty one gives
    way. A rare adapter is never filtered out: it takes a free slot, or evicts where the load is
    lightest. Base-model requests skip this scorer (:meth:`applies`), so their scores are unchanged.
    Prefill and decode pools alike: both engines apply the adapter."""

    name = "adapter_affinity"
    kind = "affinity"
    default_weight = 2.0

    #: Score of a worker with a free adapter slot (no eviction) that does not hold the adapter.
    FREE_SLOT = 0.5

    def applies(self, request: ScheduleRequest) -> bool:
        return bool(request.adapter)

    def scores(self, request: ScheduleRequest, pool: PoolArrays) -> F64:
        columns = pool.adapter_columns(request.adapter)
        return np.where(columns.resident, 1.0, np.where(columns.free_slot, self.FREE_SLOT, 0.0))
