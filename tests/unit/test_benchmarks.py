"""The benchmarks still run against today's code: a benchmark nobody runs in CI rots the first time
the code under it is reshaped (``make bench-kv`` died on a method that had moved to the KV server).
Each runs in its cheapest form, in a process of its own as ``make`` runs it; its figures are not
checked here (the machine is shared and noisy), only that it ends with its summary line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def run_bench(script: str, *args: str, timeout_s: float = 300) -> str:
    """Run ``benchmarks/<script>`` as ``make`` does; its standard output, once it exited 0."""
    done = subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done.stdout


def last_line(stdout: str) -> str:
    return stdout.strip().splitlines()[-1]


def test_bench_kv_transport_runs_and_ends_with_its_line() -> None:
    """Part 1 (two real KV servers, loopback TCP, a bare gRPC stream; one at a time and concurrently),
    one repeat; pulled bytes are checked identical inside the benchmark."""
    stdout = run_bench("kv_transfer.py", "--repeats", "1", "--warmup", "1")
    last = last_line(stdout)
    number = r"[0-9]+\.[0-9]+"
    assert re.fullmatch(
        rf"bench-kv: pull_gbps={number} loopback_gbps={number} ratio={number} grpc_ceiling_gbps={number}"
        rf" min_ratio_vs_grpc={number} concurrent_ratio={number} shm_gbps={number} memcpy_gbps={number}"
        rf" shm_ratio={number} concurrent_shm_ratio={number} prefetch_shm_gbps={number}"
        rf" prefetch_grpc_gbps={number} second_token_gap_ratio=n/a"
        r" second_token_gap_ratio_without_prefetch=n/a",
        last,
    ), last


def test_bench_router_tls_runs_and_ends_with_its_line() -> None:
    """The real router with its TLS front (Ray Serve, needs Redis on 127.0.0.1:6379), a few calls each way."""
    stdout = run_bench(
        "bench_router_tls.py",
        "--calls",
        "20",
        "--block",
        "10",
        "--warmup",
        "2",
        "--concurrency",
        "4",
        "--concurrent-calls",
        "20",
    )
    last = last_line(stdout)
    number = r"[0-9]+\.[0-9]+"
    assert re.fullmatch(
        rf"bench-router-tls: schedule_p50_ms plain={number} tls={number} ratio={number} added_ms=-?{number}"
        rf" \| schedule_p99_ms plain={number} tls={number} \| concurrent_calls_per_s plain=[0-9]+ tls=[0-9]+",
        last,
    ), last


def test_bench_adapters_runs_and_ends_with_its_line() -> None:
    """Adapter-aware placement on SIMULATED workers (real Redis, the real router replica), its three
    runs in their smallest form: a few workers, a few seconds each."""
    stdout = run_bench(
        "bench_adapters.py", "--workers", "3", "--adapters", "6", "--rate", "4", "--warmup-s", "1", "--duration-s", "3"
    )
    assert "SIMULATED" in stdout
    last = last_line(stdout)
    match = re.fullmatch(
        r"bench-adapters: loads_per_min_per_worker=(\S+) ttft_p99_ratio_vs_one_adapter=(\S+) hit_rate=(\S+)", last
    )
    assert match is not None, last
    loads, ratio, hit_rate = (float(v) for v in match.groups())
    assert loads >= 0 and ratio > 0 and 0 <= hit_rate <= 1


def test_bench_chain_runs_and_ends_with_its_line() -> None:
    """The real local stack (engines, router, gateway process, Redis), two tenants' chains of three turns
    with short instructions, the gateway SIGKILLed and started again after the first turn: the chains must
    go on after it (restart_survived=yes); the timings and the cached share are not checked (the short
    instructions stay under one KV block's worth of the 90 %)."""
    stdout = run_bench(
        "response_chains.py",
        "--tenants",
        "2",
        "--turns",
        "3",
        "--restart-after",
        "1",
        "--rules",
        "2",
        "--kv-cache-gib",
        "0.25",
        timeout_s=600,
    )
    last = last_line(stdout)
    match = re.fullmatch(
        r"bench-chain: turn3_ttft_p50_ratio_vs_turn2=(\S+) cached_share_p50=(\S+) restart_survived=(yes|no)", last
    )
    assert match is not None, last
    ratio, share = float(match.group(1)), float(match.group(2))
    assert ratio > 0 and 0 <= share <= 1 and match.group(3) == "yes", last
