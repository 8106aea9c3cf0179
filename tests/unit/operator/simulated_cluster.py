"""A simulated Tandem cluster for the autoscaling load test: simulated prefill
and decode workers under a time-varying request rate, stepped in simulated time.

Nothing here is a model or an engine. The worker capacities below are made-up
round numbers chosen so that one replica cannot hold the peak load; they say
nothing about any model's speed. What is real is the decision loop: the test
feeds these signals to :func:`tandem_operator.autoscale.decide`, exactly as the
operator's timer does, and applies its decisions with start-up and drain delays.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tandem_operator.autoscale import Decision, PoolSignals, Recommendation, decide
from tandem_operator.spec import ROLES, Role, TandemSpec

#: Simulated prefill throughput of one worker, uncached prompt tokens per second.
SIMULATED_PREFILL_TOKENS_PER_S = 4000.0
#: Simulated decode: sequences one worker's KV cache holds.
SIMULATED_DECODE_KV_SEQUENCES = 48
#: Simulated inter-token latency: base + per active sequence on the worker.
SIMULATED_ITL_BASE_S = 0.02
SIMULATED_ITL_PER_SEQUENCE_S = 0.001
#: Simulated request shape.
SIMULATED_UNCACHED_PROMPT_TOKENS = 1000
SIMULATED_OUTPUT_TOKENS = 200
#: A new worker is ready this long after the scale-up (image pulled, model loaded).
SIMULATED_STARTUP_S = 60.0


@dataclass
class SimulatedPool:
    role: Role
    replicas: int  # the Deployment's spec.replicas, as the operator sets it
    ready_at_s: list[float] = field(default_factory=list)  # one entry per pod: when it is ready

    def num_ready(self, now_s: float) -> int:
        return sum(1 for t in self.ready_at_s if t <= now_s)

    def apply(self, desired: int, now_s: float) -> None:
        """Scale-up adds pods that are ready after the start-up delay; scale-down removes the
        newest pods first. A removed worker drains: in this simulation its in-flight work
        simply stays in the pool's backlog or active set and is finished by the others."""
        while len(self.ready_at_s) < desired:
            self.ready_at_s.append(now_s + SIMULATED_STARTUP_S)
        del self.ready_at_s[desired:]
        self.replicas = desired


@dataclass
class Sample:
    t_s: float
    arrival_rate: float
    prefill_replicas: int
    prefill_ready: int
    decode_replicas: int
    decode_ready: int
    signals: dict[Role, PoolSignals]


@dataclass
class SimulatedCluster:
    """Fluid model, stepped every ``dt_s``: prefill is a token queue, decode a set of active sequences."""

    spec: TandemSpec
    rate_per_s: Callable[[float], float]
    autoscale: bool = True
    dt_s: float = 1.0
    backlog_tokens: float = 0.0
    active_sequences: float = 0.0
    pools: dict[Role, SimulatedPool] = field(default_factory=dict)
    history: dict[Role, tuple[Recommendation, ...]] = field(default_factory=dict)
    decisions: list[tuple[float, Decision]] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)

    def __post_init__(self) -> None:
        for role in ROLES:
            pool = self.spec.pools.get(role)
            self.pools[role] = SimulatedPool(role, pool.replicas, [0.0] * pool.replicas)

    def _signals(self, now_s: float, arrival_rate: float) -> dict[Role, PoolSignals]:
        # In flight at the router (Little's law): arrivals × time in prefill,
        # counted at the batch's service time. TTFT waits like a processor-sharing
        # queue at utilisation rho: service/(1-rho), p90 ≈ 2.3 × the mean.
        prefill_ready = max(self.pools["prefill"].num_ready(now_s), 1)
        throughput = prefill_ready * SIMULATED_PREFILL_TOKENS_PER_S
        service_s = SIMULATED_UNCACHED_PROMPT_TOKENS / SIMULATED_PREFILL_TOKENS_PER_S
        rho = min(arrival_rate * SIMULATED_UNCACHED_PROMPT_TOKENS / throughput, 0.95)
        in_service_requests = arrival_rate * service_s
        ttft_p90_s = self.backlog_tokens / throughput + 2.3 * service_s / (1.0 - rho) + 0.05
        queued_requests = self.backlog_tokens / SIMULATED_UNCACHED_PROMPT_TOKENS
        prefill = PoolSignals(
            queue_depth=queued_requests,
            uncached_tokens=self.backlog_tokens + in_service_requests * SIMULATED_UNCACHED_PROMPT_TOKENS,
            ttft_p90_s=ttft_p90_s,
        )
        decode_ready = max(self.pools["decode"].num_ready(now_s), 1)
        per_worker = self.active_sequences / decode_ready
        kv_usage = min(per_worker / SIMULATED_DECODE_KV_SEQUENCES, 1.0)
        overflow = max(per_worker - SIMULATED_DECODE_KV_SEQUENCES, 0.0)
        batch = min(per_worker, SIMULATED_DECODE_KV_SEQUENCES)
        itl_mean_s = SIMULATED_ITL_BASE_S + SIMULATED_ITL_PER_SEQUENCE_S * batch
        itl_p90_s = itl_mean_s * 1.15 * (1.0 + overflow / SIMULATED_DECODE_KV_SEQUENCES)
        return {"prefill": prefill, "decode": PoolSignals(kv_usage=kv_usage, itl_p90_s=itl_p90_s)}

    def _step_load(self, now_s: float, arrival_rate: float, itl_s: float) -> None:
        prefill_capacity = self.pools["prefill"].num_ready(now_s) * SIMULATED_PREFILL_TOKENS_PER_S * self.dt_s
        self.backlog_tokens += arrival_rate * self.dt_s * SIMULATED_UNCACHED_PROMPT_TOKENS
        done_tokens = min(self.backlog_tokens, prefill_capacity)
        self.backlog_tokens -= done_tokens
        finished_prefills = done_tokens / SIMULATED_UNCACHED_PROMPT_TOKENS
        # Each sequence lives output_tokens × ITL seconds in decode.
        lifetime_s = SIMULATED_OUTPUT_TOKENS * itl_s
        self.active_sequences += finished_prefills - self.active_sequences * min(self.dt_s / lifetime_s, 1.0)

    def run(self, duration_s: float, *, decide_every_s: float) -> None:
        policy, slo = self.spec.autoscaling, self.spec.slo
        next_decision_s = 0.0
        t = 0.0
        while t < duration_s:
            rate = self.rate_per_s(t)
            signals = self._signals(t, rate)
            if self.autoscale and t >= next_decision_s:
                next_decision_s = t + decide_every_s
                for role in ROLES:
                    pool = self.pools[role]
                    decision, self.history[role] = decide(
                        role=role, current_replicas=pool.replicas, signals=signals[role],
                        pool=self.spec.pools.get(role), policy=policy, slo=slo,
                        history=self.history.get(role, ()), now_s=t, ready_replicas=pool.num_ready(t),
                    )
                    self.decisions.append((t, decision))
                    if decision.changed:
                        pool.apply(decision.desired_replicas, t)
            self.samples.append(Sample(
                t, rate, self.pools["prefill"].replicas, self.pools["prefill"].num_ready(t),
                self.pools["decode"].replicas, self.pools["decode"].num_ready(t), signals,
            ))
            itl = signals["decode"].itl_p90_s or SIMULATED_ITL_BASE_S
            self._step_load(t, rate, itl / 1.15)
            t += self.dt_s
