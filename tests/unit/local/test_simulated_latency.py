"""tandem.local.simulated_latency: the SIMULATED prefill worker's capacity, as make autoscale-demo sizes its
router's budget from it (tests/chart/test_one_set_of_numbers.py checks the chart gives the same budget)."""

from __future__ import annotations

import pytest

from tandem.local.simulated_latency import SimulatedLatencyModel


def test_prefill_capacity_is_prompts_back_to_back() -> None:
    model = SimulatedLatencyModel.from_json()
    # One prompt at a time: a 900-token prompt every prefill_s(900) seconds (~4.1 s with the fitted CPU line).
    assert model.prefill_tokens_per_s(900) == pytest.approx(
        900 / (model.prefill_base_s + 900 * model.prefill_s_per_token)
    )
    assert model.prefill_tokens_per_s(900) * model.prefill_s(900) == pytest.approx(900)
    # The fixed cost per prompt makes short prompts the slower per token.
    assert model.prefill_tokens_per_s(200) < model.prefill_tokens_per_s(900) < 1 / model.prefill_s_per_token
    # A faster clock (time_scale) is capacity in proportion.
    fast = SimulatedLatencyModel.from_json(time_scale=0.5)
    assert fast.prefill_tokens_per_s(900) == pytest.approx(2 * model.prefill_tokens_per_s(900))
