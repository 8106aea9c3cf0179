"""The router's prefill budget and the autoscaler's per-replica target, from measured per-worker capacity.

One formula, two renderings. The chart computes it in its templates for the router's environment and the
TandemDeployment it renders (``tandem.prefillBudgetTokens`` in ``charts/tandem/templates/_helpers.tpl``,
the target in ``templates/tandemdeployment.yaml``); Go templates cannot call Python, so
``tests/chart/test_one_set_of_numbers.py`` renders the chart for several inputs and asserts it gives
these functions' numbers. ``make autoscale-demo`` (``loadtest/autoscale_demo.py``) sizes its router's
budget and its autoscaler's target with them from its SIMULATED workers' capacity and its SLO.

The budget is what one prefill worker computes within a share of the TTFT target (the rest of the target
is the router's queue, the KV handoff and the first decode step), so a request waiting for prefill budget
means the pool is short of capacity; the autoscaler holds a share of it per replica (``budgetUsage``),
which the operator reads as ``autoscaling.prefill.uncachedTokensPerReplica``. Nothing here reads the
network or a clock.
"""

from __future__ import annotations

import math

#: ``router.prefillBudgetTtftShare``'s default in ``charts/tandem/values.yaml`` (a chart test holds them equal).
DEFAULT_PREFILL_BUDGET_TTFT_SHARE = 0.5


def prefill_budget_tokens(
    prefill_tokens_per_second_per_worker: float, ttft_p90_seconds: float, ttft_share: float
) -> int | None:
    """Uncached prompt tokens the router lets one prefill worker have in flight: per-worker tokens/s ×
    TTFT target × ``ttft_share``, rounded down, at least 1; None where the capacity is not measured (0:
    the chart then takes ``router.prefillTokensInFlight``). Multiplied left to right in float64 as the
    chart's ``mulf`` does, so both round down the same product."""
    if prefill_tokens_per_second_per_worker <= 0:
        return None
    return max(1, math.floor(prefill_tokens_per_second_per_worker * ttft_p90_seconds * ttft_share))


def uncached_tokens_per_replica(budget_tokens: int, budget_usage: float) -> float:
    """The prefill autoscaler's target per replica: ``budget_usage`` of the router's budget per worker."""
    return budget_tokens * budget_usage
