"""What the router's TLS front costs per Schedule (``make bench-router-tls``).

Ray Serve's gRPC proxy cannot serve TLS, so the gateway reaches the router
through ``tandem.router.tls_front``: mutual TLS, a role check, and one more
gRPC hop on the loopback to the proxy. This starts the real router
(``python -m tandem.router``, Ray Serve, one replica) with its TLS front on,
two SIMULATED workers registered in Redis (so Schedule places, as in
production), and the gateway's own client twice over: one in plaintext
straight to Serve's proxy (what the gateway did before), one with the
gateway's certificate through the front. The two take turns in blocks of
calls, so that both see the same host load; each call is a Schedule followed
by its Release, timed separately, one call at a time (the latency a request
sees), then ``--concurrency`` at once (what the front does to throughput).

Needs Redis on 127.0.0.1:6379 (``make redis``). Ends with one line:
``bench-router-tls: schedule_p50_ms plain=… tls=… ratio=… added_ms=… | p99 … | concurrent_calls_per_s plain=… tls=…``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from tandem.common.errors import NoCapacityError
from tandem.common.router_client import RouterClient
from tandem.local.pki import ensure_pki
from tandem.local.simulated_worker import SimulatedCluster, SimulatedLatencyModel, SimulatedWorkerConfig
from tandem.local.stack import free_port

REDIS_URL = "redis://127.0.0.1:6379/0"
ROUTER_READY_TIMEOUT_S = 240.0


def log(msg: str) -> None:
    print(f"[bench-router-tls] {msg}", flush=True)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def start_router(
    log_path: Path, pki_dir: Path, key_prefix: str, redis_url: str
) -> tuple[subprocess.Popen[bytes], int, int]:
    grpc_port, tls_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_ROUTER_") and k != "RAY_ADDRESS"}
    env.update(
        TANDEM_ROUTER_GRPC_PORT=str(grpc_port),
        TANDEM_ROUTER_HTTP_PORT=str(free_port()),
        TANDEM_ROUTER_REDIS__URL=redis_url,
        TANDEM_ROUTER_REGISTRY__KEY_PREFIX=key_prefix,
        TANDEM_ROUTER_RAY_NUM_CPUS="2",
        TANDEM_ROUTER_TLS_HOST="127.0.0.1",
        TANDEM_ROUTER_TLS_PORT=str(tls_port),
        TANDEM_ROUTER_TLS__ENABLED="true",
        TANDEM_ROUTER_TLS__CERT_FILE=str(pki_dir / "router.crt"),
        TANDEM_ROUTER_TLS__KEY_FILE=str(pki_dir / "router.key"),
        TANDEM_ROUTER_TLS__CA_FILE=str(pki_dir / "ca.crt"),
    )
    with open(log_path, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tandem.router"], env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + ROUTER_READY_TIMEOUT_S
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace")
        ready = [json.loads(line) for line in text.splitlines() if line.startswith("{") and '"router ready"' in line]
        if ready:
            log(f"router ready after {ready[0].get('startup_s')} s, tls front on {ready[0].get('tls_address')}")
            return proc, grpc_port, tls_port
        if proc.poll() is not None:
            raise SystemExit(f"router exited with {proc.returncode}:\n{text[-4000:]}")
        time.sleep(0.25)
    proc.kill()
    raise SystemExit(f"router not ready after {ROUTER_READY_TIMEOUT_S:.0f} s; see {log_path}")


async def one_call(client: RouterClient, n: int, model: str) -> tuple[float, float]:
    request_id = f"bench-{uuid.uuid4().hex[:8]}-{n}"
    started = time.perf_counter()
    await client.schedule(request_id, model, num_prompt_tokens=512, max_tokens=64)
    scheduled = time.perf_counter()
    await client.release(request_id)
    return (scheduled - started) * 1e3, (time.perf_counter() - scheduled) * 1e3


async def wait_for_workers(client: RouterClient, model: str, timeout_s: float = 60.0) -> None:
    """Until the replica has read the simulated workers from the registry (its view refreshes in the background)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await one_call(client, 0, model)
            return
        except NoCapacityError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


async def concurrent_rate(client: RouterClient, model: str, concurrency: int, num_calls: int) -> float:
    counter = iter(range(num_calls))

    async def worker() -> None:
        for n in counter:
            await one_call(client, n, model)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return num_calls / (time.perf_counter() - started)


async def run(args: argparse.Namespace) -> int:
    key_prefix = f"tandem-bench-tls-{uuid.uuid4().hex[:8]}"
    workdir = Path(tempfile.mkdtemp(prefix="bench-router-tls-"))
    pki = ensure_pki(workdir / "pki")
    latency = SimulatedLatencyModel(time_scale=0.0)
    cluster = SimulatedCluster(
        [
            SimulatedWorkerConfig(worker_id="simulated-prefill-0", role="prefill", latency=latency, serve_grpc=False),
            SimulatedWorkerConfig(worker_id="simulated-decode-0", role="decode", latency=latency, serve_grpc=False),
        ],
        redis_url=args.redis_url,
        key_prefix=key_prefix,
    )
    await cluster.start()
    proc, grpc_port, tls_port = start_router(workdir / "router.log", workdir / "pki", key_prefix, args.redis_url)
    plain = RouterClient(f"127.0.0.1:{grpc_port}", timeout_s=10)
    tls = RouterClient(f"127.0.0.1:{tls_port}", timeout_s=10, tls=pki["gateway"])
    clients = {"plain": plain, "tls": tls}
    model = "simulated-model"
    try:
        await wait_for_workers(plain, model)
        for client in clients.values():  # connections up, replica warm
            for n in range(args.warmup):
                await one_call(client, n, model)
        schedule_ms: dict[str, list[float]] = {name: [] for name in clients}
        release_ms: dict[str, list[float]] = {name: [] for name in clients}
        num_blocks = max(1, args.calls // args.block)
        for block in range(num_blocks):
            order = list(clients) if block % 2 == 0 else list(reversed(clients))
            for name in order:
                for n in range(args.block):
                    s_ms, r_ms = await one_call(clients[name], n, model)
                    schedule_ms[name].append(s_ms)
                    release_ms[name].append(r_ms)
            if (block + 1) % max(1, num_blocks // 5) == 0:
                log(f"{(block + 1) * args.block} of {num_blocks * args.block} calls per client")
        # Throughput in four turns (plain, tls, tls, plain), so that both see the same host load.
        seconds = {name: 0.0 for name in clients}
        for name in ["plain", "tls", "tls", "plain"]:
            num_calls = args.concurrent_calls // 2
            seconds[name] += num_calls / await concurrent_rate(clients[name], model, args.concurrency, num_calls)
        rates = {name: 2 * (args.concurrent_calls // 2) / seconds[name] for name in clients}
    finally:
        for client in clients.values():
            await client.aclose()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        await cluster.aclose()

    p50 = {n: statistics.median(v) for n, v in schedule_ms.items()}
    p99 = {n: pct(v, 0.99) for n, v in schedule_ms.items()}
    rel50 = {n: statistics.median(v) for n, v in release_ms.items()}
    for name in clients:
        log(
            f"{name:5s}: Schedule p50 {p50[name]:.3f} ms p99 {p99[name]:.3f} ms, Release p50 {rel50[name]:.3f} ms, "
            f"{rates[name]:.0f} Schedule+Release/s at {args.concurrency} in flight ({len(schedule_ms[name])} calls)"
        )
    print(
        f"bench-router-tls: schedule_p50_ms plain={p50['plain']:.3f} tls={p50['tls']:.3f} "
        f"ratio={p50['tls'] / p50['plain']:.2f} added_ms={p50['tls'] - p50['plain']:.3f} | "
        f"schedule_p99_ms plain={p99['plain']:.3f} tls={p99['tls']:.3f} | "
        f"concurrent_calls_per_s plain={rates['plain']:.0f} tls={rates['tls']:.0f}",
        flush=True,
    )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000, help="timed Schedule+Release calls per client")
    parser.add_argument("--block", type=int, default=100, help="calls in a row before the other client's turn")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--concurrent-calls", type=int, default=2000)
    parser.add_argument("--redis-url", default=REDIS_URL)
    return asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
