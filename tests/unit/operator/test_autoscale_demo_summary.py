"""make autoscale-demo's reversal count: one change of direction per load peak is the load's, any
other is the controller flapping."""

from __future__ import annotations

import pytest

from tests.kit import autoscale_demo


@pytest.fixture(scope="module")
def count_reversals():  # type: ignore[no-untyped-def]
    return autoscale_demo.load().count_reversals


def test_one_peak_is_no_reversal_and_anything_else_counts(count_reversals) -> None:  # type: ignore[no-untyped-def]
    up, down = True, False
    assert count_reversals([]) == 0
    assert count_reversals([up, up, down, down]) == 0  # up the ramp, down after the peak
    assert count_reversals([up, down, up, down]) == 2  # stepped down on the way up, then up again
    assert count_reversals([up, up, up]) == 0
    assert count_reversals([down, up]) == 1  # below the minimum it starts from: a reversal


@pytest.fixture(scope="module")
def demo():  # type: ignore[no-untyped-def]
    return autoscale_demo.load()


def test_the_line_says_the_cold_start_and_decode_returns_to_zero(demo) -> None:  # type: ignore[no-untyped-def]
    """Decode starts at zero in the demo: back at its minimum means back at zero, and the line ends with the
    first request's wait from zero."""
    spec = demo.demo_spec("SmolLM2-135M-Instruct")
    assert spec.pools.get("decode").min_replicas == 0 and spec.pools.get("decode").replicas == 0
    quiet = {"prefill": demo.PoolSignals(), "decode": demo.PoolSignals()}

    def tick(t_s: float, decode: int) -> object:
        return demo.Tick(t_s, {"prefill": 1, "decode": decode}, {"prefill": 1, "decode": decode}, quiet)

    back = demo.summary(spec, [tick(0, 0), tick(10, 3), tick(20, 0)], [], 15.0, 43.24)
    assert back.endswith("peak_decode=3 returned_to_min=yes from_zero_s=43.2"), back
    stuck = demo.summary(spec, [tick(0, 0), tick(10, 1)], [], 15.0, 43.24)
    assert "returned_to_min=no" in stuck


def test_the_decision_log_names_the_votes_that_set_each_step(demo) -> None:  # type: ignore[no-untyped-def]
    """decisions.jsonl's ``step`` comes from the operator's own decide(): a backlog rising by half a
    replica's worth every interval, level asking 2 all along, is grown by its trend; a pool at zero by its
    pending demand; a quiet pool shrinks by the largest vote; a held pool names no step."""
    spec = demo.demo_spec("SmolLM2-135M-Instruct")
    policy = spec.autoscaling.model_copy(update={"scale_up_stabilization_seconds": 0})
    per_replica = policy.prefill.uncached_tokens_per_replica
    history: tuple[object, ...] = ()
    records = []
    for t, level in [(0, 1.0), (10, 1.5), (20, 2.0)]:
        decision, history = demo.decide(
            role="prefill",
            current_replicas=2,
            signals=demo.PoolSignals(queue_depth=0, uncached_tokens=level * per_replica),
            pool=spec.pools.get("prefill"),
            policy=policy,
            slo=spec.slo,
            history=history,
            now_s=float(t),
        )
        records.append(demo.decision_record(float(t), decision, 2))
    assert [r["step"] for r in records[:2]] == ["", ""]
    assert records[2]["step"] == "prefill 2->3 by uncached_tokens_trend", records[2]
    assert records[2]["votes"]["uncached_tokens"] == 2 and records[2]["simulated"] is True

    from_zero, _ = demo.decide(
        role="decode",
        current_replicas=0,
        signals=demo.PoolSignals(pending_demand=1, waiting=0, in_flight=0),
        pool=spec.pools.get("decode"),
        policy=policy,
        slo=spec.slo,
        history=(),
        now_s=0.0,
    )
    assert demo.decision_record(0.0, from_zero, 0)["step"] == "decode 0->1 by pending_demand"

    quiet_policy = policy.model_copy(update={"scale_down_stabilization_seconds": 0})
    quiet, _ = demo.decide(
        role="decode",
        current_replicas=3,
        signals=demo.PoolSignals(budget_usage=0.3, waiting=0, in_flight=2, itl_p90_s=0.05),
        pool=spec.pools.get("decode"),
        policy=quiet_policy,
        slo=spec.slo,
        history=(),
        now_s=0.0,
    )
    assert quiet.desired_replicas == 2 and quiet.step == "decode 3->2 by budget_usage", quiet


def test_the_scenario_line_counts_each_pools_steps_up(demo) -> None:  # type: ignore[no-untyped-def]
    """--scenario short-chats fails where prefill grew twice, whatever decode did."""
    scenario = demo.SCENARIOS["short-chats"]
    assert scenario.one_step_pool == "prefill" and demo.SCENARIOS["long-prompts"].one_step_pool == "decode"
    quiet = demo.PoolSignals()

    def step(role: str, current: int, desired: int, by: str) -> tuple[float, object]:
        return 0.0, demo.Decision(role, current, desired, desired, "scale", quiet, {by: desired}, (by,))

    once = [
        step("prefill", 1, 2, "queue_depth"),
        step("decode", 1, 3, "budget_usage"),
        step("decode", 3, 4, "kv_usage"),
    ]
    line = demo.scenario_summary(scenario, once)
    assert "prefill_steps_up=1 decode_steps_up=2 prefill_within_one_step=yes" in line, line
    assert line.endswith("steps=prefill 1->2 by queue_depth; decode 1->3 by budget_usage; decode 3->4 by kv_usage")
    twice = [*once, step("prefill", 2, 3, "uncached_tokens_trend")]
    assert "prefill_within_one_step=no" in demo.scenario_summary(scenario, twice)
    # The load shape: ramp, plateau, ramp down, then nothing.
    assert (
        scenario.offered_rps(0) == scenario.low_rps and scenario.offered_rps(scenario.ramp_s + 1) == scenario.high_rps
    )
    assert scenario.offered_rps(2 * scenario.ramp_s + scenario.plateau_s + 1) == 0.0


@pytest.mark.parametrize("scenario", ["ramp", "short-chats", "long-prompts"])
def test_the_demo_gives_the_operator_its_simulated_prefill_capacity(demo, scenario: str) -> None:  # type: ignore[no-untyped-def]
    """The demo's spec carries the SIMULATED prefill workers' capacity (what a sweep would measure at the
    scenario's prompt size), so the prefill pool votes token_rate: the tokens/s arriving for prefill over
    one worker's. Long prompts at their 0.5 req/s plateau (450 tokens/s) ask for 3 workers; decode's
    capacity is not measured, so decode casts no such vote."""
    sc = demo.SCENARIOS[scenario]
    spec = demo.demo_spec("SmolLM2-135M-Instruct", sc)
    per_worker = spec.autoscaling.capacity.prefill_tokens_per_second_per_worker
    assert per_worker == demo.simulated_prefill_tokens_per_s(sc) > 0
    assert spec.autoscaling.capacity.decode_tokens_per_second_per_worker == 0

    def votes(role: str, signals: object) -> dict[str, int]:
        pool = spec.pools.get(role)
        decision, _ = demo.decide(
            role=role,
            current_replicas=1,
            signals=signals,
            pool=pool,
            policy=spec.autoscaling,
            slo=spec.slo,
            history=(),
            now_s=0.0,
            ready_replicas=1,
        )
        return dict(decision.votes)

    plateau = sc.high_rps * sc.prompt_tokens
    prefill = votes("prefill", demo.PoolSignals(queue_depth=0, token_rate=plateau))
    assert prefill["token_rate"] == -(-plateau // per_worker)
    assert "token_rate" not in votes("decode", demo.PoolSignals(waiting=0, token_rate=1e6))
    if scenario == "long-prompts":
        assert prefill["token_rate"] == 3
    if scenario == "short-chats":
        assert prefill["token_rate"] == 1  # 72 tokens/s of 119: short chats do not grow prefill by it
