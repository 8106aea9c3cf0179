"""A decision's hot loops, compiled: one native call where numpy or Python took dozens of steps.

The profile behind it (2026-12-04, ``benchmarks/router_fleet.py --skip-replicas --skip-fairness``
with timing wrappers, 1,000 SIMULATED workers, 10 M indexed entries): a decision p50 1.00 ms, of
which :meth:`tandem.router.fleet.FleetTable.arrays` 2 x 144 us and the cache-aware policy's filter,
scores and pick (:meth:`tandem.router.policy.RoutingPolicy.choose_in`) 2 x 154 us, nearly all of it
the fixed cost of ~60 numpy calls on pools of 250 and 750 workers, not the arithmetic. The same
formulas as :mod:`tandem.router.budget` and :class:`tandem.router.policy.CacheAwarePolicy`, one
worker at a time in one loop, in the same order of operations, so that every sum and quotient is
the one numpy computes (``tests/unit/router/test_kernels.py`` compares both paths on random pools,
bit for bit, and the fleet tests compare the arrays with the one-worker-at-a-time budget view).

Compiled by numba when this module is imported (the signatures are explicit: nothing compiles
during a Schedule), and cached on disk beside the module where that is writable (numba's own
fallback: ``NUMBA_CACHE_DIR`` or the user's cache folder; the router image compiles them at build
time); with no writable place at all they are compiled at every start (~1 s), not cached.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
from numba import njit

F64 = npt.NDArray[np.float64]

_F = TypeVar("_F", bound=Callable[..., Any])


def _compiled(signature: str) -> Callable[[_F], _F]:
    """``njit`` with an explicit signature, cached on disk when numba finds a writable place."""

    def decorate(function: _F) -> _F:
        try:
            return njit(signature, cache=True, nogil=True)(function)  # type: ignore[no-any-return]
        except RuntimeError:  # "cannot cache function ...: no locator available": read-only everywhere
            return njit(signature, cache=False, nogil=True)(function)  # type: ignore[no-any-return]

    return decorate


# The rendezvous rank of tandem.router.pool.tie_order (kept beside it: numba's disk cache is keyed on
# this file alone, so a constant read from pool.py could change without a recompile). The kernel
# tests' tie cases fail if the two ever differ.
_MIX = np.uint64(0x9E3779B97F4A7C15)
_SHIFT = np.uint64(29)

_POOL_STATE_SIG = (
    "void(boolean, f8[::1], f8[::1], f8[::1], f8[::1], f8[::1], f8[::1], f8[::1], f8[::1], f8[::1], f8[::1],"
    " f8, f8, f8[::1], i8[::1], i8[::1], boolean, f8[::1], f8[::1], f8[::1], f8[::1], f8[::1], f8[::1],"
    " f8[::1])"
)


@_compiled(_POOL_STATE_SIG)
def pool_state(
    decode: bool,
    own: F64,
    own_young: F64,
    others: F64,
    others_young: F64,
    reported: F64,
    capacity: F64,
    recent_tokens: F64,
    recent_at_s: F64,
    others_recent_tokens: F64,
    others_recent_at_s: F64,
    now_s: float,
    half_life_s: float,
    kv_usage: F64,
    num_blocks_by_slot: npt.NDArray[np.int64],
    index_slots: npt.NDArray[np.int64],
    has_indexed: bool,
    num_kv_blocks: F64,
    own_in_flight: F64,
    others_in_flight: F64,
    load_out: F64,
    recent_out: F64,
    kv_fullness_out: F64,
    in_flight_out: F64,
) -> None:
    """Per worker: budget tokens in use (:func:`~tandem.router.budget.load_tokens`), tokens placed
    lately decayed to ``now_s``, KV fullness (:func:`~tandem.router.budget.kv_fullness`; with
    ``has_indexed``, from the blocks the KV index counts at the worker's slot), requests in flight
    (this replica's and the others')."""
    for i in range(own.shape[0]):
        in_flight_out[i] = own_in_flight[i] + others_in_flight[i]
        young = own_young[i] + others_young[i]
        old = own[i] + others[i] - young
        capped = young + min(old, reported[i])
        load = max(capped, reported[i]) if decode else capped
        load_out[i] = load
        recent_out[i] = recent_tokens[i] * np.exp2((recent_at_s[i] - now_s) / half_life_s) + others_recent_tokens[
            i
        ] * np.exp2((others_recent_at_s[i] - now_s) / half_life_s)
        if decode:
            fraction = min(load / capacity[i], 1.0) if capacity[i] > 0 else 0.0
            kv_fullness_out[i] = min(1.0, max(fraction, kv_usage[i]))
        elif has_indexed and num_kv_blocks[i] > 0:
            kv_fullness_out[i] = min(1.0, np.float64(num_blocks_by_slot[index_slots[i]]) / num_kv_blocks[i])
        else:
            kv_fullness_out[i] = min(1.0, max(0.0, kv_usage[i]))


_CHOOSE_SIG = (
    "Tuple((i8, f8))(boolean, f8, f8, f8[::1], f8[::1], f8[::1], f8[::1], f8[::1], f8[::1], u8[::1],"
    " i8[::1], f8, f8, f8, f8, f8, u8)"
)


@_compiled(_CHOOSE_SIG)
def cache_aware_choose(
    decode: bool,
    num_tokens: float,
    max_tokens: float,
    capacity: F64,
    load: F64,
    recent: F64,
    kv_fullness: F64,
    num_in_flight: F64,
    cached_tokens: F64,
    worker_keys: npt.NDArray[np.uint64],
    excluded: npt.NDArray[np.int64],
    w_locality: float,
    w_token_load: float,
    w_kv_headroom: float,
    tiebreak: float,
    tolerance: float,
    request_key: np.uint64,
) -> tuple[int, float]:
    """:class:`~tandem.router.policy.CacheAwarePolicy`'s filter, scores and pick over a pool with
    budgets: (position, score) of the chosen worker, (-1, 0) when none fits. ``excluded``: positions
    the request must avoid."""
    n = capacity.shape[0]
    scores = np.empty(n)
    eligible = np.ones(n, np.bool_)
    for j in range(excluded.shape[0]):
        eligible[excluded[j]] = False
    total = w_locality + w_token_load + w_kv_headroom
    best = -np.inf
    for i in range(n):
        need = num_tokens + max_tokens if decode else max(0.0, num_tokens - cached_tokens[i])
        if not (capacity[i] <= 0 or load[i] == 0 or load[i] + need <= capacity[i]):
            eligible[i] = False
        locality = min(1.0, cached_tokens[i] / num_tokens) if num_tokens else 0.0
        busy = min((load[i] + recent[i]) / capacity[i], 1.0) if capacity[i] > 0 else 0.0
        weighted = 1.0
        if total > 0:
            token_load = 1.0 - busy
            kv_headroom = 1.0 - kv_fullness[i]
            weighted = (w_locality * locality + w_token_load * token_load + w_kv_headroom * kv_headroom) / total
        score = (1.0 - tiebreak) * weighted + tiebreak * (1.0 / (1.0 + num_in_flight[i]))
        scores[i] = score
        if eligible[i] and score > best:
            best = score
    if best == -np.inf:
        return -1, 0.0
    threshold = best - tolerance
    chosen = -1
    chosen_rank = np.uint64(0)
    for i in range(n):
        if eligible[i] and scores[i] >= threshold:
            mixed = (worker_keys[i] ^ request_key) * _MIX
            rank = mixed ^ (mixed >> _SHIFT)
            if chosen < 0 or rank > chosen_rank:
                chosen = i
                chosen_rank = rank
    return chosen, scores[chosen]


# -- the KV index (tandem.router.kv_index) ----------------------------------------------------


@_compiled("void(f8[::1], i8[::1], i8[::1], i8[::1], f8, f8)")
def credit_cached(
    out: F64,
    positions: npt.NDArray[np.int64],
    index_slots: npt.NDArray[np.int64],
    blocks_by_slot: npt.NDArray[np.int64],
    block_tokens: float,
    max_tokens: float,
) -> None:
    """Prompt tokens each of a pool's ``positions`` holds: its index slot's leading blocks times the
    block size, at most ``max_tokens`` (vLLM recomputes at least the last prompt token)."""
    for j in range(positions.shape[0]):
        p = positions[j]
        out[p] = min(blocks_by_slot[index_slots[p]] * block_tokens, max_tokens)
