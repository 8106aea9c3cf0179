"""Scaling decisions for one pool, as a pure function of signals, policy and history.

Called by :mod:`tandem_operator.handlers` (the autoscaling timer) and by the
simulated load test with :class:`PoolSignals` read by
:mod:`tandem_operator.signals`. Nothing here reads a clock or the network:
``now_s`` and the recommendation history come in, a :class:`Decision` and
the new history go out.

Each pool scales on its own signal:

* **prefill** — requests waiting in the router for prefill budget per replica,
  uncached prompt tokens in flight on prefill workers (and queued for them) per
  replica, but for no more replicas than there are prompts (below), TTFT p90
  against its SLO (only while prefill is short: TTFT also holds the wait for
  decode budget, which prefill replicas cannot shorten);
* **decode** — the router's decode budget in use and average KV-cache usage
  against targets, requests waiting for decode (in the router for decode
  budget, or in the decode engines' queues) per replica, ITL p90 against its SLO.

**A prompt is computed by one worker.** The uncached-tokens vote, ``ceil(tokens / uncachedTokensPerReplica)``,
asks for at most as many replicas as there are prompts on the prefill pool (:func:`prompts_on_prefill`:
the requests placed on its workers plus those waiting for its budget, the router's
``pool_in_flight_requests{role="prefill"}`` and ``queued_requests{waiting_for="prefill"}``), and for one
while any token is counted: one 900-token prompt against a 600-token target asked for 2 replicas, and a
handful of long prompts grew the SIMULATED prefill pool of ``make autoscale-demo --scenario long-prompts``
to 6, while a second worker cannot compute any part of a prompt the first holds. Many prompts still scale
by their tokens (the cap is far above the vote), and the trend vote is capped alike on the projected
signals (the queue's growth projected, the requests in flight as they are). The count is an upper bound:
a request stays in flight on its prefill worker until its Release, through its decode, so prompts already
computed still count and the cap only loosens (never asks for fewer replicas than the prompts could use);
no count is known (either signal missing): no cap. The TTFT vote's "prefill is short" test keeps the
uncapped backlog (over the target per replica): capped too, it held the SIMULATED long-prompts pool at one
replica for a minute of TTFT p90 at 5.1-9.3 s (prompts arrived faster than one worker computed them, and
the sampled queue and in-flight gauges read 0 or 1 between them), and the breach fraction rose from 0.269
to 0.517; the TTFT window sees those waits, the instant counts miss them.

**Measured capacity.** Where ``autoscaling.capacity`` gives a pool's per-worker tokens/s (``tandem-loadtest
sweep``'s knee: within the SLO), the pool's demand in tokens/s (``token_rate``: uncached prompt tokens
arriving at the routers for prefill workers, output tokens handed to clients) votes for ``ceil(rate /
per-worker)`` replicas, and its slope for as many a start time ahead; 0 (not measured) leaves the vote out.
Prefill's demand is what *arrives* (each request counted once, placed at once or queued), not what was
placed: a saturated pool places at its capacity, so the placed tokens' rate asked for exactly the replicas
there were, and only the queue's votes, later, asked for more.

Both pools also vote on **demand**: while requests wait for a pool's budget,
the pool is full, and it is sized to hold what it holds now plus what waits
(``ceil(ready × (in_flight + waiting) / in_flight)``), in one decision rather
than a step per window.

The raw recommendation is the largest count any signal asks for. As in the
Kubernetes HPA, a scale-up takes the *smallest* recommendation seen within the
scale-up window (a spike must last). A scale-down needs the pool to have
sat at its current size for the whole scale-down window, every recommendation
made at that size asking for fewer, and then removes at most one step: after
each step the pool is watched for a full window again, because taking a
decode worker away raises the others' batch and their ITL only with a lag.
Then the step caps and min/max apply. Each change names the votes that set it
(:attr:`Decision.step`, e.g. ``prefill 1->2 by uncached_tokens_trend``: on the way up every vote
asking for that many or more, on the way down the largest), in the operator's decision log and
the demo's.
A latency above ``scale_down_slo_fraction × SLO`` vetoes any scale-down.

**From and to zero.** A pool with ``minReplicas: 0`` goes to zero as any scale-down does (every
recommendation asking for zero for the window, a step at a time). At zero, the router refuses its
requests (503 with Retry-After) and counts them as the pool's **pending demand**; any pending demand
votes for at least one replica, and a pool at zero grows at once, without the scale-up window: it
serves nobody, so there is no spike to filter.

Only ready replicas count as capacity: the proportional votes (KV usage,
latency) multiply the *ready* count, and while some replicas are still starting
the pool never shrinks (their capacity is on its way; the start-up time of the
pool, however long, is the cooldown after a scale-up).

**Capacity coming.** Replicas requested and not ready yet are credited: while any this loop asked
for are starting (for less than two start times), the pool does not grow further (``scale up
held``). Until they are ready, the backlog and the latency of the ready ones go on growing whatever
their number (the queue fills at the shortfall of the *ready* replicas), so votes read then ask for
more and more: a constant backlog went
2 → 4 → 6 → 7 in 60 s with no new pod ready. Their recommendations stay in the history, so the
pool grows at once after they are ready if the ready pool still asks for more. A pool at zero
starts as before.

**Ahead of the ramp.** Each load signal (queue, uncached tokens, budget and KV usage, requests
waiting, and the pool's demand) also votes on where it is heading: its slope over the last
``max(scale-up window, 3 intervals)`` of recommendations, projected over the pool's start time
(measured from the history: from the first recommendation made at a size to the one that saw that
many ready; until measured, the scale-up window plus one interval). These ``*_trend`` votes only
grow a pool (a falling slope projects nothing), so a new replica is asked for a start time before
the level alone would ask for it, and is ready when the load arrives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from tandem_operator.spec import AutoscalingSpec, PoolSpec, Role, SloSpec


@dataclass(frozen=True)
class PoolSignals:
    """What the pool's load looks like now; ``None`` where the source had no data."""

    #: Requests waiting in the router for prefill budget (prefill).
    queue_depth: float | None = None
    #: Uncached prompt tokens the router has in flight on prefill workers or queued for them (prefill).
    uncached_tokens: float | None = None
    #: Time to first token, p90 over the last minute, seconds (prefill).
    ttft_p90_s: float | None = None
    #: Requests the router has placed on the pool's workers and not yet released (both pools).
    in_flight: float | None = None
    #: Average over the decode workers of the router's token budget in use, 0..1 (decode).
    budget_usage: float | None = None
    #: Average KV-cache usage of the decode workers, 0..1 (decode).
    kv_usage: float | None = None
    #: Requests waiting for decode: in the router for decode budget, or in the decode engines' queues (decode).
    waiting: float | None = None
    #: Inter-token latency, p90 over the last minute, seconds (decode).
    itl_p90_s: float | None = None
    #: The pool's demand in tokens/s over the last minute: uncached prompt tokens arriving at the routers
    #: for prefill workers, placed at once or queued (prefill), output tokens the gateways handed to
    #: clients (decode).
    token_rate: float | None = None
    #: Requests refused lately because the pool had no worker at all (it is at zero; both pools).
    pending_demand: float | None = None
    #: Sources that did not answer this time (router pods, by name): the signals they feed are ``None``
    #: rather than a sum short of their share (which would read as less load than there is).
    unread_from: tuple[str, ...] = ()


@dataclass(frozen=True)
class Recommendation:
    at_s: float
    #: What the signals asked for (within min/max).
    num_replicas: int
    #: The pool's replica count when it was made.
    at_replicas: int
    #: Its ready replicas then (None: not known, e.g. a history from before this field).
    ready: int | None = None
    #: The signals it was made from (their slopes are the trend votes').
    signals: PoolSignals | None = None
    #: The pool's start time (request to ready) last measured, seconds; carried from one to the next.
    start_s: float | None = None


@dataclass(frozen=True)
class Decision:
    role: Role
    current_replicas: int
    #: What the signals alone ask for (before windows, steps and bounds).
    raw_replicas: int
    desired_replicas: int
    reason: str
    signals: PoolSignals
    #: Per signal, the replica count it asks for.
    votes: dict[str, int] = field(default_factory=dict)
    #: For a change, the votes that set it (:func:`step_drivers`); empty when the count holds.
    drivers: tuple[str, ...] = ()

    @property
    def changed(self) -> bool:
        return self.desired_replicas != self.current_replicas

    @property
    def step(self) -> str:
        """The change in one line, naming what drove it (``prefill 1->2 by uncached_tokens_trend``); "" if none."""
        if not self.changed:
            return ""
        return f"{self.role} {self.current_replicas}->{self.desired_replicas} by {'+'.join(self.drivers)}"


def step_drivers(votes: dict[str, int], current: int, desired: int, pool: PoolSpec) -> tuple[str, ...]:
    """The votes that set a change from ``current`` to ``desired`` replicas, sorted by name. Up: every
    vote asking for ``desired`` or more (each alone would have grown the pool this far); down: the
    largest votes (the pool shrinks to what the most demanding signal still asks). A change no vote
    asks for is the bounds': ``minReplicas`` or ``maxReplicas``."""
    if desired > current:
        named = sorted(k for k, v in votes.items() if v >= desired)
        return tuple(named) if named else ("minReplicas",)
    if desired < current:
        if current > pool.max_replicas and desired == pool.max_replicas:
            return ("maxReplicas",)
        top = max(votes.values(), default=None)
        return tuple(sorted(k for k, v in votes.items() if v == top)) if top is not None else ("maxReplicas",)
    return ()


def _ratio_vote(current: int, observed: float, target: float, tolerance: float) -> int:
    """HPA's rule: ceil(current × observed/target), unchanged within the tolerance band. Fewer
    replicas only where the same load stays under the band's lower edge: the removed replicas' share
    lands on the others, and a fuller decode batch runs slower, so its requests live longer and the
    usage climbs past the plain proportion (without this margin the simulated decode pool stepped
    5 → 4 → 6 on a flat plateau)."""
    ratio = observed / target
    if abs(ratio - 1.0) <= tolerance:
        return current
    wanted = max(1, math.ceil(max(current, 1) * ratio)) if observed > 0 else 0
    if wanted < current:
        return min(current, math.ceil(current * observed / (target * (1.0 - tolerance))))
    return wanted


def _total_vote(total: float, per_replica: float) -> int:
    """Replicas so that each holds at most ``per_replica`` of ``total``."""
    return math.ceil(total / per_replica) if total > 0 else 0


def prompts_on_prefill(signals: PoolSignals) -> float | None:
    """The prompts the prefill pool holds or is about to: requests placed on its workers and not yet
    released, plus those waiting for its budget; None when either count is unknown. An upper bound (a
    request is released after its decode, not its prefill): the module docstring says why that is safe."""
    if signals.in_flight is None or signals.queue_depth is None:
        return None
    return signals.in_flight + signals.queue_depth


def _uncached_tokens_vote(uncached_tokens: float, per_replica: float, num_prompts: float | None) -> int:
    """:func:`_total_vote` of the uncached tokens, for no more replicas than ``num_prompts`` (a prompt is
    computed by one worker), and one at least while any token is counted (the two gauges are published
    apart, so a count of 0 beside tokens is a count not yet refreshed). ``num_prompts`` None: no cap."""
    wanted = _total_vote(uncached_tokens, per_replica)
    if num_prompts is None or wanted == 0:
        return wanted
    return min(wanted, max(1, math.ceil(num_prompts)))


def _demand_vote(current: int, in_flight: float | None, waiting: float) -> int | None:
    """Requests wait for the pool's budget, so the pool is full: grow it in proportion to the demand
    (placed + waiting) over what it holds now, in one decision, not one step per window. None
    (no vote) when nothing waits, or the requests in flight are unknown: how far below full the
    pool is, other signals tell."""
    if waiting <= 0 or in_flight is None:
        return None
    if in_flight <= 0:
        return current + 1
    return max(current + 1, math.ceil(max(current, 1) * (in_flight + waiting) / in_flight))


def _latency_vote(current: int, p90_s: float, slo_s: float, scale_down_fraction: float) -> int:
    if p90_s > slo_s:
        # Over the SLO: grow in proportion, and by at least one.
        return max(current + 1, math.ceil(max(current, 1) * p90_s / slo_s))
    if p90_s > scale_down_fraction * slo_s:
        return current  # close to the SLO: hold, never shrink
    return 0  # comfortable: latency does not stand in the way of a scale-down


#: Votes that only say whether latency stands in the way: 0 means "no objection", not "no load".
LATENCY_VOTES = frozenset({"ttft_p90", "itl_p90"})


#: The signals whose growth votes (the load, not its symptoms): by role.
TREND_FIELDS: dict[Role, tuple[str, ...]] = {
    "prefill": ("queue_depth", "uncached_tokens", "token_rate"),
    "decode": ("budget_usage", "kv_usage", "waiting", "token_rate"),
}


def slope(samples: list[tuple[float, float]]) -> float | None:
    """Least-squares slope (per second) of ``(t_s, value)`` samples; None with fewer than two times."""
    if len({t for t, _ in samples}) < 2:
        return None
    n = len(samples)
    mean_t = sum(t for t, _ in samples) / n
    mean_v = sum(v for _, v in samples) / n
    num = sum((t - mean_t) * (v - mean_v) for t, v in samples)
    den = sum((t - mean_t) ** 2 for t, _ in samples)
    return num / den


def projected(
    role: Role,
    signals: PoolSignals,
    history: tuple[Recommendation, ...],
    now_s: float,
    window_s: float,
    horizon_s: float,
) -> PoolSignals | None:
    """``signals`` with each load signal moved along its rising slope over the last ``window_s``
    (history and now) by ``horizon_s``; None where no load signal rises."""
    changes: dict[str, Any] = {}
    for name in TREND_FIELDS[role]:
        now_value = getattr(signals, name)
        if now_value is None:
            continue
        points = [
            (r.at_s, v)
            for r in history
            if r.signals is not None and now_s - r.at_s <= window_s and (v := getattr(r.signals, name)) is not None
        ]
        rate = slope([*points, (now_s, now_value)])
        if rate is not None and rate > 0:
            changes[name] = now_value + rate * horizon_s
    if not changes:
        return None
    return replace(signals, **changes)


def trend_votes(
    role: Role, current: int, now: PoolSignals, ahead: PoolSignals, policy: AutoscalingSpec
) -> dict[str, int]:
    """The load votes of ``votes_for`` on the projected signals ``ahead``, as ``<signal>_trend``, for
    the signals that rose (and the demand vote where the requests waiting rose). Latency has none."""
    votes = votes_for(role, current, ahead, policy, None)
    rose = {name for name in TREND_FIELDS[role] if getattr(ahead, name) != getattr(now, name)}
    out = {f"{name}_trend": votes[name] for name in sorted(rose) if name in votes}
    if "demand" in votes and ("queue_depth" if role == "prefill" else "waiting") in rose:
        out["demand_trend"] = votes["demand"]
    return out


def measured_start_s(history: tuple[Recommendation, ...], ready: int, now_s: float) -> float | None:
    """Seconds from the decision that grew the pool to ``ready`` replicas to now, if ``ready`` is
    more than the last recommendation saw ready (a replica became ready since); else None."""
    if not history or history[-1].ready is None or ready <= history[-1].ready:
        return None
    # The trailing run of recommendations made at ``ready`` replicas or more; the one before it grew the pool.
    index = len(history)
    while index > 0 and history[index - 1].at_replicas >= ready:
        index -= 1
    if index == len(history) or index == 0:
        return None  # not grown within the history (e.g. the operator restarted): nothing to time
    return now_s - history[index - 1].at_s


def _capacity_coming(
    history: tuple[Recommendation, ...], current: int, ready: int, now_s: float, start_s: float
) -> bool:
    """Some replicas are starting because this loop grew the pool (a decision within the history was
    made below ``current``), less than two start times ago. Replicas not ready for another reason (a
    rollout replacing pods, an operator restart: no such decision) or for far longer than a start
    (unschedulable, crashing) are no capacity coming, and the pool may grow past them."""
    if ready >= current:
        return False
    grown = [r.at_s for r in history if r.at_replicas < current]
    return bool(grown) and now_s - grown[-1] < 2 * start_s


def votes_for(
    role: Role, current: int, signals: PoolSignals, policy: AutoscalingSpec, slo: SloSpec | None
) -> dict[str, int]:
    """Per available signal, how many replicas it asks for (``slo`` None: no latency votes)."""
    votes: dict[str, int] = {}
    if signals.pending_demand is not None and signals.pending_demand > 0:
        # Requests found no worker of this pool: it needs one at least (from zero, the other votes
        # read an empty pool's zeros); how many more, the pool's own signals tell once it serves.
        votes["pending_demand"] = max(current, 1)
    per_worker = (
        policy.capacity.prefill_tokens_per_second_per_worker
        if role == "prefill"
        else policy.capacity.decode_tokens_per_second_per_worker
    )
    if signals.token_rate is not None and per_worker > 0:
        # Measured capacity (tandem-loadtest sweep's knee): as many workers as the demand's tokens/s need.
        votes["token_rate"] = _total_vote(signals.token_rate, per_worker)
    if role == "prefill":
        targets = policy.prefill
        if signals.queue_depth is not None:
            votes["queue_depth"] = _total_vote(signals.queue_depth, targets.queue_depth_per_replica)
            demand = _demand_vote(current, signals.in_flight, signals.queue_depth)
            if demand is not None:
                votes["demand"] = demand
        if signals.uncached_tokens is not None:
            votes["uncached_tokens"] = _uncached_tokens_vote(
                signals.uncached_tokens, targets.uncached_tokens_per_replica, prompts_on_prefill(signals)
            )
        if signals.ttft_p90_s is not None and slo is not None:
            ttft = _latency_vote(current, signals.ttft_p90_s, slo.ttft_p90_seconds, policy.scale_down_slo_fraction)
            # TTFT is both pools' (a request waits for decode budget before its prefill too): it grows
            # prefill only where prefill is short, requests waiting for its budget or its backlog over
            # target. Otherwise a breach holds prefill (no shrinking) and decode's own votes act. The
            # backlog here is not capped by the prompts (module docstring: the count misses waits).
            prefill_short = (signals.queue_depth or 0) > 0 or (
                signals.uncached_tokens is not None
                and signals.uncached_tokens > current * targets.uncached_tokens_per_replica
            )
            votes["ttft_p90"] = ttft if prefill_short else min(ttft, current)
    else:
        if signals.budget_usage is not None:
            votes["budget_usage"] = _ratio_vote(
                current, signals.budget_usage, policy.decode.budget_usage, policy.tolerance
            )
        if signals.waiting is not None:
            demand = _demand_vote(current, signals.in_flight, signals.waiting)
            if demand is not None:
                votes["demand"] = demand
        if signals.kv_usage is not None:
            votes["kv_usage"] = _ratio_vote(current, signals.kv_usage, policy.decode.kv_usage, policy.tolerance)
        if signals.waiting is not None:
            votes["waiting"] = _total_vote(signals.waiting, policy.decode.waiting_per_replica)
        if signals.itl_p90_s is not None and slo is not None:
            votes["itl_p90"] = _latency_vote(
                current, signals.itl_p90_s, slo.itl_p90_seconds, policy.scale_down_slo_fraction
            )
    return votes


def decide(
    *,
    role: Role,
    current_replicas: int,
    signals: PoolSignals,
    pool: PoolSpec,
    policy: AutoscalingSpec,
    slo: SloSpec,
    history: tuple[Recommendation, ...],
    now_s: float,
    ready_replicas: int | None = None,
) -> tuple[Decision, tuple[Recommendation, ...]]:
    """The replica count for ``role`` now, and the recommendation history to pass next time.

    ``ready_replicas`` (None: all of ``current_replicas``) is the capacity the signals describe.
    An empty history is seeded with the current count, so an operator restart
    never scales down before a full scale-down window has passed.
    """
    ready = current_replicas if ready_replicas is None else max(0, min(ready_replicas, current_replicas))
    votes = votes_for(role, ready, signals, policy, slo)
    start_s = measured_start_s(history, ready, now_s)
    if start_s is None and history:
        start_s = history[-1].start_s
    horizon_s = start_s if start_s is not None else policy.scale_up_stabilization_seconds + policy.interval_seconds
    trend_window_s = max(policy.scale_up_stabilization_seconds, 3 * policy.interval_seconds)
    ahead = projected(role, signals, history, now_s, trend_window_s, horizon_s) if votes else None
    if ahead is not None:
        votes.update(trend_votes(role, ready, signals, ahead, policy))
    if not history:
        history = (Recommendation(now_s, current_replicas, current_replicas, ready, None, start_s),)
    if not votes:
        decision = Decision(role, current_replicas, current_replicas, current_replicas, "no metrics: hold", signals)
        return decision, history

    raw = max(votes.values())
    if LATENCY_VOTES.issuperset(votes):
        # Latency alone (the router's series missing, e.g. its export stalled under load) may grow the
        # pool, never shrink it: its 0 is no objection, and with minReplicas 0 it took a loaded pool to zero.
        raw = max(raw, current_replicas)
    raw_bounded = min(max(raw, pool.min_replicas), pool.max_replicas)
    # The windows, the trend's and two start times (how long started replicas count as capacity coming).
    keep_s = max(
        policy.scale_up_stabilization_seconds, policy.scale_down_stabilization_seconds, trend_window_s, 2 * horizon_s
    )
    # Keep the window's worth, plus the newest older one: it proves how long the pool has had its size.
    older = [r for r in history if now_s - r.at_s > keep_s]
    earlier = (*older[-1:], *(r for r in history if now_s - r.at_s <= keep_s))
    history = (*earlier, Recommendation(now_s, raw_bounded, current_replicas, ready, signals, start_s))

    top_signal = max(votes, key=lambda k: votes[k])
    desired = current_replicas
    reason = f"steady ({top_signal} asks {raw})"
    if current_replicas == 0 and raw_bounded > 0:
        # A pool at zero refuses every request it gets: no spike to filter, start it in this interval.
        desired = min(raw_bounded, policy.max_scale_up_step)
        reason = f"scale from zero: {top_signal} asks {raw}"
    elif raw_bounded > current_replicas and _capacity_coming(earlier, current_replicas, ready, now_s, horizon_s):
        # Capacity coming: what the ready replicas' backlog and latency ask for now they would ask for
        # whatever the number starting; the recommendation stays in the history for when they are ready.
        starting = current_replicas - ready
        reason = f"scale up held: {starting} of {current_replicas} replicas still starting ({top_signal} asks {raw})"
    elif raw_bounded > current_replicas:
        window = [r.num_replicas for r in earlier if now_s - r.at_s < policy.scale_up_stabilization_seconds]
        stable = min([raw_bounded, *window])
        if stable > current_replicas:
            desired = min(stable, current_replicas + policy.max_scale_up_step)
            reason = f"scale up: {top_signal} asks {raw}"
        else:
            reason = f"scale up pending: {top_signal} asks {raw}, waiting for the stabilisation window"
    elif raw_bounded < current_replicas:
        window_s = policy.scale_down_stabilization_seconds
        run_start_s = now_s
        for r in reversed(earlier):  # the trailing run of recommendations made at this size
            if r.at_replicas != current_replicas:
                break
            run_start_s = r.at_s
        sat_long_enough = now_s - run_start_s >= window_s
        in_window = [r.num_replicas for r in earlier if now_s - r.at_s < window_s]
        stable = max([raw_bounded, *in_window])
        if ready < current_replicas:
            reason = f"scale down held: {current_replicas - ready} of {current_replicas} replicas still starting"
        elif sat_long_enough and stable < current_replicas:
            desired = max(stable, current_replicas - policy.max_scale_down_step)
            reason = f"scale down: load asks {raw} ({top_signal})"
        else:
            reason = f"scale down pending: load asks {raw}, waiting for the stabilisation window"
    desired = min(max(desired, pool.min_replicas), pool.max_replicas)
    if desired != current_replicas and (current_replicas < pool.min_replicas or current_replicas > pool.max_replicas):
        reason = f"clamped into [{pool.min_replicas}, {pool.max_replicas}]"
    drivers = step_drivers(votes, current_replicas, desired, pool)
    return Decision(role, current_replicas, raw, desired, reason, signals, votes, drivers), history
