"""KV handoff benchmark (``make bench-kv``): how fast a decode engine's KV server
pulls a prompt's KV from a prefill engine's, next to what the machine and gRPC
can do, measured side by side in one run.

Part 1, transport (no engines; real ``WorkerSide`` KV servers in two processes,
with the default model's real KV layout on CPU: 30 layers, blocks of
(2, 3 KV heads, 128 tokens, 64) per layer):

* ``pull``: the decode side's ``WorkerSide`` pulls 1 block, ~1k and ~4k tokens
  from the prefill side's over ``tandem.v1.KVTransfer/PullBlockBytes``, into its
  paged cache; the bytes are checked identical afterwards;
* ``loopback``: a plain one-stream TCP copy of the same byte count between two
  processes (``sendall`` of one buffer, ``recv_into`` a preallocated one);
* ``grpc ceiling``: a minimal two-process gRPC server stream of the same byte
  count in messages of the pull's chunk size, raw bytes (no protobuf), the
  client copying each message into a preallocated buffer;
* where the pull's time goes: its two copies (the prefill side writing cache
  blocks out as wire bytes, the decode side copying wire bytes into its cache),
  each timed alone, beside what gRPC alone needs for the same bytes.

Part 2, engines (``--engines``; real vLLM, real model): the gap between the first
token (from prefill) and the second (from decode) for a ~2k-token prompt through
the Tandem stack, next to plain vLLM's inter-token latency for the same prompt.

Ends with ``bench-kv: pull_gbps=… loopback_gbps=… ratio=… grpc_ceiling_gbps=…
second_token_gap_ratio=…`` (ratio: pull ÷ loopback at ~4k tokens; the gap ratio
is ``n/a`` without ``--engines``). Nothing is simulated; the transport part
does not run an engine's forward pass beside the KV server, so the GIL
contention of a live engine is not in its figures (part 2 has it).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

NUM_LAYERS = 30
BLOCK_TOKENS = 128
#: One block of one layer in vLLM's CPU attention layout (K and V, KV heads, tokens, head size).
BLOCK_SHAPE = (2, 3, BLOCK_TOKENS, 64)
NUM_CACHE_BLOCKS = 40
#: Prompt sizes in tokens: one block, ~1k, ~4k.
SIZES_TOKENS = (BLOCK_TOKENS, 1024, 4096)
SEED = 1234
GRPC_METHOD = "/tandem.bench.Bytes/Stream"


@dataclass(frozen=True)
class Size:
    num_tokens: int

    @property
    def num_blocks(self) -> int:
        return -(-self.num_tokens // BLOCK_TOKENS)

    def num_bytes(self, element_size: int) -> int:
        numel = 1
        for d in BLOCK_SHAPE:
            numel *= d
        return self.num_blocks * NUM_LAYERS * numel * element_size


def _caches(dtype_name: str, seed: int | None) -> dict[str, Any]:
    import torch

    dtype = getattr(torch, dtype_name)
    shape = (BLOCK_SHAPE[0], NUM_CACHE_BLOCKS, *BLOCK_SHAPE[1:])
    if seed is None:
        return {f"model.layers.{i}.self_attn.attn": torch.zeros(shape, dtype=dtype) for i in range(NUM_LAYERS)}
    generator = torch.Generator().manual_seed(seed)
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn(shape, generator=generator).to(dtype)
        for i in range(NUM_LAYERS)
    }


def _side(port: int, max_chunk_bytes: int) -> Any:
    from tandem.worker.kv_connector.worker_side import WorkerSide

    return WorkerSide(
        model="SmolLM2-135M-Instruct",
        num_blocks=NUM_CACHE_BLOCKS,
        block_size_tokens=BLOCK_TOKENS,
        tp_size=1,
        tp_rank=0,
        kv_host="127.0.0.1",
        kv_port=port,
        max_chunk_bytes=max_chunk_bytes,
        pull_timeout_s=120,
    )


# --- part 1: processes --------------------------------------------------------------------------------------


def _prefill_server(conn: Connection, port: int, dtype_name: str, max_chunk_bytes: int, holds: list[str]) -> None:
    """The prefill side: a KV server over seeded random caches, holding blocks 0.. for each id in ``holds``."""
    from tandem.worker.kv_connector.metadata import GrpcKVMetadata

    side = _side(port, max_chunk_bytes)
    side.register_kv_caches(_caches(dtype_name, SEED))
    blocks = tuple(range(Size(max(SIZES_TOKENS)).num_blocks))
    side.start_load_kv(GrpcKVMetadata(holds={rid: (blocks, time.time() + 3600) for rid in holds}))
    conn.send("ready")
    conn.recv()
    side.shutdown()


def _tcp_server(conn: Connection, num_bytes: int, repeats: int) -> None:
    payload = bytes(num_bytes)
    with socket.create_server(("127.0.0.1", 0)) as server:
        conn.send(server.getsockname()[1])
        for _ in range(repeats):
            peer, _ = server.accept()
            with peer:
                peer.recv(1)
                peer.sendall(payload)


def _grpc_server(conn: Connection, chunk_bytes: int) -> None:
    from concurrent import futures

    import grpc

    chunk = bytes(chunk_bytes)

    def stream(request: bytes, context: Any) -> Iterator[bytes]:
        remaining = int.from_bytes(request, "little")
        while remaining > 0:
            piece = chunk if remaining >= len(chunk) else chunk[:remaining]
            remaining -= len(piece)
            yield piece

    handler = grpc.method_handlers_generic_handler(
        "tandem.bench.Bytes",
        {"Stream": grpc.unary_stream_rpc_method_handler(stream, lambda b: b, lambda b: b)},
    )
    options = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=options)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    conn.send(port)
    conn.recv()
    server.stop(None)


def _start(target: Any, *args: Any) -> tuple[Any, Connection]:
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=target, args=(theirs, *args), daemon=True)
    proc.start()
    return proc, ours


def measure_loopback_gbps(num_bytes: int, repeats: int) -> float:
    proc, conn = _start(_tcp_server, num_bytes, repeats)
    port = conn.recv()
    buf = bytearray(num_bytes)
    view = memoryview(buf)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"g")
            got = 0
            while got < num_bytes:
                n = sock.recv_into(view[got:])
                if n == 0:
                    raise RuntimeError("loopback server closed early")
                got += n
        times.append(time.perf_counter() - started)
    proc.join(timeout=10)
    return num_bytes / statistics.median(times) / 1e9


def measure_grpc_ceiling_gbps(num_bytes: int, chunk_bytes: int, repeats: int) -> float:
    import grpc

    proc, conn = _start(_grpc_server, chunk_bytes)
    port = conn.recv()
    options = [("grpc.max_receive_message_length", 64 << 20)]
    buf = bytearray(num_bytes)
    times = []
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        call = channel.unary_stream(GRPC_METHOD, request_serializer=lambda b: b, response_deserializer=lambda b: b)
        list(call((1).to_bytes(8, "little")))  # connect and warm up
        for _ in range(repeats):
            started = time.perf_counter()
            offset = 0
            for message in call(num_bytes.to_bytes(8, "little")):
                buf[offset : offset + len(message)] = message
                offset += len(message)
            times.append(time.perf_counter() - started)
            assert offset == num_bytes
    conn.send("stop")
    proc.join(timeout=10)
    return num_bytes / statistics.median(times) / 1e9


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure_pulls(dtype_name: str, max_chunk_bytes: int, repeats: int) -> dict[int, float]:
    """Seconds per pull (median, from the decode side's own transfer record) by prompt size.
    After every pull the decode cache's blocks must equal the prefill cache's, byte for byte."""
    import torch

    from tandem.worker.kv_connector.metadata import LoadSpec
    from tandem.worker.kv_connector.params import KVHandleParams

    port = _free_port()
    request_ids = [f"bench-{n}-{i}" for n in SIZES_TOKENS for i in range(repeats + 1)]
    proc, conn = _start(_prefill_server, port, dtype_name, max_chunk_bytes, request_ids)
    assert conn.recv() == "ready"
    expected = _caches(dtype_name, SEED)
    decode = _side(_free_port(), max_chunk_bytes)
    caches = _caches(dtype_name, None)
    decode.register_kv_caches(caches)
    seconds: dict[int, float] = {}
    try:
        for num_tokens in SIZES_TOKENS:
            size = Size(num_tokens)
            remote = tuple(range(size.num_blocks))
            # Land the blocks elsewhere than they came from, in reverse order: the ids really map.
            local = tuple(NUM_CACHE_BLOCKS - 1 - b for b in remote)
            times = []
            for i in range(repeats + 1):  # the first pull connects and warms up; not counted
                rid = f"bench-{num_tokens}-{i}"
                for tensor in caches.values():
                    tensor.zero_()
                handle = KVHandleParams("prefill", f"127.0.0.1:{port}", rid, remote, num_tokens, time.time() + 600)
                decode._load(LoadSpec(f"{rid}-0123abcd", handle, remote, local, num_tokens))
                record = decode.stats(rid).request
                if record.failed:
                    raise RuntimeError(f"pull of {num_tokens} tokens failed: {record.error}")
                if i:
                    times.append(record.seconds)
                index_remote, index_local = torch.tensor(remote), torch.tensor(local)
                for name, tensor in caches.items():
                    want = expected[name].index_select(1, index_remote)
                    if not torch.equal(tensor.index_select(1, index_local).view(torch.uint8), want.view(torch.uint8)):
                        raise AssertionError(f"pulled KV differs from the prefill side's in {name}")
            seconds[num_tokens] = statistics.median(times)
    finally:
        conn.send("stop")
        proc.join(timeout=10)
        decode.shutdown()
    return seconds


def breakdown_s(dtype_name: str, num_tokens: int, max_chunk_bytes: int) -> dict[str, float]:
    """The pull's two copies for one prompt, each timed alone in this process (no network): the
    prefill side reading blocks out of its cache into wire bytes, the decode side copying wire
    bytes into its cache. They run in two processes at once, so the pull takes at least the
    slower of the two plus what gRPC adds (the ceiling above)."""
    from tandem.worker.kv_connector import wire

    side = _side(_free_port(), max_chunk_bytes)
    caches = _caches(dtype_name, SEED)
    side.register_kv_caches(caches)
    try:
        blocks = list(range(Size(num_tokens).num_blocks))
        started = time.perf_counter()
        chunks = list(side.read_chunks(blocks, max_chunk_bytes))
        read_s = time.perf_counter() - started
        layers = list(caches.values())
        element_size = layers[0].element_size()
        numel = 1
        for d in BLOCK_SHAPE:
            numel *= d
        plan = wire.chunk_plan(len(layers), len(blocks), numel * element_size, max_chunk_bytes)
        started = time.perf_counter()
        for chunk, data in zip(plan, chunks, strict=True):
            ids = blocks[chunk.first : chunk.first + chunk.num_blocks]
            wire.write_blocks(layers[chunk.layer_index], side._block_dim, ids, data)
        write_s = time.perf_counter() - started
    finally:
        side.shutdown()
    return {"prefill side: cache blocks to wire bytes": read_s, "decode side: wire bytes into the cache": write_s}


# --- part 2: engines ----------------------------------------------------------------------------------------


def second_token_gaps(num_requests: int) -> tuple[list[float], list[float]]:
    """(Tandem's first→second token gaps, plain vLLM's inter-token gaps) for ~2k-token prompts,
    alternating between the two servers one request at a time."""
    import uuid
    from pathlib import Path

    from request_path import stream_once  # type: ignore[import-not-found]

    from tandem.local.plain_vllm import start_plain_vllm, stop_plain_vllm
    from tandem.local.stack import LocalStack, StackConfig

    run_dir = Path(".run/bench-kv")
    run_dir.mkdir(parents=True, exist_ok=True)
    config = StackConfig.with_free_ports(key_prefix=f"tandem-bench-kv-{uuid.uuid4().hex[:6]}", log_dir=run_dir)
    stack = LocalStack(config, progress=lambda m: print(f"[bench-kv] {m}", flush=True))
    vllm_proc = None
    tandem_gaps: list[float] = []
    vllm_gaps: list[float] = []
    try:
        stack.start()
        vllm_port = _free_port()
        vllm_proc, _ = start_plain_vllm(config.model_dir, config.served_model_name, vllm_port, run_dir / "vllm.log")
        vllm_url = f"http://127.0.0.1:{vllm_port}"
        model = config.served_model_name
        stream_once(config.gateway_url, model, "Hello", 4, stack.auth_headers)
        stream_once(vllm_url, model, "Hello", 4, {})
        for i in range(num_requests):
            # Distinct documents: nothing is prefix-cached, every request moves its whole KV.
            doc = " ".join(f"Fact {i}-{j}: the number {j * 7 + i} is interesting." for j in range(150))
            prompt = doc + " Summarize."
            _, gaps = stream_once(config.gateway_url, model, prompt, 8, stack.auth_headers)
            tandem_gaps.append(gaps[0])
            _, gaps = stream_once(vllm_url, model, prompt + " ", 8, {})
            vllm_gaps.extend(gaps)
            print(f"[bench-kv] {i + 1}/{num_requests}", flush=True)
    finally:
        if vllm_proc is not None:
            stop_plain_vllm(vllm_proc)
        stack.stop()
    return tandem_gaps, vllm_gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--max-chunk-bytes", type=int, default=4 << 20, help="the worker's default")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--engines", action="store_true", help="also measure the second-token gap on engines")
    parser.add_argument("--num-requests", type=int, default=6, help="~2k-token prompts per server (--engines)")
    args = parser.parse_args()

    import torch

    element_size = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    pulls_s = measure_pulls(args.dtype, args.max_chunk_bytes, args.repeats)
    largest = max(SIZES_TOKENS)
    num_bytes = Size(largest).num_bytes(element_size)
    loopback = measure_loopback_gbps(num_bytes, args.repeats)
    ceiling = measure_grpc_ceiling_gbps(num_bytes, args.max_chunk_bytes, args.repeats)
    steps = breakdown_s(args.dtype, largest, args.max_chunk_bytes)

    print(f"\nKV pull, {args.dtype}, chunks of {args.max_chunk_bytes / 2**20:.0f} MiB, median of {args.repeats}")
    print(f"{'prompt':>12} {'bytes':>10} {'seconds':>9} {'GB/s':>7}")
    for num_tokens, s in pulls_s.items():
        n = Size(num_tokens).num_bytes(element_size)
        print(f"{num_tokens:>6} tokens {n / 1e6:>8.1f}MB {s:>9.4f} {n / s / 1e9:>7.2f}")
    pull_gbps = num_bytes / pulls_s[largest] / 1e9
    print(f"loopback TCP, one stream, {num_bytes / 1e6:.0f} MB: {loopback:.2f} GB/s")
    print(f"gRPC ceiling (raw bytes stream, same chunks): {ceiling:.2f} GB/s")
    print(f"\nwhere the {largest}-token pull's {pulls_s[largest] * 1e3:.0f} ms go (each copy timed alone):")
    for name, seconds in steps.items():
        print(f"  {name:44} {seconds * 1e3:8.1f} ms ({num_bytes / seconds / 1e9:5.2f} GB/s)")
    print(f"  {'gRPC moving the same bytes (ceiling above)':44} {num_bytes / ceiling / 1e6:8.1f} ms")
    print("  (the two copies run in two processes while gRPC streams: the pull is a pipeline of the three)")

    gap_ratio = "n/a"
    if args.engines:
        tandem_gaps, vllm_gaps = second_token_gaps(args.num_requests)
        gap_p50, itl_p50 = statistics.median(tandem_gaps), statistics.median(vllm_gaps)
        print(
            f"\nsecond-token gap p50 (Tandem, ~2k tokens): {gap_p50 * 1e3:.0f} ms; "
            f"plain vLLM ITL p50: {itl_p50 * 1e3:.0f} ms"
        )
        gap_ratio = f"{gap_p50 / itl_p50:.2f}"
    print(
        f"bench-kv: pull_gbps={pull_gbps:.2f} loopback_gbps={loopback:.2f} ratio={pull_gbps / loopback:.2f} "
        f"grpc_ceiling_gbps={ceiling:.2f} second_token_gap_ratio={gap_ratio}"
    )


if __name__ == "__main__":
    main()
