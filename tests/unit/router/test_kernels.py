"""The compiled formulas (tandem.router.kernels, their only implementation in the router) against a
plain numpy oracle written here, on random pools: the same per-worker budgets, the same filter, the
same scores and the same choice, to the last bit.

The oracle is the numpy code the router ran before the kernels (budget.py's formulas and the
policies' filter, scores and pick until 2026-12-06), kept as the reference they must match."""

from __future__ import annotations

import random

import numpy as np
import numpy.typing as npt
import pytest

from tandem.common.registry import WorkerRecord
from tandem.router import kernels
from tandem.router.decay import decayed
from tandem.router.kernels import BUDGETS, WORKER_NUMBERS, Records
from tandem.router.policy import CacheAwarePolicy, CacheAwareWeights, ScheduleRequest
from tandem.router.pool import PoolArrays, request_key, worker_key

F64 = npt.NDArray[np.float64]

# -- the oracle ---------------------------------------------------------------------------------


def oracle_load_tokens(*, decode: bool, own: F64, own_young: F64, others: F64, others_young: F64, reported: F64) -> F64:
    young = own_young + others_young
    old = own + others - young
    capped = young + np.minimum(old, reported)
    return np.maximum(capped, reported) if decode else capped  # type: ignore[no-any-return]


def oracle_fits(capacity_tokens: F64, load: F64, need_tokens: F64) -> npt.NDArray[np.bool_]:
    return (capacity_tokens <= 0) | (load == 0) | (load + need_tokens <= capacity_tokens)  # type: ignore[no-any-return]


def oracle_load_fraction(capacity_tokens: F64, load: F64) -> F64:
    fraction = np.zeros(np.broadcast(capacity_tokens, load).shape)
    np.divide(load, capacity_tokens, out=fraction, where=capacity_tokens > 0)
    return np.minimum(fraction, 1.0, out=fraction)


def oracle_kv_fullness(
    *, decode: bool, load_fraction: F64, kv_usage: F64, num_indexed_blocks: F64 | None, num_kv_blocks: F64
) -> F64:
    if decode:
        return np.minimum(1.0, np.maximum(load_fraction, kv_usage))  # type: ignore[no-any-return]
    reported = np.minimum(1.0, np.maximum(0.0, kv_usage))
    if num_indexed_blocks is None:
        return reported  # type: ignore[no-any-return]
    with np.errstate(divide="ignore", invalid="ignore"):
        indexed = np.minimum(1.0, np.divide(num_indexed_blocks, num_kv_blocks))
    return np.where(num_kv_blocks > 0, indexed, reported)


def oracle_tie_order(worker_keys: npt.NDArray[np.uint64], request_id: str) -> npt.NDArray[np.uint64]:
    mixed = (worker_keys ^ np.uint64(request_key(request_id))) * np.uint64(0x9E3779B97F4A7C15)
    return mixed ^ (mixed >> np.uint64(29))  # type: ignore[no-any-return]


def oracle_cache_aware_choose(
    policy: CacheAwarePolicy, request: ScheduleRequest, pool: PoolArrays
) -> tuple[int, float] | None:
    """cache_aware's filter, scores and pick as numpy computed them (three fixed scorers)."""
    num_tokens = request.num_tokens
    need = (
        np.full(len(pool), float(num_tokens + request.max_tokens))
        if pool.is_decode
        else np.maximum(0.0, num_tokens - pool.cached_tokens)
    )
    mask = oracle_fits(pool.capacity_tokens, pool.load_tokens, need)
    for worker_id in request.exclude_worker_ids:
        i = pool.position(worker_id)
        if i is not None:
            mask[i] = False
    candidates = np.flatnonzero(mask)
    if candidates.size == 0:
        return None
    w = policy.weights
    n = len(pool)
    locality = np.minimum(1.0, pool.cached_tokens / num_tokens) if num_tokens else np.zeros(n)
    busy = oracle_load_fraction(pool.capacity_tokens, pool.load_tokens + pool.recent_tokens)
    token_load, kv_headroom = 1.0 - busy, 1.0 - pool.kv_fullness
    w_locality = w.decode_prefix_locality if pool.is_decode else w.prefix_locality
    total = w_locality + w.token_load + w.kv_headroom
    weighted = np.ones(n)
    if total > 0:
        weighted = (w_locality * locality + w.token_load * token_load + w.kv_headroom * kv_headroom) / total
    scores = 0.99 * weighted + 0.01 * (1.0 / (1.0 + pool.num_in_flight))
    candidate_scores = scores[candidates]
    tied = candidates[candidate_scores >= candidate_scores.max() - policy.tolerance(request, pool)]
    i = (
        int(tied[0])
        if tied.size == 1
        else int(tied[np.argmax(oracle_tie_order(pool.worker_keys[tied], request.request_id))])
    )
    return i, float(scores[i])


# -- random pools -------------------------------------------------------------------------------


def random_pool(rnd: random.Random, role: str, n: int) -> PoolArrays:
    """A pool whose values come from small sets, so that scores tie exactly and within the
    tolerance often, with unknown capacities, idle workers and full ones among them."""

    def column(choices: tuple[float, ...]) -> F64:
        return np.array([rnd.choice(choices) for _ in range(n)], np.float64)

    capacity, load, recent = (
        column((0.0, 4096.0, 4096.0, 8192.0)),
        column((0.0, 0.0, 1000.0, 3000.0, 4096.0, 9000.0)),
        column((0.0, 0.0, 500.0, 2048.0)),
    )
    workers = [WorkerRecord(f"{role}-{i}", role, "m", f"h{i}:1") for i in range(n)]
    return PoolArrays(
        role=role,
        workers=workers,
        has_budget=True,
        capacity_tokens=capacity,
        load_tokens=load,
        recent_tokens=recent,
        busy_fraction=oracle_load_fraction(capacity, load + recent),
        kv_fullness=column((0.0, 0.25, 0.5, 1.0)),
        num_in_flight=column((0.0, 0.0, 1.0, 3.0)),
        num_reported_requests=column((0.0, 2.0)),
        cached_tokens=column((0.0, 0.0, 0.0, 128.0, 1024.0, 2048.0)),
        worker_keys=np.array([worker_key(w.worker_id) for w in workers], np.uint64),
        positions={w.worker_id: i for i, w in enumerate(workers)},
    )


@pytest.mark.parametrize("seed", range(4))
def test_the_compiled_choice_is_the_numpy_choice(seed: int) -> None:
    rnd = random.Random(seed)
    num_compared = num_none = num_excluded_hits = num_ties = 0
    for trial in range(300):
        role = rnd.choice(("prefill", "decode"))
        pool = random_pool(rnd, role, rnd.choice((1, 2, 7, 40)))
        weights = CacheAwareWeights(
            prefix_locality=rnd.choice((0.0, 3.0)), token_load=rnd.choice((0.0, 1.0)), kv_headroom=0.5
        )
        excluded = frozenset(w.worker_id for w in rnd.sample(list(pool.workers), k=min(len(pool), rnd.randrange(3))))
        request = ScheduleRequest(
            request_id=f"r{seed}-{trial}",
            model="m",
            num_prompt_tokens=rnd.choice((0, 100, 2100, 5000)),
            max_tokens=rnd.choice((16, 1000)),
            exclude_worker_ids=excluded,
        )
        policy = CacheAwarePolicy(weights)
        compiled = policy.choose_in(request, pool)
        reference = oracle_cache_aware_choose(policy, request, pool)
        if reference is None:
            assert compiled is None
            num_none += 1
            continue
        assert compiled is not None
        assert (compiled.position, compiled.score) == reference
        scores = policy.scores(request, pool)
        num_ties += int((scores >= scores.max() - policy.tolerance(request, pool)).sum() > 1)
        num_excluded_hits += bool(excluded)
        num_compared += 1
    # The random pools reach every branch: choices, ties, nobody eligible, exclusions.
    assert num_compared > 100 and num_none > 5 and num_excluded_hits > 20 and num_ties > 20


def test_the_compiled_pick_is_the_rendezvous_order() -> None:
    """Equal scores: the highest rank of (worker key, request key) wins, as numpy orders them."""
    pool = random_pool(random.Random(9), "decode", 40)
    ok = np.ones(40, np.bool_)
    ok[::3] = False
    scores = np.ones(40)
    for r in range(200):
        request_id = f"tie-{r}"
        chosen = kernels.pick(ok, scores, 0.0, pool.worker_keys, np.uint64(request_key(request_id)))
        candidates = np.flatnonzero(ok)
        assert chosen == candidates[np.argmax(oracle_tie_order(pool.worker_keys[candidates], request_id))]


def random_numbers(rng: np.random.Generator, n: int, num_slots: int) -> Records:
    def tokens() -> F64:
        return rng.choice([0.0, 100.0, 3000.0, 7000.0], n)

    w = np.zeros(n, WORKER_NUMBERS)
    w["capacity_tokens"] = rng.choice([0.0, 4096.0, 8192.0], n)
    w["reported_tokens"] = tokens()
    w["kv_usage"] = rng.choice([0.0, 0.3, 1.0, 1.5], n)
    w["num_kv_blocks"] = rng.choice([0.0, 100.0, 1000.0], n)
    w["own_tokens"], w["others_tokens"] = tokens(), tokens()
    w["own_young_tokens"] = w["own_tokens"] * rng.choice([0.0, 0.5, 1.0], n)
    w["others_young_tokens"] = w["others_tokens"] * rng.choice([0.0, 1.0], n)
    w["own_in_flight"], w["others_in_flight"] = rng.choice([0.0, 1.0, 4.0], n), rng.choice([0.0, 2.0], n)
    w["recent_tokens"], w["others_recent_tokens"] = rng.random(n) * 5000, rng.random(n) * 5000
    w["recent_at_s"], w["others_recent_at_s"] = rng.random(n) * 100, rng.random(n) * 100
    # the pool's workers sit at shuffled index slots, some not indexed (0)
    w["index_slot"] = rng.permutation(num_slots)[:n]
    return w


@pytest.mark.parametrize("decode", [False, True])
def test_the_compiled_budgets_are_the_numpy_formulas(decode: bool) -> None:
    rng = np.random.default_rng(3)
    n = 257
    w = random_numbers(rng, n, n + 11)
    blocks_by_slot = np.concatenate(([0], rng.choice([0, 50, 5000], n + 10))).astype(np.int64)
    indexed = blocks_by_slot[w["index_slot"]].astype(np.float64)
    now_s, half_life_s = 120.0, 30.0
    for has_indexed in (False, True) if not decode else (False,):
        out = np.empty(n, BUDGETS)
        blocks = blocks_by_slot if has_indexed else np.zeros(0, np.int64)
        kernels.budget_state(decode, w, now_s, half_life_s, blocks, out)
        np.testing.assert_array_equal(out["num_in_flight"], w["own_in_flight"] + w["others_in_flight"])
        load = oracle_load_tokens(
            decode=decode,
            own=w["own_tokens"],
            own_young=w["own_young_tokens"],
            others=w["others_tokens"],
            others_young=w["others_young_tokens"],
            reported=w["reported_tokens"],
        )
        np.testing.assert_array_equal(out["load_tokens"], load)
        # The router's one decay (tandem.router.decay), worker by worker.
        recent = np.array(
            [
                decayed(float(x["recent_tokens"]), now_s - float(x["recent_at_s"]), half_life_s)
                + decayed(float(x["others_recent_tokens"]), now_s - float(x["others_recent_at_s"]), half_life_s)
                for x in w
            ]
        )
        np.testing.assert_allclose(out["recent_tokens"], recent, rtol=1e-15)
        fraction = oracle_load_fraction(w["capacity_tokens"], load)
        np.testing.assert_array_equal(out["load_fraction"], fraction)
        busy = oracle_load_fraction(w["capacity_tokens"], load + out["recent_tokens"])
        np.testing.assert_array_equal(out["busy_fraction"], busy)
        fullness = oracle_kv_fullness(
            decode=decode,
            load_fraction=fraction,
            kv_usage=w["kv_usage"],
            num_indexed_blocks=indexed if has_indexed else None,
            num_kv_blocks=w["num_kv_blocks"],
        )
        np.testing.assert_array_equal(out["kv_fullness"], fullness)
        assert 0 < fraction.mean() < 1 and (out["load_tokens"] > 0).any()  # the random numbers reach both sides


@pytest.mark.parametrize("decode", [False, True])
def test_the_compiled_filter_is_the_numpy_filter(decode: bool) -> None:
    rng = np.random.default_rng(4)
    n = 300
    capacity = rng.choice([0.0, 4096.0, 8192.0], n)
    load = rng.choice([0.0, 100.0, 4000.0, 8000.0, 9000.0], n)
    cached = rng.choice([0.0, 512.0, 4096.0], n)
    excluded = np.array([3, 7, 299], np.int64)
    for num_tokens, max_tokens in ((0.0, 16.0), (300.0, 100.0), (5000.0, 16.0)):
        ok = np.empty(n, np.bool_)
        kernels.eligible(decode, num_tokens, max_tokens, capacity, load, cached, excluded, ok)
        need = np.full(n, num_tokens + max_tokens) if decode else np.maximum(0.0, num_tokens - cached)
        expected = oracle_fits(capacity, load, need)
        expected[excluded] = False
        np.testing.assert_array_equal(ok, expected)
        assert ok.any() and not ok.all()


def test_credited_cached_tokens_are_the_numpy_gather() -> None:
    rng = np.random.default_rng(5)
    n, num_slots, block_tokens = 300, 400, 16
    blocks_by_slot = rng.choice([0, 1, 7, 200], num_slots).astype(np.int64)
    index_slots = rng.integers(0, num_slots, n).astype(np.int64)
    positions = np.sort(rng.choice(n, 200, replace=False)).astype(np.int64)
    max_tokens = 2000.0
    out = np.zeros(n)
    kernels.credit_cached(out, positions, index_slots, blocks_by_slot, float(block_tokens), max_tokens)
    expected = np.zeros(n)
    expected[positions] = blocks_by_slot[index_slots[positions]] * block_tokens
    np.minimum(expected, max_tokens, out=expected)
    np.testing.assert_array_equal(out, expected)
    assert (out[np.setdiff1d(np.arange(n), positions)] == 0).all() and out.max() == max_tokens
