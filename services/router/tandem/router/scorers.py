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

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            if cls.name in SCORERS:
                raise ValueError(f"a scorer named {cls.name!r} exists already: {SCORERS[cls.name].__qualname__}")
            SCORERS[cls.name] = cls

    @abstractmethod
    def scores(self, request: ScheduleRequest, pool: PoolArrays) -> F64:
        """One value in [0, 1] per worker of ``pool`` (in the pool's order)."""


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
