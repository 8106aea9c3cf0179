"""``make autoscale-demo``: the operator's autoscaling loop on this machine, under a 10x ramp.

Real here: Redis, the router (Ray Serve), the gateway, a Prometheus (Debian's) scraping them, the
operator's signal reader (``PrometheusSource``: the same PromQL as in a cluster), its decision
function (``decide``, with the ready-replica count) and ``tandem-loadtest``.

SIMULATED: the workers. Two cores hold one prefill and one decode vLLM engine, not a pool of each,
so the pools are made of SIMULATED workers (ids ``simulated-...``, ``tandem.local.simulated_worker``)
whose sleeps follow the CPU latency model fitted to this host's real engines
(``benchmarks/data/simulated_latency_cpu.json``). They speak the real worker's gRPC and KV-event
protocols, so the router and the gateway cannot tell. A worker the actuator adds is ready
``STARTUP_S`` later (an engine loading its model); one it removes drains first. Every figure here
describes the control loop, never model speed.

The decode pool starts at zero (``minReplicas: 0``): before the load, one request is sent as a
client would send it, retried after each 503's Retry-After, while the router counts the refusals as
the decode pool's pending demand and the loop starts a decode worker; ``from_zero_s`` is the time from
that first request to its answer (the cold start a client sees: the metrics' delays, one interval at
most, a worker's start). After the load the pool goes back to zero.

Writes ``reports/autoscale-demo/`` (``autoscale.png``, ``decisions.jsonl``, the load test's
reports) and ends with one line:
``autoscale: reversals=... slo_breach_fraction=... peak_prefill=... peak_decode=... returned_to_min=yes|no
from_zero_s=...``.

``--scenario short-chats,long-prompts`` (each on a stack of its own, into ``reports/autoscale-demo-<name>/``)
loads one pool only (tandem_loadtest.autoscale_scenarios); each adds ``autoscale-scenario: <name> (SIMULATED
workers) prefill_steps_up=... decode_steps_up=... <pool>_within_one_step=yes|no steps=...``: the pool the
scenario does not load may grow one step at most.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from tandem_loadtest.autoscale_scenarios import SCENARIOS, Scenario, steps_up
from tandem_loadtest.cli import main as loadtest_main
from tandem_operator import capacity
from tandem_operator.autoscale import Decision, PoolSignals, Recommendation, decide
from tandem_operator.signals import PrometheusSource, QueryScope
from tandem_operator.spec import ROLES, Role, TandemSpec, parse_spec

from tandem.local.prometheus import LocalPrometheus, stack_targets
from tandem.local.simulated_worker import (
    SimulatedCluster,
    SimulatedLatencyModel,
    SimulatedWorker,
    SimulatedWorkerConfig,
)
from tandem.local.stack import LocalStack, StackConfig, free_port

NAMESPACE = "tandem-local"
DEPLOYMENT = "tandem"
REPORT_DIR = Path("reports") / "autoscale-demo"
#: A simulated worker is ready this long after the actuator starts it (a CPU engine loads in ~30 s).
STARTUP_S = 20.0
#: The load shapes (``--scenario``): tandem_loadtest.autoscale_scenarios says what each shows.
DEFAULT_SCENARIO = SCENARIOS["ramp"]
#: The TTFT target (p90) the demo's pools are held to.
TTFT_P90_S = 5.0
#: The router's prefill budget per worker is what one worker computes within this share of the TTFT target
#: (``router.prefillBudgetTtftShare``). The chart's default, 0.5, leaves half the target to a cluster's
#: router queue, KV transfer and first decode step; a SIMULATED worker has no KV transfer and no engine
#: beyond its sleeps (a first token ~87 ms after the prefill), so prefill gets 0.9 here. At 0.5 (budgets of
#: 333, 296 and 542 tokens) ``--scenario short-chats`` grew prefill 1 -> 2 -> 4 while TTFT p90 stayed at
#: 1.6-2.1 s of its 5 s target (``prefill_within_one_step=no``): a second 200-token prompt asked for a second
#: worker it did not need.
PREFILL_BUDGET_TTFT_SHARE = 0.9
#: The share of that budget the prefill autoscaler holds per replica (the chart's ``budgetUsage``, 0.5 by
#: default): all of it, as the demo did before its budget was derived (600 tokens both).
PREFILL_BUDGET_USAGE = 1.0
#: How long a request may wait in the router's queue for budget (the default, 5 s, is a TTFT SLO's
#: worth; here requests wait out a scale-up, so that their TTFT shows it instead of a 503), and the
#: gateway's deadline for that Schedule call, above it.
ROUTER_QUEUE_TIMEOUT_S = 30
GATEWAY_ROUTER_TIMEOUT_S = 40
#: The first request's deadline, retries included (a cold start takes the metrics' delays, an interval
#: and ``STARTUP_S``).
FROM_ZERO_DEADLINE_S = 180.0


def offered_rps(t_s: float, scenario: Scenario = DEFAULT_SCENARIO) -> float:
    """The load ``scenario`` offers at ``t_s`` after the load started (0 after the ramp down)."""
    return scenario.offered_rps(t_s)


def simulated_prefill_tokens_per_s(scenario: Scenario = DEFAULT_SCENARIO) -> float:
    """Uncached prompt tokens/s one SIMULATED prefill worker computes from the scenario's prompts: its
    capacity as ``tandem-loadtest sweep`` would measure it. At the load test's nominal prompt size: the chat
    template adds a few dozen tokens, and a few % more tokens/s, so the budget below errs low."""
    return SimulatedLatencyModel.from_json().prefill_tokens_per_s(scenario.prompt_tokens)


def prefill_budget_tokens(scenario: Scenario = DEFAULT_SCENARIO) -> int:
    """The router's prefill budget per worker, in uncached prompt tokens, by the chart's formula
    (:func:`tandem_operator.capacity.prefill_budget_tokens`) from the SIMULATED workers' capacity and the
    demo's TTFT target. Beyond it requests wait in the router's queue, where the autoscaler sees them; with
    the chart's unmeasured default (16,384, sized for a GPU) they would queue unseen inside the workers."""
    budget = capacity.prefill_budget_tokens(
        simulated_prefill_tokens_per_s(scenario), TTFT_P90_S, PREFILL_BUDGET_TTFT_SHARE
    )
    if budget is None:  # a latency model that computes nothing: no capacity to size anything from
        raise ValueError("the SIMULATED latency model gives no prefill capacity")
    return budget


def demo_spec(served_model_name: str, scenario: Scenario = DEFAULT_SCENARIO) -> TandemSpec:
    """The TandemDeployment the loop acts for; targets sized for the simulated CPU workers, the prefill
    target from the router's budget as the chart renders it, and the prefill workers' measured capacity
    (``autoscaling.capacity``, as ``helm upgrade -f capacity.json`` sets it after a sweep): the SIMULATED
    workers' at the scenario's prompt size, so the prefill pool also votes ``token_rate`` (the uncached
    prompt tokens/s arriving at the router ÷ one worker's). Decode's capacity is left unmeasured (0)."""
    decode = scenario.decode_min_replicas
    target = capacity.uncached_tokens_per_replica(prefill_budget_tokens(scenario), PREFILL_BUDGET_USAGE)
    return parse_spec(
        {
            "model": {"servedModelName": served_model_name, "pvc": {"claimName": "none"}},
            "image": {"repository": "simulated", "tag": "0"},
            "redis": {"url": "redis://unused:6379/0"},
            "pools": {
                "prefill": {"replicas": 1, "minReplicas": 1, "maxReplicas": 6},
                "decode": {"replicas": decode, "minReplicas": decode, "maxReplicas": 6},
            },
            "slo": {"ttftP90Seconds": TTFT_P90_S, "itlP90Seconds": 0.2},
            "autoscaling": {
                "intervalSeconds": 10,
                "scaleUpStabilizationSeconds": 20,
                "scaleDownStabilizationSeconds": 60,
                "maxScaleUpStep": 2,
                "maxScaleDownStep": 1,
                "prefill": {"queueDepthPerReplica": 2, "uncachedTokensPerReplica": target},
                "decode": {"kvUsage": 0.7, "waitingPerReplica": 2},
                "capacity": {"prefillTokensPerSecondPerWorker": simulated_prefill_tokens_per_s(scenario)},
            },
        }
    )


@dataclass
class Pool:
    ready: list[SimulatedWorker] = field(default_factory=list)
    starting: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def replicas(self) -> int:
        return len(self.ready) + len(self.starting)


class LocalActuator:
    """Applies the operator's decisions to the local stack: starts SIMULATED workers (ready after
    ``STARTUP_S``) and drains them away, as the pool Deployments' pods come and go in a cluster."""

    def __init__(
        self, cluster: SimulatedCluster, model: str, latency: SimulatedLatencyModel, decode_kv_blocks: int
    ) -> None:
        self._cluster = cluster
        self._decode_kv_blocks = decode_kv_blocks
        self._model = model
        self._latency = latency
        self.pools: dict[Role, Pool] = {role: Pool() for role in ROLES}
        self._serial = itertools.count()
        self._draining: set[asyncio.Task[None]] = set()

    def _config(self, role: Role) -> SimulatedWorkerConfig:
        return SimulatedWorkerConfig(
            worker_id=f"simulated-{role}-{next(self._serial)}",
            role=role,
            model=self._model,
            num_kv_blocks=self._decode_kv_blocks if role == "decode" else 2048,
            latency=self._latency,
        )

    async def start_ready(self, role: Role) -> None:
        """One worker ready at once (the pool's first, before the load)."""
        self.pools[role].ready.append(await self._cluster.add_worker(self._config(role)))

    async def _start(self, role: Role, task_box: list[asyncio.Task[None]]) -> None:
        await asyncio.sleep(STARTUP_S)
        worker = await self._cluster.add_worker(self._config(role))
        pool = self.pools[role]
        pool.starting.remove(task_box[0])
        pool.ready.append(worker)

    async def apply(self, role: Role, desired: int) -> None:
        pool = self.pools[role]
        while pool.replicas < desired:
            box: list[asyncio.Task[None]] = []
            box.append(asyncio.create_task(self._start(role, box)))
            pool.starting.append(box[0])
        while pool.replicas > desired:
            if pool.starting:  # the newest pod, not started yet, goes first
                pool.starting.pop().cancel()
                continue
            worker = pool.ready.pop()
            task = asyncio.create_task(self._cluster.drain_worker(worker))
            self._draining.add(task)
            task.add_done_callback(self._draining.discard)

    async def aclose(self) -> None:
        for pool in self.pools.values():
            for task in pool.starting:
                task.cancel()
        if self._draining:
            await asyncio.gather(*self._draining, return_exceptions=True)


@dataclass
class Tick:
    t_s: float
    replicas: dict[Role, int]
    ready: dict[Role, int]
    signals: dict[Role, PoolSignals]


def decision_record(now_s: float, decision: Decision, ready: int) -> dict[str, Any]:
    """One line of ``decisions.jsonl``: the operator's decision as made, with ``step`` naming the votes
    that set a change (``prefill 1->2 by uncached_tokens_trend``; "" while the pool holds)."""
    return {
        "t_s": round(now_s, 1),
        "simulated": True,
        "role": decision.role,
        "current": decision.current_replicas,
        "ready": ready,
        "desired": decision.desired_replicas,
        "step": decision.step,
        "votes": decision.votes,
        "reason": decision.reason,
        "signals": {k: v for k, v in vars(decision.signals).items() if v is not None and v != ()},
    }


async def control_loop(
    spec: TandemSpec,
    source: PrometheusSource,
    actuator: LocalActuator,
    started_s: float,
    ticks: list[Tick],
    decisions: list[tuple[float, Decision]],
    log: Any,
    stop: asyncio.Event,
) -> None:
    """What the operator's timer does every ``intervalSeconds``, with the local actuator."""
    history: dict[Role, tuple[Recommendation, ...]] = {}
    while not stop.is_set():
        now_s = time.monotonic() - started_s
        signals: dict[Role, PoolSignals] = {}
        for role in ROLES:
            pool = actuator.pools[role]
            the_pool = next(p for p in spec.pools_of() if p.role == role)
            signals[role] = await source.read(the_pool, the_pool.name(DEPLOYMENT))
            decision, history[role] = decide(
                role=role,
                current_replicas=pool.replicas,
                signals=signals[role],
                pool=spec.pools.get(role),
                policy=spec.autoscaling,
                slo=spec.slo,
                history=history.get(role, ()),
                now_s=now_s,
                ready_replicas=len(pool.ready),
            )
            decisions.append((now_s, decision))
            log.write(json.dumps(decision_record(now_s, decision, len(pool.ready))) + "\n")
            log.flush()
            if decision.changed:
                print(f"[autoscale-demo] t={now_s:.0f}s {decision.step} ({decision.reason})", flush=True)
                await actuator.apply(role, decision.desired_replicas)
        ticks.append(
            Tick(
                now_s,
                {r: actuator.pools[r].replicas for r in ROLES},
                {r: len(actuator.pools[r].ready) for r in ROLES},
                signals,
            )
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), spec.autoscaling.interval_seconds)


def run_load(stack: LocalStack, out: Path, scenario: Scenario = DEFAULT_SCENARIO) -> None:
    """The three phases, one ``tandem-loadtest run`` each (ramp up, plateau, ramp down)."""
    sc = scenario
    common = [
        "run",
        "--url",
        stack.config.gateway_url,
        "--api-key",
        stack.api_key or "",
        "--model",
        stack.config.served_model_name,
        "--workload",
        "synthetic",
        "--input-tokens",
        str(sc.prompt_tokens),
        "--output-tokens",
        str(sc.output_tokens),
        "--ignore-eos",
        "--request-timeout-s",
        "120",
        "--no-progress",
        "--no-plots",
        "--max-concurrency",
        "64",
    ]
    phases = [
        ("1-ramp-up", f"ramp:{sc.low_rps}:{sc.high_rps}:{sc.ramp_s:g}", sc.ramp_s),
        ("2-plateau", f"poisson:{sc.high_rps}", sc.plateau_s),
        ("3-ramp-down", f"ramp:{sc.high_rps}:{sc.low_rps}:{sc.ramp_s:g}", sc.ramp_s),
    ]
    for name, arrival, duration_s in phases:
        loadtest_main([*common, "--arrival", arrival, "--duration-s", f"{duration_s:g}", "--out", str(out / name)])


def count_reversals(directions: list[bool]) -> int:
    """Changes of direction in one pool's scaling decisions (True: up) beyond the one a load with one
    peak asks for: up on the way up, down after it. Any other change is the controller flapping."""
    changes = sum(1 for a, b in itertools.pairwise(directions) if a != b)
    return max(0, changes - 1) if directions and directions[0] else changes


async def first_request_from_zero(stack: LocalStack) -> float:
    """One chat request to a deployment whose decode pool is at zero, retried after each 503's
    Retry-After as the OpenAI SDKs do; seconds from the first try to the answer."""
    import httpx

    body = {
        "model": stack.config.served_model_name,
        "messages": [{"role": "user", "content": "Hello from zero, ünïcode 東京"}],
        "max_tokens": DEFAULT_SCENARIO.output_tokens,
    }
    headers = {"Authorization": f"Bearer {stack.api_key}"} if stack.api_key else {}
    started_s = time.monotonic()
    async with httpx.AsyncClient(base_url=stack.config.gateway_url, headers=headers, timeout=120) as client:
        while time.monotonic() - started_s < FROM_ZERO_DEADLINE_S:
            response = await client.post("/v1/chat/completions", json=body)
            if response.status_code == 200:
                return time.monotonic() - started_s
            if response.status_code != 503 or "retry-after" not in response.headers:
                raise RuntimeError(f"the first request got {response.status_code}: {response.text[:300]}")
            await asyncio.sleep(float(response.headers["retry-after"]))
    raise RuntimeError(f"no answer within {FROM_ZERO_DEADLINE_S:g} s of the first request at zero")


def summary(
    spec: TandemSpec,
    ticks: list[Tick],
    decisions: list[tuple[float, Decision]],
    load_end_s: float,
    from_zero_s: float | None = None,
) -> str:
    reversals = 0
    for role in ROLES:
        directions = [d.desired_replicas > d.current_replicas for _, d in decisions if d.role == role and d.changed]
        reversals += count_reversals(directions)
    loaded = [t for t in ticks if t.t_s <= load_end_s]
    slo = spec.slo

    def breached(t: Tick) -> bool:
        ttft, itl = t.signals["prefill"].ttft_p90_s, t.signals["decode"].itl_p90_s
        return (ttft is not None and ttft > slo.ttft_p90_seconds) or (itl is not None and itl > slo.itl_p90_seconds)

    breach = sum(breached(t) for t in loaded) / max(1, len(loaded))
    end = ticks[-1]
    at_min = all(end.replicas[r] == spec.pools.get(r).min_replicas for r in ROLES)
    return (
        f"autoscale: reversals={reversals} slo_breach_fraction={breach:.3f} "
        f"peak_prefill={max(t.replicas['prefill'] for t in ticks)} "
        f"peak_decode={max(t.replicas['decode'] for t in ticks)} returned_to_min={'yes' if at_min else 'no'}"
        + ("" if from_zero_s is None else f" from_zero_s={from_zero_s:.1f}")
    )


def scenario_summary(scenario: Scenario, decisions: list[tuple[float, Decision]]) -> str:
    """The pool-specific scenarios' verdict: how many times each pool grew, whether the pool the
    scenario does not load (``one_step_pool``) grew at most one step, and every step with its votes."""
    changes = [d for _, d in decisions if d.changed]
    ups: dict[str, int] = {
        role: steps_up([(d.role, d.current_replicas, d.desired_replicas) for d in changes], role) for role in ROLES
    }
    held = ups.get(scenario.one_step_pool, 0) <= 1
    return (
        f"autoscale-scenario: {scenario.name} (SIMULATED workers) prefill_steps_up={ups['prefill']} "
        f"decode_steps_up={ups['decode']} {scenario.one_step_pool}_within_one_step={'yes' if held else 'no'} "
        f"steps={'; '.join(d.step for d in changes) or '-'}"
    )


def load_summary(load_dir: Path) -> str:
    """What the clients got over the three phases (from ``tandem-loadtest``'s reports): a request the
    router refused, or that timed out, has no TTFT, so the breach fraction alone would hide it."""
    total = ok = 0
    parts = []
    for report_path in sorted(load_dir.glob("*/report.json")):
        phase = json.loads(report_path.read_text())["summary"]
        total += phase["num_requests"]
        ok += phase["num_ok"]
        ttft = phase.get("ttft_ms") or {}
        p90 = ttft.get("p90")
        parts.append(
            f"{report_path.parent.name}:ok={phase['num_ok']}/{phase['num_requests']}:ttft_p90_ms="
            + (f"{p90:.0f}" if p90 is not None else "-")
        )
    return f"autoscale-load: requests={total} ok={ok} failed={total - ok} " + " ".join(parts)


def plot(
    spec: TandemSpec, ticks: list[Tick], load_started_s: float, path: Path, scenario: Scenario = DEFAULT_SCENARIO
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [x.t_s for x in ticks]
    fig, axes = plt.subplots(4, 1, figsize=(9, 10), sharex=True)
    axes[0].plot(
        t, [offered_rps(x - load_started_s, scenario) if x >= load_started_s else 0.0 for x in t], color="black"
    )
    axes[0].set_ylabel("offered req/s")
    colors: dict[Role, str] = {"prefill": "tab:blue", "decode": "tab:orange"}
    for role, color in colors.items():
        axes[1].step(t, [x.replicas[role] for x in ticks], where="post", color=color, label=f"{role} replicas")
        axes[1].step(t, [x.ready[role] for x in ticks], where="post", color=color, linestyle=":", label=f"{role} ready")
    axes[1].set_ylabel("replicas (SIMULATED workers)")
    axes[1].legend(loc="upper right", fontsize=8)
    for ax, values, limit, label in (
        (axes[2], [x.signals["prefill"].ttft_p90_s for x in ticks], spec.slo.ttft_p90_seconds, "TTFT p90 (s)"),
        (axes[3], [x.signals["decode"].itl_p90_s for x in ticks], spec.slo.itl_p90_seconds, "ITL p90 (s)"),
    ):
        ax.plot(t, [float("nan") if v is None else v for v in values], marker=".", color="tab:green")
        ax.axhline(limit, color="tab:red", linestyle="--", label="SLO")
        ax.set_ylabel(label)
        ax.legend(loc="upper right", fontsize=8)
    axes[3].set_xlabel("seconds (the operator's decision loop; SIMULATED workers, real router and gateway)")
    fig.suptitle(f"make autoscale-demo --scenario {scenario.name}: operator decisions (SIMULATED workers)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


async def demo(out: Path, scenario: Scenario = DEFAULT_SCENARIO) -> str:
    out.mkdir(parents=True, exist_ok=True)
    config = StackConfig.with_free_ports(
        key_prefix=f"tandem-autoscale-{uuid.uuid4().hex[:8]}",
        log_dir=out / "logs",
        start_workers=False,
        # Its SIMULATED workers serve plaintext gRPC: the gateway must call them so (said explicitly).
        internal_tls=False,
        router_metrics_port=free_port(),  # scraped by the demo's Prometheus
        extra_env={
            "TANDEM_ROUTER_BUDGET__PREFILL_TOKENS_IN_FLIGHT": str(prefill_budget_tokens(scenario)),
            "TANDEM_ROUTER_QUEUE__TIMEOUT_S": str(ROUTER_QUEUE_TIMEOUT_S),
            "TANDEM_GATEWAY_ROUTER_TIMEOUT_S": str(GATEWAY_ROUTER_TIMEOUT_S),
        },
    )
    stack = LocalStack(config, progress=lambda msg: print(f"[autoscale-demo] {msg}", flush=True))
    prometheus = LocalPrometheus(out / "prometheus", stack_targets(config, NAMESPACE, DEPLOYMENT))
    cluster = SimulatedCluster([], redis_url=config.redis_url, key_prefix=config.key_prefix)
    spec = demo_spec(config.served_model_name, scenario)
    print(
        f"[autoscale-demo] prefill budget {prefill_budget_tokens(scenario)} uncached tokens per worker (SIMULATED "
        f"capacity {simulated_prefill_tokens_per_s(scenario):.1f} tokens/s x TTFT {TTFT_P90_S:g} s x "
        f"{PREFILL_BUDGET_TTFT_SHARE:g}), "
        f"autoscaler target {spec.autoscaling.prefill.uncached_tokens_per_replica:g} per replica, token_rate "
        f"against {spec.autoscaling.capacity.prefill_tokens_per_second_per_worker:.1f} tokens/s per worker",
        flush=True,
    )
    actuator = LocalActuator(
        cluster, config.served_model_name, SimulatedLatencyModel.from_json(), scenario.decode_kv_blocks
    )
    ticks: list[Tick] = []
    decisions: list[tuple[float, Decision]] = []
    stop = asyncio.Event()
    try:
        # Prefill's first worker; decode starts at zero in ``ramp`` (the gateway is ready without it).
        await cluster.start()
        for role in ROLES:
            if spec.pools.get(role).replicas:
                await actuator.start_ready(role)
        await asyncio.to_thread(stack.start)
        await asyncio.to_thread(prometheus.start)  # the simulated workers' heartbeats go on meanwhile
        started_s = time.monotonic()
        async with aiohttp.ClientSession() as http:
            source = PrometheusSource(prometheus.url, QueryScope(NAMESPACE, DEPLOYMENT), http)
            with (out / "decisions.jsonl").open("w") as log:
                loop = asyncio.create_task(control_loop(spec, source, actuator, started_s, ticks, decisions, log, stop))
                await asyncio.sleep(20)  # a quiet start: the loop holds at the minimum (decode at zero)
                from_zero_s = None
                if scenario.decode_min_replicas == 0:
                    from_zero_s = await first_request_from_zero(stack)
                    print(f"[autoscale-demo] first request at zero answered after {from_zero_s:.1f} s", flush=True)
                load_started_s = time.monotonic() - started_s
                await asyncio.to_thread(run_load, stack, out / "load", scenario)
                load_end_s = time.monotonic() - started_s
                await asyncio.sleep(scenario.tail_s)  # quiet again: back down, one step per window
                stop.set()
                await loop
        plot(spec, ticks, load_started_s, out / "autoscale.png", scenario)
        print(f"[autoscale-demo] {load_summary(out / 'load')}", flush=True)
        line = summary(spec, ticks, decisions, load_end_s, from_zero_s)
        return line if not scenario.one_step_pool else f"{line}\n{scenario_summary(scenario, decisions)}"
    finally:
        stop.set()
        await actuator.aclose()
        await cluster.aclose()
        prometheus.stop()
        stack.stop()


def main() -> int:
    parser = argparse.ArgumentParser(prog="make autoscale-demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help=f"default {REPORT_DIR}[-<scenario>]")
    parser.add_argument(
        "--scenario",
        default="ramp",
        help=f"comma-separated, run one after the other: {', '.join(SCENARIOS)} (tandem_loadtest.autoscale_scenarios)",
    )
    args = parser.parse_args()
    lines = []
    for name in args.scenario.split(","):
        scenario = SCENARIOS[name]
        out = args.out or (REPORT_DIR if name == "ramp" else REPORT_DIR.with_name(f"autoscale-demo-{name}"))
        if len(args.scenario.split(",")) > 1 and args.out:
            out = args.out / name
        lines.append(asyncio.run(demo(out, scenario)))
        print(f"[autoscale-demo] wrote {out / 'autoscale.png'} and {out / 'decisions.jsonl'}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
