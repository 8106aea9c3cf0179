"""When does the handoff pay? (``make bench-local-prefill``): the measurement behind the router's
``disaggregation.min_uncached_tokens`` default.

Real vLLM engines (one prefill worker, one decode worker, the local stack without router and
gateway), driven over their gRPC ``tandem.v1.Worker`` services. For each uncached prompt length, a
background answer streams on the decode worker (another user mid-answer) while one request
arrives there, either way, alternating:

* ``handoff``: ``Prefill`` on the prefill worker, then ``Decode`` pulling the KV;
* ``local``: ``Decode`` with ``local_prefill`` (the decode engine computes the prompt itself).

Two figures per way:

* ``to 2nd token``: the arriving request's time from its first RPC to its second token (what its
  user waits for before the answer flows; the handoff's price is here);
* ``stall``: the longest gap between two tokens of the background answer while the request ran,
  less that answer's median gap (what the other users of the decode worker pay; a local prefill's
  price is here).

The local prefill pays while the stall it adds for the others, over the handoff's own stall, is
smaller than what it saves the arriving request: the suggested threshold is the length where that
stops being so (interpolated between the measured lengths). Ends with
``bench-local-prefill: suggested_min_uncached_tokens=…``.
Figures are this machine's (CPU engines); on GPUs prefill is far cheaper per token and the
handoff moves over faster links, so measure there before changing the default there.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from tandem.local.stack import LocalStack, StackConfig
from tandem.v1 import common_pb2, worker_pb2, worker_pb2_grpc

LENGTHS_TOKENS = (32, 64, 128, 256, 512, 1024)


def _prompt(num_tokens: int, salt: int) -> list[int]:
    """Token ids no earlier prompt shares (nothing is prefix-cached)."""
    return [100 + (salt * 7919 + k * 104_729) % 40_000 for k in range(num_tokens)]


def _sampling(max_tokens: int) -> common_pb2.SamplingOptions:
    return common_pb2.SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@dataclass
class Background:
    """A long answer streaming on the decode worker; records when each token arrived."""

    stub: worker_pb2_grpc.WorkerStub
    arrivals_s: list[float] = field(default_factory=list)
    _call: object | None = None

    def start(self) -> None:
        request = worker_pb2.DecodeRequest(
            request_id=f"background-{uuid.uuid4().hex[:8]}",
            prompt_token_ids=_prompt(24, salt=int(time.time())),
            sampling=_sampling(4000),
            local_prefill=True,
        )
        self._call = self.stub.Decode(request, timeout=600)
        threading.Thread(target=self._read, daemon=True).start()
        while len(self.arrivals_s) < 10:
            time.sleep(0.01)

    def _read(self) -> None:
        try:
            for chunk in self._call:  # type: ignore[attr-defined]
                if chunk.token_ids:
                    self.arrivals_s.append(time.perf_counter())
        except grpc.RpcError:
            pass  # cancelled at the end

    def stop(self) -> None:
        self._call.cancel()  # type: ignore[attr-defined]

    def stall_s(self, start_s: float, end_s: float) -> float:
        """Longest gap ending inside [start_s, end_s + one step], less the median gap."""
        arrivals = list(self.arrivals_s)
        gaps = [b - a for a, b in itertools.pairwise(arrivals)]
        window = [b - a for a, b in itertools.pairwise(arrivals) if start_s < b and a < end_s]
        return max(window, default=0.0) - statistics.median(gaps)


def _decode_until_second_token(stub: worker_pb2_grpc.WorkerStub, request: worker_pb2.DecodeRequest) -> float:
    """When the decode stream brought the request's second token (first of decode for a handoff)."""
    num_tokens_needed = 2 if request.local_prefill else 1
    seen = 0
    for chunk in stub.Decode(request, timeout=300):
        seen += len(chunk.token_ids)
        if seen >= num_tokens_needed:
            return time.perf_counter()
    raise AssertionError("the decode stream ended early")


def handoff(prefill: worker_pb2_grpc.WorkerStub, decode: worker_pb2_grpc.WorkerStub, prompt: list[int]) -> float:
    request_id = f"handoff-{uuid.uuid4().hex[:8]}"
    started_s = time.perf_counter()
    first = prefill.Prefill(
        worker_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt, sampling=_sampling(4), keep_kv=True),
        timeout=300,
    )
    request = worker_pb2.DecodeRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        first_token_id=first.first_token_id,
        first_text=first.first_text,
        sampling=_sampling(4),
        kv_handle=first.kv_handle,
    )
    return _decode_until_second_token(decode, request) - started_s


def local(decode: worker_pb2_grpc.WorkerStub, prompt: list[int]) -> float:
    started_s = time.perf_counter()
    request = worker_pb2.DecodeRequest(
        request_id=f"local-{uuid.uuid4().hex[:8]}", prompt_token_ids=prompt, sampling=_sampling(4), local_prefill=True
    )
    return _decode_until_second_token(decode, request) - started_s


@dataclass
class Figures:
    to_second_s: dict[str, list[float]] = field(default_factory=lambda: {"handoff": [], "local": []})
    stall_s: dict[str, list[float]] = field(default_factory=lambda: {"handoff": [], "local": []})


def measure(stack: LocalStack, repeats: int) -> dict[int, Figures]:
    # As the gateway calls them (over the stack's mTLS, with the gateway's certificate).
    prefill = worker_pb2_grpc.WorkerStub(stack.worker_channel("prefill"))
    decode = worker_pb2_grpc.WorkerStub(stack.worker_channel("decode"))
    handoff(prefill, decode, _prompt(64, salt=-1))  # warm both paths up
    local(decode, _prompt(64, salt=-2))
    results: dict[int, Figures] = {}
    salt = 0
    for num_tokens in LENGTHS_TOKENS:
        figures = results[num_tokens] = Figures()
        for _ in range(repeats):
            background = Background(decode)
            background.start()
            try:
                for way in ("handoff", "local"):
                    salt += 1
                    prompt = _prompt(num_tokens, salt)
                    started_s = time.perf_counter()
                    took_s = handoff(prefill, decode, prompt) if way == "handoff" else local(decode, prompt)
                    time.sleep(0.3)  # the background answer's next few tokens close the window
                    figures.to_second_s[way].append(took_s)
                    figures.stall_s[way].append(background.stall_s(started_s, started_s + took_s))
            finally:
                background.stop()
        print(f"[bench-local-prefill] {num_tokens} tokens done", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    run_dir = Path(".run/bench-local-prefill")
    run_dir.mkdir(parents=True, exist_ok=True)
    config = StackConfig.with_free_ports(
        key_prefix=f"tandem-bench-lp-{uuid.uuid4().hex[:6]}", log_dir=run_dir, start_router=False, start_gateway=False
    )
    stack = LocalStack(config, progress=lambda m: print(f"[bench-local-prefill] {m}", flush=True))
    try:
        stack.start()
        results = measure(stack, args.repeats)
    finally:
        stack.stop()

    med = statistics.median
    print(f"\nmedians of {args.repeats}; a background answer streams on the decode worker throughout")
    header = ("uncached", "handoff→2nd", "local→2nd", "saved", "handoff stall", "local stall", "added stall")
    print(" ".join(f"{h:>13}" for h in header))
    net_s: dict[int, float] = {}  # > 0: the local prefill costs the others more than it saves the request
    for num_tokens, f in results.items():
        h2, l2 = med(f.to_second_s["handoff"]), med(f.to_second_s["local"])
        hs, ls = med(f.stall_s["handoff"]), med(f.stall_s["local"])
        saved, added = h2 - l2, ls - hs
        net_s[num_tokens] = added - saved
        print(
            f"{num_tokens:>13} {h2 * 1e3:>11.0f}ms {l2 * 1e3:>11.0f}ms {saved * 1e3:>11.0f}ms "
            f"{hs * 1e3:>11.0f}ms {ls * 1e3:>11.0f}ms {added * 1e3:>11.0f}ms"
        )
    crossover = crossover_tokens(net_s)
    print(
        "\nthreshold: where the stall a local prefill adds for the decode worker's other users overtakes what "
        "it saves the arriving request (interpolated between lengths, rounded down to 16 tokens)"
    )
    verdict = "n/a" if crossover is None else str(max(16, int(crossover) // 16 * 16))
    print(f"bench-local-prefill: suggested_min_uncached_tokens={verdict}")


def crossover_tokens(net_s: dict[int, float]) -> float | None:
    """The length where ``net_s`` (by length, ascending) first turns positive, linearly interpolated;
    None when it never does (or already is at the shortest length)."""
    lengths = sorted(net_s)
    for shorter, longer in itertools.pairwise(lengths):
        if net_s[shorter] <= 0 < net_s[longer]:
            return shorter + (longer - shorter) * -net_s[shorter] / (net_s[longer] - net_s[shorter])
    return None


if __name__ == "__main__":
    main()
