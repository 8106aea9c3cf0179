"""The router ledger's pub/sub clients side by side, in one run, on the real Redis: the one in the
tree (:mod:`tandem.router.pubsub`) and the one of another revision (``--baseline-rev``, read with
``git show``; by default the hand-written ``asyncio.Protocol`` client that issue 39 replaced).

Each client carries one replica's share of a fleet: it publishes ``--rate`` messages a second of
``--bytes`` bytes, one per event-loop iteration as the ledger flushes, and receives them back on
its subscription with what another process publishes on the same channel at 3 x ``--rate`` (the
other three replicas), for ``--seconds``. The clients take turns, ``--repeats`` times each.
Reported per client (medians over the repeats):

* ``cpu_us_per_msg``: the process's CPU time over the messages it published; it received four
  times as many, so this is a replica's event-loop cost of the ledger's pub/sub per placement;
* ``loop_cpu_share``: that CPU time over the wall time (the event loop's share spent on it);
* ``publish_us`` p50/p99: the time inside ``Publisher.publish`` (what a decision's flush waits);
* ``latency_ms`` p50/p99: from ``publish`` to this replica's own subscription handing the message
  over (a lower bound of a peer's replication lag);
* ``loop_lag_ms`` p99: how late a 1 ms timer fires (what a request arriving meanwhile waits).

Usage: ``python benchmarks/ledger_pubsub.py [--seconds 10] [--rate 500] [--repeats 2]``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

import redis

from tandem.router import pubsub

REDIS_URL = "redis://127.0.0.1:6379/0"
#: The hand-written client (asyncio.Protocol + hiredis), as it was before issue 39 replaced it.
DEFAULT_BASELINE_REV = "6a98561"
PUBSUB_PATH = "services/router/tandem/router/pubsub.py"


def load_revision(rev: str) -> ModuleType:
    """``tandem.router.pubsub`` as it was at ``rev``, as a module of its own."""
    source = subprocess.run(
        ["git", "show", f"{rev}:{PUBSUB_PATH}"], check=True, capture_output=True, cwd=Path(__file__).parent
    ).stdout
    path = Path(tempfile.mkdtemp()) / f"pubsub_{rev}.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location(f"pubsub_{rev}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def others(channel: str, rate: float, num_bytes: int, seconds: float) -> None:
    """The other replicas: a plain client publishing ``rate`` messages a second."""
    client = redis.Redis.from_url(REDIS_URL)
    payload = b"o" * num_bytes
    interval_s, next_s = 1.0 / rate, time.monotonic()
    end_s = next_s + seconds
    while (now_s := time.monotonic()) < end_s:
        if now_s < next_s:
            time.sleep(next_s - now_s)
        client.publish(channel, payload)
        next_s += interval_s


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run_client(module: Any, seconds: float, rate: float, num_bytes: int) -> dict[str, float]:
    channel = f"tandem-bench-ledger-pubsub-{uuid.uuid4().hex[:8]}"
    latencies_s: list[float] = []
    num_received = [0]

    def on_message(payload: bytes) -> None:
        num_received[0] += 1
        if payload[:3] == b"own":
            latencies_s.append(time.perf_counter() - float(payload[3:23]))

    subscription = await module.Subscription.open(REDIS_URL, channel, on_message, timeout_s=2.0)
    publisher = module.Publisher(REDIS_URL, channel, timeout_s=2.0)
    await publisher.connect()
    other = mp.get_context("spawn").Process(target=others, args=(channel, 3 * rate, num_bytes, seconds))
    other.start()
    await asyncio.sleep(0.5)  # the other process is publishing
    loop = asyncio.get_running_loop()
    publish_s: list[float] = []
    lags_s: list[float] = []
    padding = b"x" * max(0, num_bytes - 23)
    done = loop.create_future()
    interval_s = 1.0 / rate
    end_s = time.monotonic() + seconds - 1.0
    num_refused = [0]

    def publish_one() -> None:
        if time.monotonic() >= end_s:
            done.set_result(None)
            return
        payload = b"own%020.6f" % time.perf_counter() + padding
        started = time.perf_counter()
        if not publisher.publish(payload):
            num_refused[0] += 1
        publish_s.append(time.perf_counter() - started)
        loop.call_later(interval_s, publish_one)

    async def measure_lag() -> None:
        while not done.done():
            started = time.perf_counter()
            await asyncio.sleep(0.001)
            lags_s.append(time.perf_counter() - started - 0.001)

    cpu_start, wall_start = time.process_time(), time.perf_counter()
    lag_task = loop.create_task(measure_lag())
    loop.call_soon(publish_one)
    await done
    await asyncio.sleep(0.2)  # the last ones arrive
    cpu_s, wall_s = time.process_time() - cpu_start, time.perf_counter() - wall_start
    await lag_task
    other.join()
    close = getattr(subscription, "aclose", None)
    if close is not None:
        await close()
    else:
        subscription.close()
    await publisher.aclose()
    return {
        "num_published": len(publish_s),
        "num_received": num_received[0],
        "num_refused": num_refused[0],
        "cpu_us_per_msg": cpu_s / len(publish_s) * 1e6,
        "loop_cpu_share": cpu_s / wall_s,
        "publish_us_p50": percentile(publish_s, 0.5) * 1e6,
        "publish_us_p99": percentile(publish_s, 0.99) * 1e6,
        "latency_ms_p50": percentile(latencies_s, 0.5) * 1e3,
        "latency_ms_p99": percentile(latencies_s, 0.99) * 1e3,
        "loop_lag_ms_p99": percentile(lags_s, 0.99) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=500.0, help="messages a second this replica publishes")
    parser.add_argument("--bytes", type=int, default=300, help="bytes per message (a placement's is ~200-400)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--baseline-rev", default=DEFAULT_BASELINE_REV)
    args = parser.parse_args()
    clients: dict[str, Any] = {"tree": pubsub, f"rev {args.baseline_rev}": load_revision(args.baseline_rev)}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in clients}
    for repeat in range(args.repeats):
        for name, module in clients.items():
            print(
                f"[{repeat + 1}/{args.repeats}] {name}: {args.seconds:.0f} s at {args.rate:.0f}/s ...", file=sys.stderr
            )
            results[name].append(asyncio.run(run_client(module, args.seconds, args.rate, args.bytes)))
    summary = {
        name: {key: round(statistics.median(r[key] for r in runs), 3) for key in runs[0]}
        for name, runs in results.items()
    }
    print(json.dumps({"rate": args.rate, "bytes": args.bytes, "seconds": args.seconds, "clients": summary}, indent=2))


if __name__ == "__main__":
    main()
