"""The decision's formulas, compiled: the one implementation of the token budget, the filter, the
weighted score and the pick.

Who calls what: :meth:`tandem.router.fleet.FleetTable.arrays` and
:meth:`tandem.router.pool.PoolArrays.from_view` turn a pool's :data:`WORKER_NUMBERS` into its
:data:`BUDGETS` (:func:`budget_state`); :meth:`tandem.router.policy.RoutingPolicy.choose_in`
filters with :func:`eligible` and picks with :func:`pick`; :class:`tandem.router.policy.CacheAwarePolicy`
adds its scorers' rows up with :func:`weighted_scores` (the scorers themselves are plain numpy, one
class each: :mod:`tandem.router.scorers`); :func:`credit_cached` reads the KV index's match into
prompt tokens per worker. They call nothing. A pool's numbers go in and its budgets come out as
numpy record arrays (:data:`WORKER_NUMBERS`, :data:`BUDGETS`), one record per worker, read and written
by field name in the kernel, so a new column is one field of a dtype (and one line where
:mod:`tandem.router.fleet` keeps it), not a position in a signature string.

Why compiled, and why only compiled (issue 39, 2026-12-06). Until then the budget and score formulas
existed twice: numpy expressions in ``budget.py``/``policy.py`` and the same arithmetic again in a
numba kernel with 17 positional arguments. The numpy versions now live in
``tests/unit/router/test_kernels.py`` as the oracle the kernels are compared with, bit for bit, on
random pools. The figures behind keeping the compiler, one pool's share of a decision (20,000
calls on a fleet table of 250 decode and 750 prefill workers with 300 reservations, p50 in us, one
run of each on a shared 2-core host; a decision takes both pools):

=====================================  ===============  ===============
                                       decode (250)     prefill (750)
=====================================  ===============  ===============
numpy filter, scores, pick (oracle)    30.8             36.2
the fused 17-argument kernel (before)  5.9              8.4
filter, scorer classes, pick (now)     11.2             14.7
budget state, 24 arguments (before)    6.9              13.7
budget state, records (now)            6.6              14.3
=====================================  ===============  ===============

The numpy budget state measured 19-25 us per pool the same way. Numpy throughout would cost ~80 us
more per decision at p50, and more at p99 (~60 numpy calls per pool, each paying numpy's fixed cost
and each a point where the busy host preempts): the decision CPU p99 was 0.55 ms against the issue's
1 ms target, and the arrival p99 (1.30 ms, decisions queueing behind each other) grows with every
microsecond a decision holds the event loop. Splitting the fused kernel into a filter, plug-in
scorers (plain numpy, so that adding one needs no numba) and a pick costs ~11 us per decision; the
records cost nothing over positional arrays (a ``NamedTuple`` of 15 arrays did: numba types it in
Python at every call, +3 us).

The fleet benchmark (``benchmarks/router_fleet.py --skip-replicas --skip-fairness``: 1,000
SIMULATED workers, 10 M indexed blocks, 42.1 B per block, 250 schedules/s) on the same host, back to
back, the code before and after: one decision alone p50 0.105 -> 0.119 ms (the in-process harness:
0.10 -> 0.125 ms); under the open loop, on a quiet moment of the host (load 2.1), decision CPU p50
0.25 ms, p99 0.52 ms, and from arrival p99 1.19 ms; at loads of 8-64 from other work, decision CPU
p99 0.50-0.90 ms, still under the target, while the from-arrival p99 measured the host (3-200 ms).

A decision is ~0.1-0.5 ms of router CPU under a TTFT of hundreds of milliseconds, so these
microseconds matter to a user only through the router's throughput and its queueing at bursts (the
arrival p99 above); that, and the issue's ≤ 1 ms decision target, are what the compiler is kept for.

Compiled by numba when this module is imported and cached on disk (:mod:`tandem.router.jit`; ~1 s
at a start without the cache).
"""

from __future__ import annotations

import numba
import numpy as np
import numpy.typing as npt
from numba import types

from tandem.router.jit import native

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]

#: Per worker of one pool, one record: what its budget is computed from, the registry's numbers,
#: this replica's reservations and the other replicas' (:mod:`tandem.router.ledger`).
#: :class:`tandem.router.fleet.FleetTable` keeps a pool's records in step in place
#: (``numbers["own_tokens"][i] = ...``). A new column is one more field here.
WORKER_NUMBERS = np.dtype(
    [
        # The worker's budget (tandem.router.budget.capacity_tokens); 0: unknown, no limit.
        ("capacity_tokens", np.float64),
        # What the worker reported in flight at its last heartbeat, in its budget's unit.
        ("reported_tokens", np.float64),
        # Share of its KV cache the engine reported in use, and the cache's size.
        ("kv_usage", np.float64),
        ("num_kv_blocks", np.float64),
        # This replica's reservations: budget tokens, the part too young for a report to show, requests.
        ("own_tokens", np.float64),
        ("own_young_tokens", np.float64),
        ("own_in_flight", np.float64),
        # Budget tokens this replica placed lately, decayed as of recent_at_s.
        ("recent_tokens", np.float64),
        ("recent_at_s", np.float64),
        # The same, of the other live replicas.
        ("others_tokens", np.float64),
        ("others_young_tokens", np.float64),
        ("others_in_flight", np.float64),
        ("others_recent_tokens", np.float64),
        ("others_recent_at_s", np.float64),
        # The worker's slot in the KV index (0: none), where its block count is read.
        ("index_slot", np.int64),
    ]
)

#: Per worker, one record: what a decision reads of its budget (:func:`budget_state`'s output).
BUDGETS = np.dtype(
    [
        # Budget tokens in use: reservations, old ones capped by the worker's report (decode: a report
        # above them counts in full).
        ("load_tokens", np.float64),
        # Share of the budget in use, in [0, 1] (0 where the capacity is unknown).
        ("load_fraction", np.float64),
        # Tokens placed lately (this replica's and the others'), decayed to now.
        ("recent_tokens", np.float64),
        # Share of the budget in use or placed lately, in [0, 1]: between requests nothing is in
        # flight, and this still tells a worker that just computed a long prompt from one that sat idle.
        ("busy_fraction", np.float64),
        # How full the KV cache is, in [0, 1]: decode from its reservations and report, prefill from
        # the blocks the KV index counts (its report where the index has none).
        ("kv_fullness", np.float64),
        # Requests in flight: this replica's and the others'.
        ("num_in_flight", np.float64),
    ]
)

#: Arrays of :data:`WORKER_NUMBERS` and :data:`BUDGETS` records.
Records = npt.NDArray[np.void]

_WORKER_NUMBERS = numba.from_dtype(WORKER_NUMBERS)[::1]
_BUDGETS = numba.from_dtype(BUDGETS)[::1]
#: A pool's column: contiguous, or a field of a record array (strided).
_COLUMN = types.float64[:]


@native(types.void(types.boolean, _WORKER_NUMBERS, types.float64, types.float64, types.int64[::1], _BUDGETS))
def budget_state(
    decode: bool, numbers: Records, now_s: float, half_life_s: float, num_blocks_by_slot: I64, out: Records
) -> None:
    """``out[i]`` for every worker's ``numbers[i]``. ``num_blocks_by_slot``: the KV index's blocks per slot
    (prefill pools), empty when unknown.

    Reservations older than a heartbeat should appear in the worker's report, so where it reports
    less the difference is drift (a finished prefill, a caller that never released) and is not
    counted; on decode a report above the reservations (requests of a replica that died) counts in
    full. Prefill reports prompt tokens, cached ones included, so there the report is only a cap."""
    has_indexed = num_blocks_by_slot.shape[0] > 0
    for i in range(numbers.shape[0]):
        w, o = numbers[i], out[i]
        o.num_in_flight = w.own_in_flight + w.others_in_flight
        young = w.own_young_tokens + w.others_young_tokens
        old = w.own_tokens + w.others_tokens - young
        reported = w.reported_tokens
        capped = young + min(old, reported)
        load = max(capped, reported) if decode else capped
        o.load_tokens = load
        # tandem.router.decay.decayed, inline (the kernel tests compare the two).
        recent = w.recent_tokens * np.exp2((w.recent_at_s - now_s) / half_life_s) + w.others_recent_tokens * np.exp2(
            (w.others_recent_at_s - now_s) / half_life_s
        )
        o.recent_tokens = recent
        capacity = w.capacity_tokens
        fraction = min(load / capacity, 1.0) if capacity > 0 else 0.0
        o.load_fraction = fraction
        o.busy_fraction = min((load + recent) / capacity, 1.0) if capacity > 0 else 0.0
        if decode:
            o.kv_fullness = min(1.0, max(fraction, w.kv_usage))
        elif has_indexed and w.num_kv_blocks > 0:
            o.kv_fullness = min(1.0, np.float64(num_blocks_by_slot[w.index_slot]) / w.num_kv_blocks)
        else:
            o.kv_fullness = min(1.0, max(0.0, w.kv_usage))


@native(
    types.void(
        types.boolean, types.float64, types.float64, _COLUMN, _COLUMN, _COLUMN, types.int64[::1], types.boolean[::1]
    )
)
def eligible(
    decode: bool,
    num_tokens: float,
    max_tokens: float,
    capacity_tokens: F64,
    load_tokens: F64,
    cached_tokens: F64,
    excluded: I64,
    out: npt.NDArray[np.bool_],
) -> None:
    """The filter: per worker, whether the request fits its budget, into ``out``; ``excluded``
    (positions the request must avoid) are False. A request holds prompt plus ``max_tokens`` on decode
    and its uncached prompt tokens on prefill; an idle worker takes any request (a prompt larger than
    the budget is not refused forever), and capacity 0 (unknown) has no limit."""
    for i in range(capacity_tokens.shape[0]):
        need = num_tokens + max_tokens if decode else max(0.0, num_tokens - cached_tokens[i])
        load, capacity = load_tokens[i], capacity_tokens[i]
        out[i] = capacity <= 0 or load == 0 or load + need <= capacity
    for j in range(excluded.shape[0]):
        out[excluded[j]] = False


@native(types.void(types.float64[:, ::1], types.float64[::1], _COLUMN, types.float64, types.float64[::1]))
def weighted_scores(scores: F64, weights: F64, num_in_flight: F64, tiebreak: float, out: F64) -> None:
    """Per worker (a column of ``scores``, one row per scorer), the scorers' weighted mean (1 when
    every weight is 0), with a ``tiebreak`` share given to fewer requests in flight, into ``out``.
    Summed scorer by scorer in row order, so the result is the numpy expression's to the bit."""
    total = 0.0
    for k in range(weights.shape[0]):
        total += weights[k]
    n = out.shape[0]
    if total > 0:
        # Row by row (contiguous), each worker's sum still built in scorer order: 0 + w0 s0 + w1 s1 ...
        out[:] = 0.0
        for k in range(weights.shape[0]):
            w = weights[k]
            for i in range(n):
                out[i] += w * scores[k, i]
        for i in range(n):
            out[i] /= total
    else:
        out[:] = 1.0
    for i in range(n):
        out[i] = (1.0 - tiebreak) * out[i] + tiebreak * (1.0 / (1.0 + num_in_flight[i]))


# The rendezvous rank: mixed = (worker key ^ request key) * _MIX, rank = mixed ^ (mixed >> 29).
_MIX = np.uint64(0x9E3779B97F4A7C15)
_SHIFT = np.uint64(29)


@native(types.int64(types.boolean[::1], types.float64[::1], types.float64, types.uint64[::1], types.uint64))
def pick(ok: npt.NDArray[np.bool_], scores: F64, tolerance: float, worker_keys: U64, request_key: np.uint64) -> int:
    """The position of the best-scored worker among ``ok`` ones (-1: none). Scores within
    ``tolerance`` of the best tie, and a tie goes to the highest rendezvous rank of (worker key,
    request key): equal workers share the traffic, and every replica picks the same worker for the
    same request with no shared state (the first position wins an equal rank)."""
    best = -np.inf
    for i in range(scores.shape[0]):
        if ok[i] and scores[i] > best:
            best = scores[i]
    if best == -np.inf:
        return -1
    threshold = best - tolerance
    chosen = -1
    chosen_rank = np.uint64(0)
    for i in range(scores.shape[0]):
        if ok[i] and scores[i] >= threshold:
            mixed = (worker_keys[i] ^ request_key) * _MIX
            rank = mixed ^ (mixed >> _SHIFT)
            if chosen < 0 or rank > chosen_rank:
                chosen = i
                chosen_rank = rank
    return chosen


# -- the KV index's match (tandem.router.kv_index) ---------------------------------------------


@native("void(f8[::1], i8[::1], i8[:], i8[::1], f8, f8)")
def credit_cached(
    out: F64,
    positions: I64,
    index_slots: I64,
    blocks_by_slot: I64,
    block_tokens: float,
    max_tokens: float,
) -> None:
    """Prompt tokens each of a pool's ``positions`` holds: its index slot's leading blocks times the
    block size, at most ``max_tokens`` (vLLM recomputes at least the last prompt token)."""
    for j in range(positions.shape[0]):
        p = positions[j]
        out[p] = min(blocks_by_slot[index_slots[p]] * block_tokens, max_tokens)
