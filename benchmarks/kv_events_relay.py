"""What the worker's KV-event relay costs per batch (``python benchmarks/kv_events_relay.py``).

:class:`tandem.worker.kv_events_relay.KVEventRelay` decodes every batch with vLLM's types, zeroes the
token ids and encodes it again; the byte-level XSUB → XPUB proxy it replaced forwarded the frames
as they came. This times (1) :class:`~tandem.worker.kv_events_relay.BatchRedactor` alone on vLLM
``KVEventBatch`` payloads of one ``BlockStored`` (4 blocks x 16 tokens, and 16 blocks x 128), and
(2) batches a second carried end to end, a PUB on the engine's ipc endpoint → the relay → a SUB on
its tcp endpoint, through the relay and through the old proxy, on the same host in the same run.

Ends with one line: ``bench-kv-events-relay: redact_us small=… large=… | batches_per_s relay=… proxy=…``.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
import timeit
from typing import Any

import msgspec
import zmq

from tandem.local.stack import free_port
from tandem.worker.kv_events_relay import BatchRedactor, KVEventRelay, plan_endpoints


def payload(num_blocks: int, block_size: int) -> bytes:
    from vllm.distributed import kv_events as vkv

    event = vkv.BlockStored(
        block_hashes=list(range(1, num_blocks + 1)),
        parent_block_hash=None,
        token_ids=list(range(1, num_blocks * block_size + 1)),
        block_size=block_size,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=[("salt",)] * num_blocks,
        group_idx=0,
    )
    out: bytes = msgspec.msgpack.encode(vkv.KVEventBatch(ts=time.time(), events=[event], data_parallel_rank=0))
    return out


def redact_us(redact: BatchRedactor, data: bytes, number: int) -> float:
    return min(timeit.repeat(lambda: redact(data), number=number, repeat=5)) / number * 1e6


class ByteProxy:
    """The relay before: XSUB → XPUB, frames as they came."""

    def __init__(self, engine_endpoint: str, public_endpoint: str) -> None:
        self._ctx = zmq.Context()
        xsub, xpub = self._ctx.socket(zmq.XSUB), self._ctx.socket(zmq.XPUB)
        for sock in (xsub, xpub):
            sock.setsockopt(zmq.SNDHWM, 100_000)
            sock.setsockopt(zmq.RCVHWM, 100_000)
            sock.setsockopt(zmq.LINGER, 0)
        xpub.bind(public_endpoint)
        xsub.connect(engine_endpoint)
        self._sockets = (xsub, xpub)
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            zmq.proxy(*self._sockets)
        except zmq.ZMQError:
            pass
        finally:
            for sock in self._sockets:
                sock.close(linger=0)

    def close(self) -> None:
        self._ctx.term()


def batches_per_s(kind: str, data: bytes, num_batches: int) -> float:
    plan = plan_endpoints("127.0.0.1", free_port(), free_port(), run_dir=tempfile.mkdtemp())
    relay: Any = KVEventRelay(plan) if kind == "relay" else ByteProxy(plan.engine_publish, plan.public_publish)
    if kind == "relay":
        relay.start()
    ctx = zmq.Context()
    pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
    pub.setsockopt(zmq.SNDHWM, 1_000_000)
    sub.setsockopt(zmq.RCVHWM, 1_000_000)
    try:
        pub.bind(plan.engine_publish)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(plan.public_publish)
        seq = 0
        while not sub.poll(100):  # slow joiner: until a message gets through
            pub.send_multipart((b"", seq.to_bytes(8, "big"), data))
            seq += 1
        while sub.poll(200):
            sub.recv_multipart()
        start_s = time.perf_counter()
        for i in range(num_batches):
            pub.send_multipart((b"", (seq + i).to_bytes(8, "big"), data))
        num_received = 0
        while num_received < num_batches and sub.poll(2_000):
            sub.recv_multipart()
            num_received += 1
        elapsed_s = time.perf_counter() - start_s
        if num_received < num_batches:
            print(f"  {kind}: {num_batches - num_received} of {num_batches} lost")
        return num_received / elapsed_s
    finally:
        sub.close(linger=0)
        pub.close(linger=0)
        ctx.term()
        relay.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--num-batches", type=int, default=20_000)
    args = parser.parse_args()
    print("importing vLLM's kv_events ...", flush=True)
    redact = BatchRedactor()
    small, large = payload(4, 16), payload(16, 128)
    small_us, large_us = redact_us(redact, small, 2_000), redact_us(redact, large, 500)
    print(f"redact: {small_us:.1f} us ({len(small)} B), {large_us:.1f} us ({len(large)} B)", flush=True)
    relay_per_s = batches_per_s("relay", small, args.num_batches)
    print(f"relay: {relay_per_s:,.0f} batches/s", flush=True)
    proxy_per_s = batches_per_s("proxy", small, args.num_batches)
    print(f"proxy: {proxy_per_s:,.0f} batches/s", flush=True)
    print(
        f"bench-kv-events-relay: redact_us small={small_us:.1f} large={large_us:.1f} | "
        f"batches_per_s relay={relay_per_s:.0f} proxy={proxy_per_s:.0f}"
    )


if __name__ == "__main__":
    main()
