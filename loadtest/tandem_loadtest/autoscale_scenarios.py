"""The load shapes of ``make autoscale-demo`` (``loadtest/autoscale_demo.py``), one per ``--scenario``.

* ``ramp`` (the default): a 10x ramp of 200-token prompts with 16-token answers, a plateau, the ramp
  down and a long quiet tail; the decode pool starts at zero and must come back to it.
* ``short-chats``: short prompts with longer answers (the decode pool's work), within what one
  SIMULATED prefill worker computes: the prefill pool must not grow beyond one step.
* ``long-prompts``: long prompts with short answers (the prefill pool's work): the decode pool must
  not grow beyond one step.

The two pool-specific scenarios give the SIMULATED decode workers the KV cache of a real CPU decode
worker here (vLLM's 1 GiB: 23,296 tokens, 182 blocks of 128), so that the router's decode budget is what
a decode worker really holds; ``ramp`` keeps its small one (the decode pool fills, to show it growing).
Nothing here runs anything: the demo reads these numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The KV cache of a real decode worker on this host (``make setup``'s vLLM CPU engine, 1 GiB of KV:
#: "CPU KV cache size: 23,296 tokens"), in 128-token blocks.
REAL_CPU_DECODE_KV_BLOCKS = 23_296 // 128


@dataclass(frozen=True)
class Scenario:
    name: str
    prompt_tokens: int
    output_tokens: int
    low_rps: float
    high_rps: float
    ramp_s: float
    plateau_s: float
    #: Quiet after the ramp down (long enough for the pools to step back down in ``ramp``).
    tail_s: float
    #: KV blocks (128 tokens) per SIMULATED decode worker: the router's decode budget is 90 % of them.
    decode_kv_blocks: int
    #: Decode's replicas and minimum at the start (0: the demo's first request starts it from zero).
    decode_min_replicas: int
    #: The pool that must not grow beyond one scale-up step ("" = none: ``ramp`` grows both).
    one_step_pool: str = ""

    def offered_rps(self, t_s: float) -> float:
        """The load offered at ``t_s`` after the load started: ramp up, plateau, ramp down, then 0."""
        if t_s < self.ramp_s:
            return self.low_rps + (self.high_rps - self.low_rps) * t_s / self.ramp_s
        if t_s < self.ramp_s + self.plateau_s:
            return self.high_rps
        if t_s < 2 * self.ramp_s + self.plateau_s:
            return self.high_rps - (self.high_rps - self.low_rps) * (t_s - self.ramp_s - self.plateau_s) / self.ramp_s
        return 0.0


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("ramp", 200, 16, 0.15, 1.5, 120.0, 120.0, 420.0, decode_kv_blocks=6, decode_min_replicas=0),
        # ~1.35 s of SIMULATED prefill each (0.74 s + 160 x 3.8 ms): 0.45 req/s keeps one prefill worker
        # 60 % busy, while each answer streams for ~8 s (95 x 87 ms) on decode.
        Scenario(
            "short-chats",
            160,
            96,
            0.05,
            0.45,
            90.0,
            60.0,
            30.0,
            decode_kv_blocks=REAL_CPU_DECODE_KV_BLOCKS,
            decode_min_replicas=1,
            one_step_pool="prefill",
        ),
        # ~4.2 s of SIMULATED prefill each (0.74 s + 900 x 3.8 ms, within the 5 s TTFT SLO alone): 0.5 req/s
        # needs two to three prefill workers, while each answer streams for ~0.6 s (7 x 87 ms) on decode.
        Scenario(
            "long-prompts",
            900,
            8,
            0.05,
            0.5,
            90.0,
            60.0,
            30.0,
            decode_kv_blocks=REAL_CPU_DECODE_KV_BLOCKS,
            decode_min_replicas=1,
            one_step_pool="decode",
        ),
    )
}


def steps_up(steps: list[tuple[str, int, int]], pool: str) -> int:
    """Scale-up decisions of ``pool`` among ``(role, current, desired)`` changes."""
    return sum(1 for role, current, desired in steps if role == pool and desired > current)
