"""Request-path benchmark (``make bench-path``): Tandem's disaggregated path
through the gateway vs the same model served by plain vLLM
(``vllm.entrypoints.openai.api_server``), measured side by side in one run.

1. One request at a time: requests alternate between Tandem and one plain
   vLLM server, so machine noise hits both alike. TTFT and inter-token latency
   p50/p90 for each and their ratios, the KV transfer throughput of
   ~2,000-token prompts (from the decode engine's own transfer records) and
   engine start-up times.
2. Under a mixed load, against the baseline a platform team would pick instead
   on the same cores: **two colocated plain-vLLM replicas behind round-robin**,
   one core each, beside Tandem's one prefill and one decode worker (one core
   each). Short chats with a share of ~2,000-token prompts arrive open-loop
   (Poisson, the same seeded sequence for both); phases alternate between the
   two systems (Tandem, colocated, Tandem, colocated) so that drifting noise
   falls on both. Decode ITL p50/p99, TTFT p50/p90 and goodput (requests whose
   TTFT and every inter-token gap meet the SLO stated below) for each; short
   chats and long prompts apart (TTFT p50 of each, the short chats' ITL p99),
   and their ratios; and how the router placed Tandem's requests (handed off,
   prefilled on the decode worker because short, or because the prefill
   worker was busy: ``local_prefill burst``, read from the router's own
   ``ray_tandem_router_*`` counters). The load comes from ``tandem_loadtest``.

Ends with ``bench-path: ttft_p50_ratio=… itl_p99_ratio_vs_colocated=…
goodput_ratio_vs_colocated=… … long_ttft_p50_ratio_vs_colocated=…
short_ttft_p50_ratio_vs_colocated=… short_itl_p99_ratio_vs_colocated=…`` (the
first from part 1, the others from part 2: Tandem ÷ colocated). Real engines,
real model; nothing simulated."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import re
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
from tandem_loadtest.arrivals import PoissonArrivals
from tandem_loadtest.distributions import LengthDist
from tandem_loadtest.metrics import summarize
from tandem_loadtest.records import RequestRecord
from tandem_loadtest.runner import RunConfig, run_load
from tandem_loadtest.tenants import TenantConfig
from tandem_loadtest.workloads import WorkloadOptions

from tandem.local.plain_vllm import start_plain_vllm, stop_plain_vllm
from tandem.local.stack import LocalStack, StackConfig, free_port


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def stream_once(
    base_url: str,
    model: str,
    prompt: str,
    max_tokens: int,
    headers: dict[str, str] | None = None,
    *,
    timings_out: dict[str, Any] | None = None,
) -> tuple[float, list[float]]:
    """(TTFT, inter-token gaps) as vllm bench serve defines them: first non-empty content delta.

    ``timings_out`` (Tandem only): asks the gateway for the request's stage timings
    (``X-Tandem-Timings``) and fills the dict with its ``tandem.timings`` event."""
    if timings_out is not None:
        headers = {**(headers or {}), "X-Tandem-Timings": "1"}
    body = {
        "model": model,
        "stream": True,
        "temperature": 0,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": prompt}],
    }
    sent = time.perf_counter()
    ttft, last, gaps = None, 0.0, []
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, headers=headers, timeout=300) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            event = json.loads(line[5:])
            if timings_out is not None and "stages_ms" in event:
                timings_out.update(event)
                continue
            if not event.get("choices") or not event["choices"][0].get("delta", {}).get("content"):
                continue
            now = time.perf_counter()
            if ttft is None:
                ttft = now - sent
            else:
                gaps.append(now - last)
            last = now
    assert ttft is not None, "no content"
    return ttft, gaps


#: Goodput's SLO, stated before any run: an interactive answer starts within 3 s and never stalls
#: for more than 1 s between two tokens (on this CPU a decode step of the default model takes
#: 30-60 ms, a ~2,000-token prefill several seconds).
SLO_MS = {"ttft": 3000.0, "itl": 1000.0}


#: Share of long (~2,000-token) prompts in the mixed load.
LONG_FRACTION = 0.2
#: The mixed load's rate keeps Tandem's one prefill worker this busy with long prompts (measured
#: in the same run), so that both systems can sustain it: an overloaded queue measures only itself.
PREFILL_UTILIZATION = 0.5


def sustainable_rate_rps(long_prefill_s: float) -> float:
    """Requests per second at which long prompts keep one prefill engine ``PREFILL_UTILIZATION`` busy."""
    return round(PREFILL_UTILIZATION / (LONG_FRACTION * long_prefill_s), 3)


class RoundRobin(httpx.AsyncBaseTransport):
    """Sends each request to the next of ``ports`` on the request's host, in turn."""

    def __init__(self, ports: list[int]) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self._inner = httpx.AsyncHTTPTransport(limits=limits)
        self._ports = itertools.cycle(ports)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        request.url = request.url.copy_with(port=next(self._ports))
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()


def mixed_phase(
    base_url: str, model: str, api_key: str, *, rate_rps: float, duration_s: float, seed: int, ports: list[int] | None
) -> tuple[list[RequestRecord], float]:
    """One open-loop phase of short chats (32-token prompts, 64 tokens out) and ~2,000-token prompts
    (16 out, one request in five); ``ports``: round-robin over these replicas."""
    config = RunConfig(
        base_url=base_url,
        model=model,
        arrival=PoissonArrivals(rate_rps),
        tenants=[TenantConfig("bench", api_key, {"mixed": 1.0})],
        workload=WorkloadOptions(
            input_tokens=LengthDist("fixed", 32),
            output_tokens=LengthDist("fixed", 64),
            long_fraction=LONG_FRACTION,
            long_input_tokens=LengthDist("fixed", 2000),
            long_output_tokens=LengthDist("fixed", 16),
        ),
        num_requests=None,
        duration_s=duration_s,
        request_timeout_s=300,
        ignore_eos=True,
        temperature=0.0,
        seed=seed,
    )
    transport = RoundRobin(ports) if ports else None
    result = asyncio.run(run_load(config, transport=transport))
    return result.records, result.duration_s


def _ms(summary: dict[str, Any], metric: str, pct_name: str) -> float:
    value = summary[metric][pct_name]
    return float(value) if value is not None else float("nan")


#: The router's placement counters the mixed phase reports (Ray's export adds ``ray_`` and ``_total``).
PLACEMENT_SERIES = (
    "ray_tandem_router_placements_total",
    "ray_tandem_router_burst_local_prefills_total",
)


def router_counters(metrics_url: str) -> dict[str, float]:
    """The router's placement counters now, summed over their other labels: ``placements/<path>`` and
    ``burst_local_prefills`` (a series the router does not export yet reads 0)."""
    try:
        text = httpx.get(metrics_url, timeout=10).text
    except httpx.HTTPError:
        return {}
    counts: dict[str, float] = {}
    for line in text.splitlines():
        name, _, rest = line.partition("{")
        if name not in PLACEMENT_SERIES:
            continue
        key = name.removeprefix("ray_tandem_router_").removesuffix("_total")
        path = re.search(r'path="([^"]*)"', rest)
        if path:
            key += "/" + path.group(1)
        counts[key] = counts.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def compare_under_load(
    stack: LocalStack, replica_ports: list[int], *, rate_rps: float, phase_s: float, rounds: int
) -> dict[str, float]:
    """Part 2: Tandem and the colocated replicas under the same mixed load, phases alternating."""
    config = stack.config
    metrics_url = f"http://127.0.0.1:{config.router_metrics_port}/metrics"
    placed: dict[str, float] = {}
    api_key = stack.auth_headers["Authorization"].removeprefix("Bearer ")
    records: dict[str, list[RequestRecord]] = {"tandem": [], "colocated": []}
    seconds: dict[str, float] = {"tandem": 0.0, "colocated": 0.0}
    replicas_url = f"http://127.0.0.1:{replica_ports[0]}"
    for round_index in range(rounds):
        for name in ("tandem", "colocated"):
            print(f"[bench] mixed load, round {round_index + 1}/{rounds}: {name} for {phase_s:.0f} s", flush=True)
            before = router_counters(metrics_url) if name == "tandem" else {}
            got, took_s = mixed_phase(
                config.gateway_url if name == "tandem" else replicas_url,
                config.served_model_name,
                api_key,
                rate_rps=rate_rps,
                duration_s=phase_s,
                seed=round_index,
                ports=None if name == "tandem" else replica_ports,
            )
            records[name].extend(got)
            seconds[name] += took_s
            if name == "tandem":
                for key, value in router_counters(metrics_url).items():
                    placed[key] = placed.get(key, 0.0) + value - before.get(key, 0.0)
    print(
        f"\nmixed load: Poisson {rate_rps:g} req/s for {rounds} x {phase_s:.0f} s per system; one request in five "
        "~2,000 tokens in / 16 out, the rest 32 in / 64 out; greedy, ignore_eos"
    )
    print("  tandem: 1 prefill + 1 decode worker; colocated: 2 plain vLLM replicas, round-robin; one core each")
    print(f"  goodput SLO: TTFT <= {SLO_MS['ttft']:.0f} ms and every inter-token gap <= {SLO_MS['itl']:.0f} ms")
    header = (
        "",
        "ok/sent",
        "TTFT p50",
        "TTFT p90",
        "ITL p50",
        "ITL p99",
        "good",
        "short TTFT p50",
        "short ITL p99",
        "long TTFT p50",
        "long TTFT p90",
    )
    widths = (10, 8, 9, 9, 8, 8, 6, 15, 14, 14, 14)
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, widths, strict=True)))
    summaries: dict[str, dict[str, Any]] = {}
    shorts: dict[str, dict[str, Any]] = {}
    longs: dict[str, dict[str, Any]] = {}
    for name, recs in records.items():
        whole = summaries[name] = summarize(recs, seconds[name], SLO_MS)
        short = shorts[name] = summarize([r for r in recs if r.label.endswith("/short")], seconds[name], SLO_MS)
        long = longs[name] = summarize([r for r in recs if r.label.endswith("/long")], seconds[name], SLO_MS)
        print(
            f"{name:>10} {whole['num_ok']:>3}/{whole['num_requests']:<4} {_ms(whole, 'ttft_ms', 'p50'):>8.0f}ms"
            f" {_ms(whole, 'ttft_ms', 'p90'):>7.0f}ms {_ms(whole, 'itl_ms', 'p50'):>6.0f}ms"
            f" {_ms(whole, 'itl_ms', 'p99'):>6.0f}ms {whole['goodput']['good_fraction'] or 0:>6.0%}"
            f" {_ms(short, 'ttft_ms', 'p50'):>13.0f}ms {_ms(short, 'itl_ms', 'p99'):>12.0f}ms"
            f" {_ms(long, 'ttft_ms', 'p50'):>12.0f}ms {_ms(long, 'ttft_ms', 'p90'):>12.0f}ms"
            f"  ({long['num_ok']} long)"
        )
    print(
        "tandem placements during its phases: "
        + ("  ".join(f"{k} {v:.0f}" for k, v in sorted(placed.items())) or "(router metrics not read)")
    )
    t, c = summaries["tandem"], summaries["colocated"]
    ratios = {
        "ttft_p50": _ms(t, "ttft_ms", "p50") / _ms(c, "ttft_ms", "p50"),
        "itl_p50": _ms(t, "itl_ms", "p50") / _ms(c, "itl_ms", "p50"),
        "itl_p99": _ms(t, "itl_ms", "p99") / _ms(c, "itl_ms", "p99"),
        "goodput": t["goodput"]["request_goodput_rps"] / max(1e-9, c["goodput"]["request_goodput_rps"]),
        "long_ttft_p50": _ms(longs["tandem"], "ttft_ms", "p50") / _ms(longs["colocated"], "ttft_ms", "p50"),
        "short_ttft_p50": _ms(shorts["tandem"], "ttft_ms", "p50") / _ms(shorts["colocated"], "ttft_ms", "p50"),
        "short_itl_p99": _ms(shorts["tandem"], "itl_ms", "p99") / _ms(shorts["colocated"], "itl_ms", "p99"),
    }
    print("ratio tandem/colocated: " + "  ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-requests", type=int, default=12, help="per server")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-long", type=int, default=3, help="~2,000-token prompts for KV throughput")
    parser.add_argument(
        "--mixed-rate",
        type=float,
        default=None,
        help="mixed load: requests per second (default: from the long prompts' measured prefill time, "
        f"so that they keep the prefill worker {PREFILL_UTILIZATION:.0%} busy)",
    )
    parser.add_argument("--mixed-phase-s", type=float, default=90.0, help="mixed load: seconds per phase")
    parser.add_argument("--mixed-rounds", type=int, default=2, help="mixed load: phases per system")
    args = parser.parse_args()

    run_dir = Path(".run/bench-path")
    run_dir.mkdir(parents=True, exist_ok=True)
    # A fixed metrics port: the mixed phase reads the router's placement counters.
    config = StackConfig.with_free_ports(
        key_prefix=f"tandem-bench-{uuid.uuid4().hex[:6]}", log_dir=run_dir, router_metrics_port=free_port()
    )
    stack = LocalStack(config, progress=lambda m: print(f"[bench] {m}", flush=True))
    vllm_proc = None
    replicas: list[Any] = []
    try:
        stack.start()
        vllm_port = free_port()
        print("[bench] starting plain vLLM", flush=True)
        vllm_proc, vllm_start_s = start_plain_vllm(
            config.model_dir, config.served_model_name, vllm_port, run_dir / "plain-vllm.log"
        )
        targets = {"tandem": config.gateway_url, "vllm": f"http://127.0.0.1:{vllm_port}"}
        # Tandem authenticates tenants like production; plain vLLM has no keys.
        headers = {"tandem": stack.auth_headers, "vllm": {}}
        questions = [
            f"Question {i}: explain in a few sentences why the sky looks blue at noon."
            for i in range(args.num_requests)
        ]
        ttft: dict[str, list[float]] = {k: [] for k in targets}
        itl: dict[str, list[float]] = {k: [] for k in targets}
        for name in targets:  # warm-up, not measured
            stream_once(targets[name], config.served_model_name, "Hello", 4, headers[name])
        for i, q in enumerate(questions):
            order = list(targets) if i % 2 == 0 else list(reversed(targets))
            for name in order:
                t, gaps = stream_once(targets[name], config.served_model_name, q, args.max_tokens, headers[name])
                ttft[name].append(t)
                itl[name].extend(gaps)
            print(f"[bench] {i + 1}/{len(questions)}", flush=True)

        # KV transfer throughput on ~2,000-token prompts (distinct so nothing is prefix-cached).
        from tandem.common.tls import channel as tls_channel
        from tandem.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

        # The counters answer any component of the cluster (a tool's certificate: the operator's).
        kv_channel = tls_channel(f"127.0.0.1:{config.decode_kv_port}", stack.tls("operator"))
        kv = kv_transfer_pb2_grpc.KVTransferStub(kv_channel)
        before = kv.GetStats(kv_transfer_pb2.KVStatsRequest())
        long_ttft_s = []
        for i in range(args.num_long):
            doc = " ".join(f"Fact {i}-{j}: the number {j * 7 + i} is interesting." for j in range(150))
            t, _ = stream_once(config.gateway_url, config.served_model_name, doc + " Summarize.", 4, stack.auth_headers)
            long_ttft_s.append(t)
        after = kv.GetStats(kv_transfer_pb2.KVStatsRequest())
        kv_bytes = after.bytes_received_total - before.bytes_received_total
        kv_s = after.transfer_seconds_total - before.transfer_seconds_total
        kv_tokens = after.kv_tokens_loaded_total - before.kv_tokens_loaded_total

        print(
            "\nrequest path, measured side by side in one run "
            f"({args.num_requests} requests each, {args.max_tokens} output tokens, alternating; these short "
            "questions are below the router's default disaggregation threshold, so Tandem runs them on the "
            "decode worker alone: the handoff's figures are the KV line and make bench-kv)"
        )
        print(f"{'':8} {'TTFT p50':>10} {'TTFT p90':>10} {'ITL p50':>10} {'ITL p90':>10}")
        for name in targets:
            print(
                f"{name:8} {statistics.median(ttft[name]) * 1e3:9.1f}ms {pct(ttft[name], 0.9) * 1e3:9.1f}ms "
                f"{statistics.median(itl[name]) * 1e3:9.1f}ms {pct(itl[name], 0.9) * 1e3:9.1f}ms"
            )
        r_ttft = statistics.median(ttft["tandem"]) / statistics.median(ttft["vllm"])
        r_itl = statistics.median(itl["tandem"]) / statistics.median(itl["vllm"])
        print(f"ratio tandem/vllm: TTFT p50 {r_ttft:.2f}  ITL p50 {r_itl:.2f}")
        num_prefetched = after.prefetches_used_total - before.prefetches_used_total
        print(
            f"KV transfer: {kv_tokens} tokens in {args.num_long} prompts "
            f"(~{kv_tokens // max(1, args.num_long)} each), {kv_bytes / 1e6:.1f} MB in {kv_s:.3f} s "
            f"= {kv_bytes / kv_s / 1e9 if kv_s else 0:.2f} GB/s of the decode engine's load time "
            f"({num_prefetched} of {args.num_long} loads came from a prefetch; a prefetched load's time is the "
            "wait for its stream's tail and the local copy, the network having moved the rest while the prefill ran)"
        )
        print(
            f"start-up: prefill worker {stack.ready_after_s.get('prefill', 0):.1f} s, decode worker "
            f"{stack.ready_after_s.get('decode', 0):.1f} s (both at once, one core each), "
            f"router {stack.ready_after_s.get('router', 0):.1f} s, plain vLLM {vllm_start_s:.1f} s "
            "(alone, while the stack idled)"
        )
        mixed_rate = args.mixed_rate or sustainable_rate_rps(statistics.median(long_ttft_s))
        print(
            f"long prompts' TTFT through Tandem (one at a time): p50 {statistics.median(long_ttft_s):.1f} s; "
            f"mixed-load rate {mixed_rate:g} req/s"
            + ("" if args.mixed_rate else f" (keeps the prefill worker ~{PREFILL_UTILIZATION:.0%} busy)")
        )
        stop_plain_vllm(vllm_proc)
        vllm_proc = None

        print("[bench] starting two colocated plain vLLM replicas (cores 0 and 1)", flush=True)
        replica_ports = [free_port(), free_port()]
        for core, port in enumerate(replica_ports):
            proc, _ = start_plain_vllm(
                config.model_dir,
                config.served_model_name,
                port,
                run_dir / f"replica-{core}.log",
                cpu_threads_bind=str(core),
            )
            replicas.append(proc)
        loaded = compare_under_load(
            stack, replica_ports, rate_rps=mixed_rate, phase_s=args.mixed_phase_s, rounds=args.mixed_rounds
        )
        print(
            f"bench-path: ttft_p50_ratio={r_ttft:.2f} itl_p99_ratio_vs_colocated={loaded['itl_p99']:.2f} "
            f"goodput_ratio_vs_colocated={loaded['goodput']:.2f} itl_p50_ratio={r_itl:.2f} "
            f"kv_gbps={kv_bytes / kv_s / 1e9 if kv_s else 0:.2f} "
            f"long_ttft_p50_ratio_vs_colocated={loaded['long_ttft_p50']:.2f} "
            f"short_ttft_p50_ratio_vs_colocated={loaded['short_ttft_p50']:.2f} "
            f"short_itl_p99_ratio_vs_colocated={loaded['short_itl_p99']:.2f}"
        )
    finally:
        for proc in [vllm_proc, *replicas]:
            if proc is not None:
                stop_plain_vllm(proc)
        stack.stop()


if __name__ == "__main__":
    main()
