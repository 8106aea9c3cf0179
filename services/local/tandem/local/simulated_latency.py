"""The SIMULATED workers' latency model: how long a CPU vLLM engine would take, no model runs.

Fitted to measured CPU numbers (``benchmarks/data/simulated_latency_cpu.json`` says how they were
measured); numbers from simulated workers describe the router, never model speed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

#: Where the fitted CPU latency model lives in the repository.
DEFAULT_LATENCY_MODEL_PATH = Path(__file__).resolve().parents[4] / "benchmarks" / "data" / "simulated_latency_cpu.json"


@dataclass(frozen=True)
class SimulatedLatencyModel:
    """Seconds a CPU vLLM engine takes, as straight lines fitted to measurements."""

    #: Prefill: fixed cost plus a cost per uncached prompt token.
    prefill_base_s: float = 0.05
    prefill_s_per_token: float = 0.0005
    #: Decode: seconds per output token (inter-token latency).
    decode_s_per_token: float = 0.03
    #: Multiplies every sleep (tests use 0 to run at the router's own speed).
    time_scale: float = 1.0

    def prefill_s(self, num_uncached_tokens: int) -> float:
        return self.time_scale * (self.prefill_base_s + self.prefill_s_per_token * num_uncached_tokens)

    def prefill_tokens_per_s(self, num_uncached_tokens: int) -> float:
        """Uncached prompt tokens per second one worker computes from prompts of ``num_uncached_tokens``,
        one after another (a SIMULATED worker prefills one at a time, as one CPU engine): its prefill
        capacity, as ``tandem-loadtest sweep`` would measure it for that prompt size."""
        return num_uncached_tokens / self.prefill_s(num_uncached_tokens)

    def decode_token_s(self) -> float:
        return self.time_scale * self.decode_s_per_token

    @classmethod
    def from_json(cls, path: Path = DEFAULT_LATENCY_MODEL_PATH, *, time_scale: float = 1.0) -> SimulatedLatencyModel:
        data = json.loads(path.read_text())["model"]
        return cls(
            prefill_base_s=float(data["prefill_base_s"]),
            prefill_s_per_token=float(data["prefill_s_per_token"]),
            decode_s_per_token=float(data["decode_s_per_token"]),
            time_scale=time_scale,
        )
