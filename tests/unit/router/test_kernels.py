"""The compiled decision (tandem.router.kernels) against the numpy formulas it replaces, on random
pools: the same choice, the same score, the same per-worker state, to the last bit."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tandem.common.registry import WorkerRecord
from tandem.router import budget as formulas
from tandem.router import kernels
from tandem.router.policy import CacheAwarePolicy, CacheAwareWeights, RoutingPolicy, ScheduleRequest
from tandem.router.pool import PoolArrays, worker_key


def random_pool(rnd: random.Random, role: str, n: int) -> PoolArrays:
    """A pool whose values come from small sets, so that scores tie exactly and within the
    tolerance often, with unknown capacities, idle workers and full ones among them."""

    def column(choices: tuple[float, ...]) -> np.ndarray:
        return np.array([rnd.choice(choices) for _ in range(n)], np.float64)

    workers = [WorkerRecord(f"{role}-{i}", role, "m", f"h{i}:1") for i in range(n)]
    return PoolArrays(
        role=role,
        workers=workers,
        has_budget=True,
        capacity_tokens=column((0.0, 4096.0, 4096.0, 8192.0)),
        load_tokens=column((0.0, 0.0, 1000.0, 3000.0, 4096.0, 9000.0)),
        recent_tokens=column((0.0, 0.0, 500.0, 2048.0)),
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
    num_compared = num_none = num_excluded_hits = 0
    for trial in range(300):
        role = rnd.choice(("prefill", "decode"))
        pool = random_pool(rnd, role, rnd.choice((1, 2, 7, 40)))
        weights = CacheAwareWeights(
            prefix_locality=rnd.choice((0.0, 3.0)), token_load=rnd.choice((0.0, 1.0)), kv_headroom=0.5
        )
        excluded = tuple(w.worker_id for w in rnd.sample(list(pool.workers), k=min(len(pool), rnd.randrange(3))))
        request = ScheduleRequest(
            request_id=f"r{seed}-{trial}",
            model="m",
            num_prompt_tokens=rnd.choice((0, 100, 2100, 5000)),
            max_tokens=rnd.choice((16, 1000)),
            exclude_worker_ids=excluded,
        )
        policy = CacheAwarePolicy(weights)
        compiled = policy.choose_in(request, pool)
        reference = RoutingPolicy.choose_in(policy, request, pool)  # filter, scores and pick in numpy
        if reference is None:
            assert compiled is None
            num_none += 1
            continue
        assert compiled is not None
        assert (compiled.position, compiled.worker.worker_id) == (reference.position, reference.worker.worker_id)
        assert compiled.score == reference.score
        num_excluded_hits += bool(excluded)
        num_compared += 1
    # The random pools reach every branch: choices, nobody eligible, exclusions.
    assert num_compared > 100 and num_none > 5 and num_excluded_hits > 20


@pytest.mark.parametrize("decode", [False, True])
def test_the_compiled_pool_state_is_the_numpy_formulas(decode: bool) -> None:
    rng = np.random.default_rng(3)
    n = 257

    def tokens() -> np.ndarray:
        return rng.choice([0.0, 100.0, 3000.0, 7000.0], n)

    own, others, reported = tokens(), tokens(), tokens()
    own_young, others_young = own * rng.choice([0.0, 0.5, 1.0], n), others * rng.choice([0.0, 1.0], n)
    capacity = rng.choice([0.0, 4096.0, 8192.0], n)
    recent, others_recent = rng.random(n) * 5000, rng.random(n) * 5000
    recent_at_s, others_recent_at_s = rng.random(n) * 100, rng.random(n) * 100
    kv_usage = rng.choice([0.0, 0.3, 1.0, 1.5], n)
    num_kv_blocks = rng.choice([0.0, 100.0, 1000.0], n)
    # The index counts blocks by slot; the pool's workers sit at shuffled slots, some not indexed (0).
    blocks_by_slot = np.concatenate(([0], rng.choice([0, 50, 5000], n + 10))).astype(np.int64)
    index_slots = rng.permutation(n + 11)[:n].astype(np.int64)
    indexed = blocks_by_slot[index_slots].astype(np.float64)
    own_in_flight, others_in_flight = rng.choice([0.0, 1.0, 4.0], n), rng.choice([0.0, 2.0], n)
    now_s, half_life_s = 120.0, 30.0
    for has_indexed in (False, True) if not decode else (False,):
        load, recent_out, fullness, in_flight = np.empty(n), np.empty(n), np.empty(n), np.empty(n)
        kernels.pool_state(
            decode, own, own_young, others, others_young, reported, capacity, recent, recent_at_s,
            others_recent, others_recent_at_s, now_s, half_life_s, kv_usage,
            blocks_by_slot if has_indexed else np.zeros(0, np.int64), index_slots, has_indexed, num_kv_blocks,
            own_in_flight, others_in_flight, load, recent_out, fullness, in_flight,
        )  # fmt: skip
        np.testing.assert_array_equal(in_flight, own_in_flight + others_in_flight)
        expected_load = formulas.load_tokens(
            decode=decode, own=own, own_young=own_young, others=others, others_young=others_young, reported=reported
        )
        np.testing.assert_array_equal(load, expected_load)
        expected_recent = recent * np.exp2((recent_at_s - now_s) / half_life_s)
        expected_recent += others_recent * np.exp2((others_recent_at_s - now_s) / half_life_s)
        np.testing.assert_allclose(recent_out, expected_recent, rtol=1e-15)
        expected_fullness = formulas.kv_fullness(
            decode=decode,
            load_fraction_=formulas.load_fraction(capacity, expected_load),
            kv_usage=kv_usage,
            num_indexed_blocks=indexed if has_indexed else None,
            num_kv_blocks=num_kv_blocks,
        )
        np.testing.assert_array_equal(fullness, expected_fullness)


def test_credited_cached_tokens_are_the_numpy_gather() -> None:
    rng = np.random.default_rng(5)
    n, num_slots, block_tokens = 300, 400, 16
    blocks_by_slot = rng.choice([0, 1, 7, 200], num_slots).astype(np.int64)
    index_slots = rng.integers(0, num_slots, n).astype(np.int64)
    positions = np.sort(rng.choice(n, 200, replace=False)).astype(np.intp)
    max_tokens = 2000.0
    out = np.zeros(n)
    kernels.credit_cached(out, positions, index_slots, blocks_by_slot, float(block_tokens), max_tokens)
    expected = np.zeros(n)
    expected[positions] = blocks_by_slot[index_slots[positions]] * block_tokens
    np.minimum(expected, max_tokens, out=expected)
    np.testing.assert_array_equal(out, expected)
    assert (out[np.setdiff1d(np.arange(n), positions)] == 0).all() and out.max() == max_tokens
