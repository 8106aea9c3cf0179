"""tandem_operator.autoscale: each pool on its own signal, windows, steps, bounds."""

from __future__ import annotations

from tandem_operator.autoscale import Decision, PoolSignals, Recommendation, decide, measured_start_s, slope
from tandem_operator.spec import AutoscalingSpec, PoolSpec, Role, SloSpec

POOL = PoolSpec(replicas=2, min_replicas=1, max_replicas=6)
SLO = SloSpec(ttft_p90_seconds=2.0, itl_p90_seconds=0.1)


def policy(**kw: float) -> AutoscalingSpec:
    base = {"scale_up_stabilization_seconds": 0, "scale_down_stabilization_seconds": 0}
    return AutoscalingSpec.model_validate({**base, **kw})


def once(
    role: Role, current: int, signals: PoolSignals, pol: AutoscalingSpec | None = None, pool: PoolSpec = POOL
) -> Decision:
    decision, _ = decide(
        role=role,
        current_replicas=current,
        signals=signals,
        pool=pool,
        policy=pol or policy(),
        slo=SLO,
        history=(),
        now_s=100.0,
    )
    return decision


def test_prefill_scales_on_queue_depth_and_backlog() -> None:
    assert once("prefill", 2, PoolSignals(queue_depth=12)).desired_replicas == 3  # asks 3, within step 2
    assert once("prefill", 1, PoolSignals(queue_depth=40)).desired_replicas == 3  # asks 10, capped at +2
    assert once("prefill", 2, PoolSignals(queue_depth=0, uncached_tokens=8192 * 4)).desired_replicas == 4


def test_prefill_ignores_decode_signals_and_vice_versa() -> None:
    assert once("prefill", 2, PoolSignals(kv_usage=0.99, itl_p90_s=1.0)).desired_replicas == 2
    assert once("prefill", 2, PoolSignals(kv_usage=0.99, itl_p90_s=1.0)).reason == "no metrics: hold"
    assert once("decode", 2, PoolSignals(queue_depth=100, ttft_p90_s=10)).desired_replicas == 2


def test_decode_scales_on_kv_usage_with_tolerance() -> None:
    assert once("decode", 2, PoolSignals(kv_usage=0.95)).desired_replicas == 3  # ceil(2·0.95/0.7)
    assert once("decode", 2, PoolSignals(kv_usage=0.74)).desired_replicas == 2  # within 10 %
    assert once("decode", 4, PoolSignals(kv_usage=0.2)).desired_replicas == 3  # one step down


def test_latency_over_slo_scales_up_and_near_slo_vetoes_scale_down() -> None:
    assert once("prefill", 2, PoolSignals(queue_depth=1, ttft_p90_s=3.0)).desired_replicas == 3
    assert once("decode", 2, PoolSignals(kv_usage=0.1, itl_p90_s=0.25)).desired_replicas == 4  # 2.5×, step 2
    # Little load but ITL at 90 % of its SLO: hold, never shrink.
    assert once("decode", 3, PoolSignals(kv_usage=0.1, itl_p90_s=0.09)).desired_replicas == 3
    assert once("decode", 3, PoolSignals(kv_usage=0.1, itl_p90_s=0.05)).desired_replicas == 2


def test_a_ttft_breach_grows_prefill_only_where_prefill_is_short() -> None:
    # Nothing waits for prefill and its backlog is under target: the breach is the wait for decode
    # budget (the demo's decision log: prefill went 3 → 6 and TTFT did not move). Prefill holds.
    held = once("prefill", 2, PoolSignals(queue_depth=0, uncached_tokens=1000, ttft_p90_s=7.0))
    assert held.desired_replicas == 2 and held.votes["ttft_p90"] == 2
    # Its backlog over target: prefill is short, the breach grows it.
    short = once("prefill", 2, PoolSignals(queue_depth=0, uncached_tokens=3 * 8192, ttft_p90_s=7.0))
    assert short.votes["ttft_p90"] == 7 and short.desired_replicas == 4  # step 2


def test_requests_waiting_for_a_full_pool_size_it_for_the_demand_at_once() -> None:
    # 4 decode replicas hold 8 requests and 8 more wait: 8 replicas asked in one decision.
    decision = once("decode", 4, PoolSignals(waiting=8, in_flight=8), pool=PoolSpec(max_replicas=10))
    assert decision.votes["demand"] == 8 and decision.votes["waiting"] == 2
    assert decision.desired_replicas == 6  # step 2
    # Nothing waits: no demand vote (it neither grows nor holds the pool).
    assert "demand" not in once("decode", 4, PoolSignals(waiting=0, in_flight=8)).votes
    # Requests wait and nothing is in flight (the pool's workers just went away): one more.
    assert once("prefill", 1, PoolSignals(queue_depth=1, in_flight=0)).votes["demand"] == 2


def test_decode_budget_in_use_holds_its_target() -> None:
    assert once("decode", 2, PoolSignals(budget_usage=0.94)).desired_replicas == 3  # ceil(2 × 0.94 / 0.8)
    assert once("decode", 2, PoolSignals(budget_usage=0.8)).desired_replicas == 2
    # Fewer only if the same load would sit under the band's lower edge at the smaller size.
    assert once("decode", 3, PoolSignals(budget_usage=0.5)).desired_replicas == 3
    assert once("decode", 3, PoolSignals(budget_usage=0.2)).desired_replicas == 2  # step 1


def test_bounds() -> None:
    small = PoolSpec(replicas=1, min_replicas=1, max_replicas=2)
    assert once("prefill", 2, PoolSignals(queue_depth=100), pool=small).desired_replicas == 2
    assert once("prefill", 1, PoolSignals(queue_depth=0), pool=small).desired_replicas == 1


def test_scale_up_waits_for_its_window() -> None:
    pol = policy(scale_up_stabilization_seconds=30)
    history: tuple[Recommendation, ...] = ()
    desired = []
    for t in range(0, 50, 10):
        decision, history = decide(
            role="prefill",
            current_replicas=1,
            signals=PoolSignals(queue_depth=12),
            pool=POOL,
            policy=pol,
            slo=SLO,
            history=history,
            now_s=float(t),
        )
        desired.append(decision.desired_replicas)
    # The seed (1 replica at t=0) holds the scale-up back for the 30 s window.
    assert desired == [1, 1, 1, 3, 3]


def test_scale_down_waits_for_its_window_and_a_spike_resets_it() -> None:
    # The scale-up window filters the spike (its steep rise would grow the pool on its trend otherwise).
    pol = policy(scale_down_stabilization_seconds=60, scale_up_stabilization_seconds=30)
    history: tuple[Recommendation, ...] = (Recommendation(0.0, 4, 4),)
    current = 4
    trace = []
    for t, queue in [(10, 0), (30, 0), (50, 16), (70, 0), (100, 0), (115, 0)]:
        decision, history = decide(
            role="prefill",
            current_replicas=current,
            signals=PoolSignals(queue_depth=queue),
            pool=POOL,
            policy=pol,
            slo=SLO,
            history=history,
            now_s=float(t),
        )
        current = decision.desired_replicas
        trace.append(current)
    # The 4 at t=50 keeps replicas up until it leaves the window (t=110).
    assert trace == [4, 4, 4, 4, 4, 3]


ZERO_POOL = PoolSpec(replicas=0, min_replicas=0, max_replicas=6)


def test_pending_demand_starts_a_pool_at_zero_at_once_whatever_the_scale_up_window() -> None:
    slow = policy(scale_up_stabilization_seconds=600)
    # At zero, the pool's own signals read an empty pool's zeros: held there.
    idle = once("decode", 0, PoolSignals(budget_usage=0.0, waiting=0.0, in_flight=0.0), slow, ZERO_POOL)
    assert idle.desired_replicas == 0 and not idle.changed
    for role in ("prefill", "decode"):
        started = once(role, 0, PoolSignals(pending_demand=3.0, in_flight=0.0), slow, ZERO_POOL)
        assert started.desired_replicas == 1 and started.votes["pending_demand"] == 1
        assert started.reason == "scale from zero: pending_demand asks 1"
    # Other signals asking for more start it with more, within the step cap.
    big = once("prefill", 0, PoolSignals(pending_demand=1.0, queue_depth=40.0), slow, ZERO_POOL)
    assert big.desired_replicas == 2  # queue asks 10, max_scale_up_step 2
    # Once it runs, pending demand left in the router's window holds it up, never grows it.
    assert once("decode", 1, PoolSignals(pending_demand=5.0, budget_usage=0.0), pool=ZERO_POOL).desired_replicas == 1


def test_an_idle_pool_with_min_zero_goes_to_zero_a_step_at_a_time() -> None:
    signals = PoolSignals(budget_usage=0.0, waiting=0.0, in_flight=0.0)
    assert once("decode", 1, signals, pool=ZERO_POOL).desired_replicas == 0
    assert once("prefill", 1, PoolSignals(queue_depth=0.0, uncached_tokens=0.0), pool=ZERO_POOL).desired_replicas == 0
    # Still starting: never below what is on its way.
    held, _ = decide(
        role="decode",
        current_replicas=1,
        signals=signals,
        pool=ZERO_POOL,
        policy=policy(),
        slo=SLO,
        history=(),
        now_s=100.0,
        ready_replicas=0,
    )
    assert held.desired_replicas == 1


def test_latency_alone_never_shrinks_a_pool() -> None:
    """The router's series missing (its export stalled under load), only the latency votes left: a
    comfortable p90 is no objection, not a count of zero. The demo's run took a loaded decode pool with
    minReplicas 0 from 1 to 0 on the ITL vote alone."""
    for role, signals in (("decode", PoolSignals(itl_p90_s=0.05)), ("prefill", PoolSignals(ttft_p90_s=0.5))):
        for pool in (ZERO_POOL, POOL):
            held = once(role, 1 if pool is ZERO_POOL else 3, signals, pool=pool)
            assert not held.changed, held
    # Over its SLO it still grows the pool.
    assert once("decode", 1, PoolSignals(itl_p90_s=0.3), pool=ZERO_POOL).desired_replicas == 3
    # With a load signal beside it, the pool shrinks as before.
    assert once("decode", 1, PoolSignals(itl_p90_s=0.05, budget_usage=0.0), pool=ZERO_POOL).desired_replicas == 0


def test_replicas_still_starting_are_capacity_coming() -> None:
    """A backlog that grows while the new replicas start (the queue fills at the ready replicas'
    shortfall) asks for more at every decision: 2 → 4 → 6 → 7 in 60 s with no new pod ready.
    Requested replicas count: the pool holds until they are ready, then grows at once if the ready
    pool still asks for more."""
    pol = policy(scale_up_stabilization_seconds=20, interval_seconds=10)
    pool = PoolSpec(replicas=2, min_replicas=1, max_replicas=10)
    history: tuple[Recommendation, ...] = ()
    current, trace, reasons = 2, [], []
    # 2 ready hold 4 requests; the queue grows by 4 every 10 s while nothing new is ready.
    for t, queue in [(0, 8), (10, 8), (20, 8), (30, 12), (40, 16), (50, 20), (60, 24)]:
        decision, history = decide(
            role="prefill",
            current_replicas=current,
            ready_replicas=2,
            signals=PoolSignals(queue_depth=queue, in_flight=4),
            pool=pool,
            policy=pol,
            slo=SLO,
            history=history,
            now_s=float(t),
        )
        current = decision.desired_replicas
        trace.append(current)
        reasons.append(decision.reason)
    assert trace == [2, 2, 4, 4, 4, 4, 4], trace
    assert all(r.startswith("scale up held: 2 of 4 replicas still starting") for r in reasons[3:])
    # The held recommendations stay in the history: once the 4 are ready and still short, no second window.
    decision, _ = decide(
        role="prefill",
        current_replicas=4,
        ready_replicas=4,
        signals=PoolSignals(queue_depth=24, in_flight=8),
        pool=pool,
        policy=pol,
        slo=SLO,
        history=history,
        now_s=70.0,
    )
    assert decision.desired_replicas == 6 and decision.reason.startswith("scale up")
    # Without the credit (all replicas ready) the same growing queue would have grown it again.
    grown, _ = decide(
        role="prefill",
        current_replicas=4,
        ready_replicas=4,
        signals=PoolSignals(queue_depth=16, in_flight=8),
        pool=pool,
        policy=pol,
        slo=SLO,
        history=history[:5],
        now_s=40.0,
    )
    assert grown.desired_replicas > 4
    # Replicas not ready without a scale-up of this loop's (a rollout replacing pods) hold nothing back,
    # nor ones starting for two start times (unschedulable): the pool grows past them.
    rollout, _ = decide(
        role="prefill",
        current_replicas=4,
        ready_replicas=2,
        signals=PoolSignals(queue_depth=24, in_flight=4),
        pool=pool,
        policy=pol,
        slo=SLO,
        history=(Recommendation(0.0, 4, 4, 4), Recommendation(10.0, 10, 4, 2)),
        now_s=20.0,
    )
    assert rollout.desired_replicas == 6
    stuck, _ = decide(
        role="prefill",
        current_replicas=4,
        ready_replicas=2,
        signals=PoolSignals(queue_depth=24, in_flight=4),
        pool=pool,
        policy=pol,
        slo=SLO,
        history=history,
        now_s=20.0 + 2 * 30.0,
    )
    assert stuck.desired_replicas == 6


def test_slope_and_start_time_from_the_history() -> None:
    assert slope([(0.0, 1.0), (10.0, 3.0), (20.0, 5.0)]) == 0.2
    assert slope([(5.0, 1.0)]) is None
    # Grown 1 → 3 by the decision at t=10 (made at 1 replica); at t=40 a third replica is ready: 30 s.
    history = (Recommendation(10.0, 3, 1, 1), Recommendation(20.0, 3, 3, 1), Recommendation(30.0, 3, 3, 2))
    assert measured_start_s(history, 3, 40.0) == 30.0
    assert measured_start_s(history, 2, 40.0) is None  # nobody became ready since the last decision
    # The size was never grown within the history (an operator restart): nothing to time.
    assert measured_start_s((Recommendation(0.0, 3, 3, 1),), 3, 10.0) is None


def test_a_rising_load_asks_for_replicas_a_start_time_ahead() -> None:
    pol = policy(scale_up_stabilization_seconds=0, interval_seconds=10)
    tokens = 8192.0  # uncached tokens per replica's target
    history: tuple[Recommendation, ...] = ()
    votes = []
    # Uncached tokens in flight rise by half a replica's worth every 10 s; the level asks for 2 all along.
    for t, level in [(0, 1.0), (10, 1.5), (20, 2.0)]:
        decision, history = decide(
            role="prefill",
            current_replicas=2,
            signals=PoolSignals(queue_depth=0, uncached_tokens=level * tokens),
            pool=POOL,
            policy=pol,
            slo=SLO,
            history=history,
            now_s=float(t),
        )
        votes.append(decision.votes)
    assert votes[0] == {"queue_depth": 0, "uncached_tokens": 1}  # no history, no slope
    # At t=20: 2.0 replicas' worth, growing 0.05 per s, projected over the scale-up window + one interval
    # (no start time measured yet): 2.0 + 0.05 × 10 = 2.5 → 3, while the level asks 2.
    assert votes[2]["uncached_tokens"] == 2 and votes[2]["uncached_tokens_trend"] == 3
    assert decision.desired_replicas == 3 and "uncached_tokens_trend" in decision.reason
    # A falling load (below where it was 30 s ago) projects nothing: no trend vote, the level decides.
    falling, _ = decide(
        role="prefill",
        current_replicas=2,
        signals=PoolSignals(queue_depth=0, uncached_tokens=0.5 * tokens),
        pool=POOL,
        policy=pol,
        slo=SLO,
        history=history,
        now_s=30.0,
    )
    assert not any(name.endswith("_trend") for name in falling.votes)
    # Decode: budget in use rising from 0.5 to 0.7 in 20 s, measured start time 40 s: 0.7 + 0.01 × 40 =
    # 1.1 of a 0.8 target at 2 replicas → 3, while the level (0.7, within the band) holds 2.
    history = (
        Recommendation(0.0, 2, 2, 2, PoolSignals(budget_usage=0.5), 40.0),
        Recommendation(10.0, 2, 2, 2, PoolSignals(budget_usage=0.6), 40.0),
    )
    decode, _ = decide(
        role="decode",
        current_replicas=2,
        signals=PoolSignals(budget_usage=0.7),
        pool=POOL,
        policy=pol,
        slo=SLO,
        history=history,
        now_s=20.0,
    )
    assert decode.votes["budget_usage"] == 2 and decode.votes["budget_usage_trend"] == 3
    # Requests waiting for decode rising: the demand vote follows the projected wait.
    history = (Recommendation(0.0, 2, 2, 2, PoolSignals(waiting=0.0, in_flight=4), 10.0),)
    demand, _ = decide(
        role="decode",
        current_replicas=2,
        signals=PoolSignals(waiting=2.0, in_flight=4),
        pool=POOL,
        policy=pol,
        slo=SLO,
        history=history,
        now_s=10.0,
    )
    assert demand.votes["demand"] == 3 and demand.votes["demand_trend"] == 4  # ceil(2 × (4 + 4) / 4)


def test_measured_capacity_sizes_each_pool_from_its_tokens_per_second() -> None:
    measured = AutoscalingSpec.model_validate(
        {
            "scale_up_stabilization_seconds": 0,
            "scale_down_stabilization_seconds": 0,
            "capacity": {"prefill_tokens_per_second_per_worker": 140, "decode_tokens_per_second_per_worker": 16},
        }
    )
    # 500 uncached prompt tokens/s at 140 per worker: 4 workers; 40 output tokens/s at 16: 3.
    prefill = once("prefill", 2, PoolSignals(queue_depth=0, token_rate=500.0), measured, PoolSpec(max_replicas=8))
    assert prefill.votes["token_rate"] == 4 and prefill.desired_replicas == 4
    decode = once("decode", 2, PoolSignals(budget_usage=0.5, token_rate=40.0), measured)
    assert decode.votes["token_rate"] == 3 and decode.desired_replicas == 3
    # Below one worker's capacity, the vote lets the pool shrink on its other signals.
    assert once("decode", 3, PoolSignals(budget_usage=0.1, token_rate=5.0), measured).desired_replicas == 2
    # Not measured (0): no vote, whatever the rate.
    assert "token_rate" not in once("prefill", 2, PoolSignals(queue_depth=0, token_rate=5000.0)).votes
    # The rate's growth votes a start time ahead: 300 → 400 tokens/s in 10 s, projected 10 s (window + interval).
    pol = measured.model_copy(update={"interval_seconds": 10.0})
    history = (Recommendation(0.0, 3, 3, 3, PoolSignals(queue_depth=0, token_rate=300.0)),)
    rising, _ = decide(
        role="prefill",
        current_replicas=3,
        signals=PoolSignals(queue_depth=0, token_rate=400.0),
        pool=PoolSpec(max_replicas=8),
        policy=pol,
        slo=SLO,
        history=history,
        now_s=10.0,
    )
    assert rising.votes["token_rate"] == 3 and rising.votes["token_rate_trend"] == 4  # ceil(500 / 140)


#: The demo's long-prompts scenario in small: 900-token prompts against a 600-token target per replica.
LONG_PROMPT_TOKENS = 900.0
SIX_HUNDRED = AutoscalingSpec.model_validate(
    {
        "scale_up_stabilization_seconds": 0,
        "scale_down_stabilization_seconds": 0,
        "interval_seconds": 10,
        "prefill": {"uncached_tokens_per_replica": 600},
    }
)


def test_one_long_prompt_over_the_target_asks_for_one_replica() -> None:
    # One prompt on the one prefill worker, nothing queued: a second worker cannot compute any part of it.
    one = PoolSignals(queue_depth=0, in_flight=1, uncached_tokens=LONG_PROMPT_TOKENS)
    decision = once("prefill", 1, one, SIX_HUNDRED)
    assert decision.votes["uncached_tokens"] == 1 and decision.desired_replicas == 1
    # Its TTFT p90 over the SLO still grows the pool: over a minute's requests, the breach sees the waits
    # of prompts arriving faster than one worker computes them, which the instant counts miss (the
    # long-prompts demo held at one replica with TTFT p90 at 5.1-9.3 s while this vote was capped too).
    slow = once(
        "prefill",
        1,
        PoolSignals(queue_depth=0, in_flight=1, uncached_tokens=LONG_PROMPT_TOKENS, ttft_p90_s=2.5),
        SIX_HUNDRED,
    )
    assert slow.votes["uncached_tokens"] == 1 and slow.votes["ttft_p90"] == 2 and slow.desired_replicas == 2  # SLO 2 s
    # Three long prompts (2,700 tokens: 5 targets' worth) ask for 3, one each.
    three = PoolSignals(queue_depth=1, in_flight=2, uncached_tokens=3 * LONG_PROMPT_TOKENS)
    assert once("prefill", 1, three, SIX_HUNDRED).votes["uncached_tokens"] == 3
    # Tokens counted while the count reads 0 (the pool's gauge is refreshed apart from the tokens'): one.
    stale = PoolSignals(queue_depth=0, in_flight=0, uncached_tokens=LONG_PROMPT_TOKENS)
    assert once("prefill", 1, stale, SIX_HUNDRED).votes["uncached_tokens"] == 1
    # No count (either signal unread): the tokens alone, as before.
    assert (
        once("prefill", 1, PoolSignals(queue_depth=0, uncached_tokens=LONG_PROMPT_TOKENS), SIX_HUNDRED).votes[
            "uncached_tokens"
        ]
        == 2
    )
    assert (
        once("prefill", 1, PoolSignals(in_flight=1, uncached_tokens=LONG_PROMPT_TOKENS), SIX_HUNDRED).votes[
            "uncached_tokens"
        ]
        == 2
    )


def test_many_prompts_still_scale_by_their_tokens() -> None:
    # 11 prompts of 400 tokens, 3 computing and 8 waiting for budget: 4,400 tokens ask for 8, under the 11
    # prompts (the waiting ones count: they are the pool's too).
    many = PoolSignals(queue_depth=8, in_flight=3, uncached_tokens=11 * 400.0)
    decision = once("prefill", 2, many, SIX_HUNDRED, PoolSpec(max_replicas=10))
    assert decision.votes["uncached_tokens"] == 8 and decision.desired_replicas == 4  # step 2
    # At exactly the target per replica it holds; one token more asks for one more.
    at = PoolSignals(queue_depth=0, in_flight=9, uncached_tokens=3 * 600.0)
    assert once("prefill", 3, at, SIX_HUNDRED).votes["uncached_tokens"] == 3
    over = PoolSignals(queue_depth=0, in_flight=9, uncached_tokens=3 * 600.0 + 1)
    assert once("prefill", 3, over, SIX_HUNDRED).votes["uncached_tokens"] == 4


def test_the_trend_vote_obeys_the_same_cap() -> None:
    # One long prompt arrives at an idle pool: 0 → 900 tokens in 10 s projects 1,800 over the next 10 s (the
    # scale-up window plus one interval), 3 targets' worth; one request in flight and none waiting: the trend
    # asks for one replica, as the level does.
    history = (Recommendation(0.0, 1, 1, 1, PoolSignals(queue_depth=0, in_flight=0, uncached_tokens=0.0)),)
    now = PoolSignals(queue_depth=0, in_flight=1, uncached_tokens=LONG_PROMPT_TOKENS)
    decision, _ = decide(
        role="prefill",
        current_replicas=1,
        signals=now,
        pool=POOL,
        policy=SIX_HUNDRED,
        slo=SLO,
        history=history,
        now_s=10.0,
    )
    assert decision.votes["uncached_tokens"] == 1 and decision.votes["uncached_tokens_trend"] == 1
    assert decision.desired_replicas == 1
    # Prompts queueing as well (0 → 2 waiting in 10 s, 4 projected): the cap is the projected count, 1 + 4.
    history = (Recommendation(0.0, 1, 1, 1, PoolSignals(queue_depth=0, in_flight=1, uncached_tokens=900.0)),)
    now = PoolSignals(queue_depth=2, in_flight=1, uncached_tokens=3 * LONG_PROMPT_TOKENS)
    queueing, _ = decide(
        role="prefill",
        current_replicas=1,
        signals=now,
        pool=PoolSpec(max_replicas=10),
        policy=SIX_HUNDRED,
        slo=SLO,
        history=history,
        now_s=10.0,
    )
    # Level: 2,700 tokens ask 5, three prompts cap it at 3; trend: 4,500 tokens ask 8, 1 + 4 prompts cap it at 5.
    assert queueing.votes["uncached_tokens"] == 3 and queueing.votes["uncached_tokens_trend"] == 5
