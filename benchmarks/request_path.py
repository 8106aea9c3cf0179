"""Request-path benchmark (``make bench-path``): Tandem's disaggregated path
through the gateway vs the same model served by plain vLLM
(``vllm.entrypoints.openai.api_server``), measured side by side in one run.

Both servers run at once; requests alternate between them one at a time, so
machine noise hits both alike. Prints TTFT and inter-token latency p50/p90
for each and their ratios, the KV transfer throughput of ~2,000-token prompts
(from the decode engine's own transfer records) and engine start-up times.
Real engines, real model; nothing simulated."""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from pathlib import Path

import httpx

from tandem.local.plain_vllm import start_plain_vllm, stop_plain_vllm
from tandem.local.stack import LocalStack, StackConfig, free_port


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def stream_once(
    base_url: str, model: str, prompt: str, max_tokens: int, headers: dict[str, str] | None = None
) -> tuple[float, list[float]]:
    """(TTFT, inter-token gaps) as vllm bench serve defines them: first non-empty content delta."""
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-requests", type=int, default=12, help="per server")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-long", type=int, default=3, help="~2,000-token prompts for KV throughput")
    args = parser.parse_args()

    run_dir = Path(".run/bench-path")
    run_dir.mkdir(parents=True, exist_ok=True)
    config = StackConfig.with_free_ports(key_prefix=f"tandem-bench-{uuid.uuid4().hex[:6]}", log_dir=run_dir)
    stack = LocalStack(config, progress=lambda m: print(f"[bench] {m}", flush=True))
    vllm_proc = None
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
        import grpc

        from tandem.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

        kv = kv_transfer_pb2_grpc.KVTransferStub(grpc.insecure_channel(f"127.0.0.1:{config.decode_kv_port}"))
        before = kv.GetStats(kv_transfer_pb2.KVStatsRequest())
        for i in range(args.num_long):
            doc = " ".join(f"Fact {i}-{j}: the number {j * 7 + i} is interesting." for j in range(150))
            stream_once(config.gateway_url, config.served_model_name, doc + " Summarize.", 4, stack.auth_headers)
        after = kv.GetStats(kv_transfer_pb2.KVStatsRequest())
        kv_bytes = after.bytes_received_total - before.bytes_received_total
        kv_s = after.transfer_seconds_total - before.transfer_seconds_total
        kv_tokens = after.kv_tokens_loaded_total - before.kv_tokens_loaded_total

        print(
            "\nrequest path, measured side by side in one run "
            f"({args.num_requests} requests each, {args.max_tokens} output tokens, alternating)"
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
        print(
            f"KV transfer: {kv_tokens} tokens in {args.num_long} prompts "
            f"(~{kv_tokens // max(1, args.num_long)} each), {kv_bytes / 1e6:.1f} MB in {kv_s:.3f} s "
            f"= {kv_bytes / kv_s / 1e9 if kv_s else 0:.2f} GB/s"
        )
        print(
            f"start-up: prefill worker {stack.ready_after_s.get('prefill', 0):.1f} s, decode worker "
            f"{stack.ready_after_s.get('decode', 0):.1f} s (both at once, one core each), "
            f"router {stack.ready_after_s.get('router', 0):.1f} s, plain vLLM {vllm_start_s:.1f} s "
            "(alone, while the stack idled)"
        )
        print(
            f"bench-path: ttft_p50_ratio={r_ttft:.2f} itl_p50_ratio={r_itl:.2f} "
            f"kv_gbps={kv_bytes / kv_s / 1e9 if kv_s else 0:.2f}"
        )
    finally:
        if vllm_proc is not None:
            stop_plain_vllm(vllm_proc)
        stack.stop()


if __name__ == "__main__":
    main()
