"""The gateway's own share of TTFT: TTFT as the client sees it through the gateway
minus the prefill worker's own time to first token (``PrefillResponse.engine_seconds``,
returned to the client in the ``X-Tandem-Timings`` breakdown), per request, p50/p99.

Starts the local stack (free ports, a private Redis prefix), sends ``--num-requests``
streamed chat requests one at a time, and prints one JSON line.

    python benchmarks/gateway_overhead.py --num-requests 100
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

import httpx

from tandem.local.stack import LocalStack, StackConfig


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def one_request(client: httpx.Client, model: str, index: int) -> tuple[float, float, dict[str, float]]:
    body = {
        "model": model,
        "stream": True,
        "max_tokens": 8,
        "temperature": 0,
        "messages": [{"role": "user", "content": f"Question {index}: what is the capital of France?"}],
    }
    started = time.perf_counter()
    ttft_s: float | None = None
    timings: dict[str, object] = {}
    with client.stream("POST", "/v1/chat/completions", json=body, headers={"X-Tandem-Timings": "1"}) as resp:
        resp.raise_for_status()
        event = "message"
        for line in resp.iter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                payload = line[5:].strip()
                if payload == "[DONE]":
                    continue
                obj = json.loads(payload)
                if event == "tandem.timings":
                    timings = obj
                elif ttft_s is None and any((c.get("delta") or {}).get("content") for c in obj.get("choices", [])):
                    ttft_s = time.perf_counter() - started
            elif not line:
                event = "message"
    assert ttft_s is not None and timings, "no token or no timings"
    worker = timings["worker"]
    assert isinstance(worker, dict)
    stages = timings["stages_ms"]
    assert isinstance(stages, dict)
    return ttft_s, float(worker["prefill_engine_ms"]) / 1000, {k: float(v) for k, v in stages.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--num-warmup", type=int, default=5)
    args = parser.parse_args()
    config = StackConfig.with_free_ports(
        key_prefix=f"tandem-bench-{uuid.uuid4().hex[:8]}", log_dir=Path(".run/bench-overhead-logs")
    )
    with LocalStack(config, progress=lambda msg: print(f"[bench] {msg}", file=sys.stderr, flush=True)) as stack:
        with httpx.Client(base_url=config.gateway_url, timeout=120, headers=stack.auth_headers) as client:
            for i in range(args.num_warmup):
                one_request(client, config.served_model_name, -i - 1)
            overheads_ms, ttfts_ms, engine_ms = [], [], []
            stage_samples: dict[str, list[float]] = {}
            for i in range(args.num_requests):
                ttft_s, engine_s, stages = one_request(client, config.served_model_name, i)
                ttfts_ms.append(ttft_s * 1000)
                engine_ms.append(engine_s * 1000)
                overheads_ms.append((ttft_s - engine_s) * 1000)
                for name, value in stages.items():
                    stage_samples.setdefault(name, []).append(value)
                if (i + 1) % 20 == 0:
                    print(f"[bench] {i + 1}/{args.num_requests}", file=sys.stderr, flush=True)
    result = {
        "num_requests": args.num_requests,
        "formula": "overhead = client TTFT through the gateway - prefill worker engine time to first token",
        "gateway_overhead_ms": {
            "p50": percentile(overheads_ms, 0.5),
            "p99": percentile(overheads_ms, 0.99),
            "mean": statistics.fmean(overheads_ms),
        },
        "client_ttft_ms": {"p50": percentile(ttfts_ms, 0.5), "p99": percentile(ttfts_ms, 0.99)},
        "prefill_engine_ms": {"p50": percentile(engine_ms, 0.5), "p99": percentile(engine_ms, 0.99)},
        "gateway_stage_p50_ms": {k: percentile(v, 0.5) for k, v in stage_samples.items()},
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
