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
  count in messages of the pull's size (``wire.pull_chunk_bytes``: smaller than
  ``max_chunk_bytes`` for a small pull), raw bytes (no protobuf), the client
  copying each message into a preallocated buffer;
* where the pull's time goes: its two copies (the prefill side writing cache
  blocks out as wire bytes, the decode side copying wire bytes into its cache),
  each timed alone, beside what gRPC alone needs for the same bytes;
* under concurrent load: four ~1k-token pulls from one prefill side at once,
  against four loopback streams and four bare gRPC streams (over one channel,
  as the puller keeps one per prefill worker) at once; the same four pulls
  through shared memory; and the CPU both processes of each way spent per GB
  moved (read from /proc), which bounds the ratios once every core is busy.

Part 2, engines (``--engines``; real vLLM, real model): the gap between the first
token (from prefill) and the second (from decode) for a ~2k-token prompt through
the Tandem stack, next to plain vLLM's inter-token latency for the same prompt,
and where the gap goes (the KV load, the rest of decode up to its first token,
and the gateway around them), from each request's own stage timings. The stack
runs as shipped (the decode worker prefetches each prompt's KV while its prefill
runs, ``PrefetchKV``, so its load is a wait for the stream's tail and a local
copy), and a second gateway in front of the same workers runs with
``TANDEM_GATEWAY_KV_PREFETCH=false`` (the decode worker pulls after the prefill);
requests alternate between the two (and plain vLLM), so the prefetch's effect is
measured side by side, and the breakdown says how many loads came from a prefetch.
``second_token_gap_ratio`` is the default's (the prefetch), ``…_without_prefetch``
the pull's.

The floor of that gap is one forward step of the decode engine: where the request's parameters
allow it (no stop string, grammar, presence/frequency penalty or seeded random sampling; this
benchmark's requests), decode takes the first token as its last prompt token
(:mod:`tandem.worker.continuation`) and its first step samples the second token. Where the rest
went on 2026-12-04 (timestamps inside the decode worker's processes, ~2.6k-token prompts, plain
ITL ~115 ms): the prefetched load's wait for the stream's tail 0-217 ms and its copy from staging
~35 ms; the load reported to vLLM's scheduler 1-131 ms after it ended (the engine's main thread
starved on two shared cores); the step itself 100-130 ms; its token reaching the Decode stream
10-180 ms later (the API process's loop); 35-40 ms from the prefill's last step to the Decode RPC.
On 2026-12-05 (plain ITL p50 74 ms, ``--num-requests 12``) the prefetched gap's p50 was 214 ms: the
load 67 ms (39 waiting for the stream's tail, 29 the copy from staging, now split in the printout),
the rest of decode 140 ms (one forward step is ~74), the gateway 7 ms. ``--kv-thread-cpus all``
(the KV threads moved off the engines' pinned cores, :mod:`tandem.worker.kv_connector.cpus`) made
it 299 ms in the next run, so the workers keep the pin by default. On 2026-12-06 (plain ITL p50 71 ms,
``--num-requests 8``, every load from a prefetch) the gap's p50 was 123 ms (ratio 1.74): the load 24.5 ms,
all of it the copy from staging (the stream had ended before the load began), the rest of decode 95.5 ms,
the gateway 3 ms; without the prefetch 194 ms (2.73), the pull 101 ms of it.

What the transport part showed on 2026-12-06, beyond its table: the pull's extra copy (the prefill side
writing its cache out as messages) is what keeps it under the bare gRPC stream, since both processes'
cores are busy throughout. Overlapping that copy with the sending (reading the next message on another
thread; the copies release the GIL) gained nothing when alternated against the inline read in one run
(~1k tokens: 28.2 against 27.6 ms p50), nor did two or four channels to the prefill side for four
concurrent pulls (108.6, 108.6 and 111.1 ms), so neither is in the code.

Why the concurrent gRPC round stays near a third of four loopback streams (2026-12-07, load 5.6 on the
shared 2-core host; concurrent_ratio 0.36): per GB moved at once, the gRPC pulls cost 719 ms of CPU in their
two processes, four bare gRPC streams 674, loopback TCP 213, shared memory 208 (at load 8-14: 741, 665,
228, 154). grpcio copies each message into and out of its own buffers on both sides, beyond the kernel's
two copies, so with both cores busy the pulls reach about loopback's CPU over theirs; they lose nothing to
gRPC itself at once (1.05 of the four bare gRPC streams in that run). Alternated in one process, a
connection of its own per pull (a local subchannel pool) took 210 ms against one channel's 182 for four
~1k-token pulls, and 16 MiB HTTP/2 frames with 1-8 MiB TCP read chunks 190 against 200 ms (CPU 1000 against
932 ms/GB): neither is in the code. The same four pulls through shared memory ran at 1.19 of loopback
(``concurrent_shm_ratio``; 1.97 at load 8-14).

Each size is also pulled through shared memory (a second decode side of the same host and shared
directory: ``tandem.worker.kv_connector.shm_transport``), beside a plain memcpy of the same bytes
in this process, in the same rounds. In the largest size's rounds each decode side also prefetches a
held prompt of that size and loads it (``PrefetchKV`` to the load's end: the stream into staging,
then the load's copy from staging into the paged cache), the first over gRPC (``StreamBlockBytes``),
the second through shared memory (``StreamBlocksShm``, the segment kept as the staging:
``tandem.worker.kv_connector.shm_stream``): ``prefetch_grpc_gbps`` and ``prefetch_shm_gbps``.

Ends with ``bench-kv: pull_gbps=… loopback_gbps=… ratio=… grpc_ceiling_gbps=…
min_ratio_vs_grpc=… concurrent_ratio=… shm_gbps=… memcpy_gbps=… shm_ratio=… concurrent_shm_ratio=…
prefetch_shm_gbps=… prefetch_grpc_gbps=… second_token_gap_ratio=… second_token_gap_ratio_without_prefetch=…``
(ratio: pull ÷
loopback at ~4k tokens; concurrent_ratio: the same for the concurrent round; concurrent_shm_ratio: the
concurrent round's shared-memory pulls ÷ the same loopback streams; the gap ratio is ``n/a`` without
``--engines``). Nothing is simulated; the transport part does not run an engine's forward pass beside
the KV server, so the GIL contention of a live engine is not in its figures (part 2 has it).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import socket
import statistics
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

NUM_LAYERS = 30
BLOCK_TOKENS = 128
#: One block of one layer in vLLM's CPU attention layout (K and V, KV heads, tokens, head size).
BLOCK_SHAPE = (2, 3, BLOCK_TOKENS, 64)
NUM_CACHE_BLOCKS = 40
#: Prompt sizes in tokens: one block, ~1k, ~4k.
SIZES_TOKENS = (BLOCK_TOKENS, 1024, 4096)
#: Under concurrent load: this many ~1k-token pulls from one prefill worker at once (as a decode
#: engine admitting a burst of long prompts), against as many loopback and bare gRPC streams at once.
CONCURRENT_STREAMS = 4
CONCURRENT_TOKENS = 1024
SEED = 1234
#: Every held prompt of the benchmark's KV server is read with this capability (tandem.common.kv_capability).
CAPABILITY = "0123456789abcdef" * 2
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
        f"model.layers.{i}.self_attn.attn": torch.randn(shape, generator=generator).to(dtype) for i in range(NUM_LAYERS)
    }


def _side(port: int, max_chunk_bytes: int, shm_dir: str = "") -> Any:
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
        lease_s=600,
        shm_dir=shm_dir,
        # One ~4k-token prompt staged at a time (the prefetch rounds): ~190 MB in float32.
        prefetch_max_bytes=256 << 20,
    )


# --- part 1: processes --------------------------------------------------------------------------------------


def _prefill_server(
    conn: Connection, port: int, dtype_name: str, max_chunk_bytes: int, holds: list[str], shm_dir: str
) -> None:
    """The prefill side: a KV server over seeded random caches, holding blocks 0.. for each request id in
    ``holds`` (as vLLM's requests ``<id>-abcdefgh``), serving them over gRPC and through shared memory in
    ``shm_dir``."""
    from tandem.worker.kv_connector.metadata import GrpcKVMetadata, HoldSpec

    side = _side(port, max_chunk_bytes, shm_dir)
    side.register_kv_caches(_caches(dtype_name, SEED))
    blocks = tuple(range(Size(max(SIZES_TOKENS)).num_blocks))
    expiry = time.time() + 3600
    side.begin_step(
        GrpcKVMetadata(holds={f"{rid}-abcdefgh": HoldSpec(rid, blocks, expiry, CAPABILITY) for rid in holds})
    )
    conn.send("ready")
    conn.recv()
    side.shutdown()


def _tcp_server(conn: Connection, largest_bytes: int) -> None:
    """Sends the byte count each connection asks for (8 bytes, little-endian), from one buffer; each
    connection on a thread of its own, so that concurrent streams run at once (0 bytes: stop)."""
    import threading

    from tandem.worker.kv_connector import heap

    heap.keep_message_buffers(4 << 20)  # as the pull's processes: the same allocator for all three
    payload = memoryview(bytes(largest_bytes))

    def send(peer: socket.socket, wanted: int) -> None:
        with peer:
            peer.sendall(payload[:wanted])

    with socket.create_server(("127.0.0.1", 0), backlog=64) as server:
        conn.send(server.getsockname()[1])
        while True:
            peer, _ = server.accept()
            wanted = int.from_bytes(peer.recv(8), "little")
            if wanted == 0:
                peer.close()
                return
            threading.Thread(target=send, args=(peer, wanted), daemon=True).start()


def _grpc_server(conn: Connection, max_chunk_bytes: int) -> None:
    """Streams the byte count each call asks for in messages of the size it asks for (two 8-byte
    little-endian integers), all cut from one buffer."""
    from concurrent import futures

    import grpc

    from tandem.worker.kv_connector import heap

    heap.keep_message_buffers(max_chunk_bytes)  # as the pull's processes: the same allocator for all three
    chunk = bytes(max_chunk_bytes)

    def stream(request: bytes, context: Any) -> Iterator[bytes]:
        remaining = int.from_bytes(request[:8], "little")
        message = chunk[: int.from_bytes(request[8:16], "little")]
        while remaining > 0:
            piece = message if remaining >= len(message) else message[:remaining]
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Transport:
    """Seconds per transfer of one prompt's KV bytes, one list per way of moving them."""

    pull: list[float] = field(default_factory=list)
    loopback: list[float] = field(default_factory=list)
    grpc: list[float] = field(default_factory=list)
    #: The pull through shared memory (a decode side of the same host and directory), and a plain
    #: memcpy of the same bytes between two buffers of this process.
    shm: list[float] = field(default_factory=list)
    memcpy: list[float] = field(default_factory=list)
    #: The largest size only: a PrefetchKV of the held prompt to its load's end (the stream into staging,
    #: then the load's copy from staging into the paged cache), over gRPC and through shared memory, and of
    #: each, the load's copy from staging alone.
    prefetch_grpc: list[float] = field(default_factory=list)
    prefetch_shm: list[float] = field(default_factory=list)
    prefetch_copy_grpc: list[float] = field(default_factory=list)
    prefetch_copy_shm: list[float] = field(default_factory=list)
    #: Under concurrent load: CPU seconds both processes of each way spent per round (empty where the
    #: host has no /proc to read the other process's from).
    cpu: dict[str, list[float]] = field(default_factory=dict)

    def gbps(self, num_bytes: int, way: str) -> float:
        times: list[float] = getattr(self, way)
        return num_bytes / statistics.median(times) / 1e9


def _cpu_s(pid: int) -> float | None:
    """CPU seconds (user and system) process ``pid`` has used so far, from /proc (None without it)."""
    import os

    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _with_cpu(transport: Transport, way: str, server_pid: int, timed: Callable[[], float]) -> float:
    """``timed()``'s seconds; the CPU this process and process ``server_pid`` spent meanwhile goes into
    ``transport.cpu[way]``."""
    client_before, server_before = time.process_time(), _cpu_s(server_pid)
    seconds = timed()
    server_after = _cpu_s(server_pid)
    if server_before is not None and server_after is not None:
        spent = time.process_time() - client_before + server_after - server_before
        transport.cpu.setdefault(way, []).append(spent)
    return seconds


def _concurrently(num_streams: int, one: Callable[[int], object]) -> float:
    """Seconds from the start of ``num_streams`` calls ``one(i)`` on threads of their own to the end of
    the last one."""
    with ThreadPoolExecutor(max_workers=num_streams) as pool:
        started = time.perf_counter()
        for future in [pool.submit(one, i) for i in range(num_streams)]:
            future.result()
        return time.perf_counter() - started


def _buffer_sizes(largest_bytes: int, concurrent_bytes: int) -> list[int]:
    """One buffer for the largest transfer (stream 0 of a concurrent round uses it too), one more
    per further concurrent stream."""
    return [largest_bytes] + [concurrent_bytes] * (CONCURRENT_STREAMS - 1)


class _Baseline:
    """A way of moving the same bytes as the pull, timed one stream at a time or several at once
    (:meth:`_receive` moves one stream into buffer ``buffer_index``)."""

    _proc: Any

    @property
    def pid(self) -> int:
        """The serving process's."""
        return int(self._proc.pid)

    def _receive(self, num_bytes: int, buffer_index: int) -> None:
        raise NotImplementedError

    def seconds(self, num_bytes: int) -> float:
        started = time.perf_counter()
        self._receive(num_bytes, 0)
        return time.perf_counter() - started

    def concurrent_seconds(self, num_bytes: int, num_streams: int) -> float:
        """``num_streams`` streams of ``num_bytes`` each at once, a buffer each."""
        return _concurrently(num_streams, lambda i: self._receive(num_bytes, i))


class _Loopback(_Baseline):
    """One-stream TCP copies; concurrent streams each on a connection of its own."""

    def __init__(self, largest_bytes: int, concurrent_bytes: int) -> None:
        self._proc, conn = _start(_tcp_server, largest_bytes)
        self._port = conn.recv()
        self._bufs = [memoryview(bytearray(n)) for n in _buffer_sizes(largest_bytes, concurrent_bytes)]

    def _receive(self, num_bytes: int, buffer_index: int) -> None:
        buf = self._bufs[buffer_index]
        with socket.create_connection(("127.0.0.1", self._port)) as sock:
            sock.sendall(num_bytes.to_bytes(8, "little"))
            got = 0
            while got < num_bytes:
                n = sock.recv_into(buf[got:num_bytes])
                if n == 0:
                    raise RuntimeError("loopback server closed early")
                got += n

    def close(self) -> None:
        with socket.create_connection(("127.0.0.1", self._port)) as sock:
            sock.sendall((0).to_bytes(8, "little"))
        self._proc.join(timeout=10)


class _GrpcCeiling(_Baseline):
    """A bare raw-bytes gRPC stream in messages of the size the pull of the same bytes uses (see
    :func:`_message_bytes`); concurrent streams over the one channel (as the puller's pulls from one
    prefill worker)."""

    def __init__(self, largest_bytes: int, max_chunk_bytes: int, block_bytes: int, concurrent_bytes: int) -> None:
        import grpc

        self._max_chunk_bytes, self._block_bytes = max_chunk_bytes, block_bytes
        self._proc, self._conn = _start(_grpc_server, max_chunk_bytes)
        port = self._conn.recv()
        # One channel, as the puller keeps one to each prefill worker, with the puller's options (a stream
        # read on the thread that iterates it: faster for small pulls, so the ceiling has it too).
        from tandem.worker.kv_connector.puller import CLIENT_OPTIONS

        self._channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=CLIENT_OPTIONS)
        self._call = self._channel.unary_stream(
            GRPC_METHOD, request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        self._bufs = [bytearray(n) for n in _buffer_sizes(largest_bytes, concurrent_bytes)]
        list(self._call((1).to_bytes(8, "little") + (1).to_bytes(8, "little")))  # connect

    def _receive(self, num_bytes: int, buffer_index: int) -> None:
        buf = self._bufs[buffer_index]
        offset = 0
        message_bytes = _message_bytes(num_bytes, self._max_chunk_bytes, self._block_bytes)
        for message in self._call(num_bytes.to_bytes(8, "little") + message_bytes.to_bytes(8, "little")):
            buf[offset : offset + len(message)] = message
            offset += len(message)
        assert offset == num_bytes

    def close(self) -> None:
        self._channel.close()
        self._conn.send("stop")
        self._proc.join(timeout=10)


class _Memcpy:
    """A plain copy of ``n`` bytes between two buffers of this process, their pages touched first."""

    def __init__(self, largest_bytes: int) -> None:
        import numpy as np

        self._src = np.ones(largest_bytes, dtype=np.uint8)
        self._dst = np.zeros(largest_bytes, dtype=np.uint8)

    def seconds(self, num_bytes: int) -> float:
        started = time.perf_counter()
        self._dst[:num_bytes] = self._src[:num_bytes]
        return time.perf_counter() - started


def _shm_dir() -> str:
    """A directory of its own in the host's shared memory (/dev/shm where there is one)."""
    import os
    import tempfile

    return tempfile.mkdtemp(prefix="tandem-bench-kv-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)


def timed_rounds(num_tokens: int, repeats: int) -> int:
    """Timed rounds of a prompt size: ``repeats`` for the largest, up to four times as many for the
    smaller ones (a 1-block round takes milliseconds, and its median wanders most on a shared machine)."""
    return repeats * min(4, max(1, max(SIZES_TOKENS) // num_tokens))


def _message_bytes(num_bytes: int, max_chunk_bytes: int, block_bytes: int) -> int:
    """The size of all but the last message of a pull of ``num_bytes`` (whole blocks of ``block_bytes``):
    what the puller asks for (:func:`wire.pull_chunk_bytes`), rounded down to whole blocks as the
    chunk plan does."""
    from tandem.worker.kv_connector import wire

    return wire.blocks_per_chunk(block_bytes, wire.pull_chunk_bytes(num_bytes, max_chunk_bytes)) * block_bytes


def _pull_checked(decode: Any, specs: list[Any], *, via_shm: bool) -> float:
    """Seconds for ``specs`` pulled at once, a thread each; raises unless every one loaded, and (``via_shm``)
    every one through shared memory, none falling back to gRPC."""
    records: list[Any] = [None] * len(specs)
    shm_loads = decode.stats().shm_loads_total

    def pull(i: int) -> None:
        records[i] = decode.load(specs[i])

    seconds = _concurrently(len(specs), pull)
    failed = [r.error for r in records if r.failed]
    if failed:
        raise RuntimeError(f"concurrent pulls failed: {failed}")
    if via_shm and decode.stats().shm_loads_total != shm_loads + len(specs):
        raise RuntimeError(f"of {len(specs)} concurrent shared-memory pulls, some went over gRPC")
    return seconds


def _prefetched_load(decode: Any, port: int, rid: str, remote: tuple[int, ...], local: tuple[int, ...]) -> Any:
    """(seconds from a PrefetchKV of held prompt ``rid`` to its load's end, the load's record); raises unless
    the load came from the prefetch."""
    from tandem.worker.kv_connector.metadata import LoadSpec
    from tandem.worker.kv_connector.params import KVHandleParams, PrefetchOrder

    address = f"127.0.0.1:{port}"
    num_tokens = len(remote) * BLOCK_TOKENS
    handle = KVHandleParams("prefill", address, rid, remote, num_tokens, time.time() + 600, CAPABILITY)
    started = time.perf_counter()
    refused = decode.prefetch(PrefetchOrder(rid, address, num_tokens, 0, CAPABILITY, ""))
    if refused:
        raise RuntimeError(f"prefetch of {rid} refused: {refused}")
    record = decode.load(LoadSpec(f"{rid}-0123abcf", handle, remote, local, num_tokens, 0))
    seconds = time.perf_counter() - started
    decode.puller.release_hold(handle)
    if record.failed or not record.prefetched:
        raise RuntimeError(f"prefetched load of {rid}: {record.error or 'not from the prefetch'}")
    return seconds, record


def measure_transport(
    dtype_name: str, max_chunk_bytes: int, repeats: int, warmup: int
) -> tuple[dict[int, Transport], Transport]:
    """For each prompt size, :func:`timed_rounds` rounds of (pull, loopback TCP, gRPC ceiling) of its
    KV bytes, the three ways interleaved so that the machine's noise falls on all of them alike.
    A pull's time is the decode side's own record of its load (call, stream, copies into the
    cache; not the Release sent after it).
    Then ``repeats`` rounds under concurrent load: ``CONCURRENT_STREAMS`` ~1k-token pulls at once
    into distinct cache blocks (seconds from the first start to the last end), against as many
    loopback and gRPC streams at once.
    Each size (and the concurrent round) starts with ``warmup`` untimed rounds of all three ways: the
    first transfers after a process starts, or after a size change, run on heaps and sockets not yet
    grown to the messages (on 2026-12-06 the first five 1-block rounds took up to 5x the steady ones'
    time for the pull, up to 7x for gRPC); a serving worker is past them after its first requests. The first pull
    of each size (and the first concurrent round) lands in a zeroed cache and must then equal the
    prefill cache's blocks byte for byte."""
    import torch

    from tandem.worker.kv_connector.metadata import LoadSpec
    from tandem.worker.kv_connector.params import KVHandleParams

    element_size = torch.empty((), dtype=getattr(torch, dtype_name)).element_size()
    largest = Size(max(SIZES_TOKENS)).num_bytes(element_size)
    concurrent_bytes = Size(CONCURRENT_TOKENS).num_bytes(element_size)
    port = _free_port()
    warmup = max(1, warmup)
    request_ids = [f"bench-{n}-{i}" for n in SIZES_TOKENS for i in range(warmup + timed_rounds(n, repeats))]
    request_ids += [f"bench-c{j}-{i}" for j in range(CONCURRENT_STREAMS) for i in range(warmup + repeats)]
    request_ids += [f"bench-pf-{i}" for i in range(warmup + timed_rounds(max(SIZES_TOKENS), repeats))]
    request_ids += [f"{rid}-shm" for rid in request_ids]
    shm_dir = _shm_dir()
    proc, conn = _start(_prefill_server, port, dtype_name, max_chunk_bytes, request_ids, shm_dir)
    memcpy = _Memcpy(largest)
    loopback = _Loopback(largest, concurrent_bytes)
    block_bytes = Size(BLOCK_TOKENS).num_bytes(element_size) // NUM_LAYERS
    ceiling = _GrpcCeiling(largest, max_chunk_bytes, block_bytes, concurrent_bytes)
    assert conn.recv() == "ready"
    expected = _caches(dtype_name, SEED)
    decode = _side(_free_port(), max_chunk_bytes)
    caches = _caches(dtype_name, None)
    decode.register_kv_caches(caches)
    shm_decode = _side(_free_port(), max_chunk_bytes, shm_dir)
    shm_caches = _caches(dtype_name, None)
    shm_decode.register_kv_caches(shm_caches)
    results: dict[int, Transport] = {}
    try:
        for num_tokens in SIZES_TOKENS:
            size = Size(num_tokens)
            num_bytes = size.num_bytes(element_size)
            remote = tuple(range(size.num_blocks))
            # Land the blocks elsewhere than they came from, in reverse order: the ids really map.
            local = tuple(NUM_CACHE_BLOCKS - 1 - b for b in remote)
            transport = results[num_tokens] = Transport()
            rounds = warmup + timed_rounds(num_tokens, repeats)
            for i in range(rounds):
                rid = f"bench-{num_tokens}-{i}"
                handle = KVHandleParams(
                    "prefill", f"127.0.0.1:{port}", rid, remote, num_tokens, time.time() + 600, CAPABILITY
                )
                record = decode.load(LoadSpec(f"{rid}-0123abcd", handle, remote, local, num_tokens, 0))
                decode.puller.release_hold(handle)
                if record.failed:
                    raise RuntimeError(f"pull of {num_tokens} tokens failed: {record.error}")
                if i == 0:
                    _check_pulled(expected, caches, remote, local)
                shm_handle = replace(handle, request_id=f"{rid}-shm")
                loads_before = shm_decode.stats().shm_loads_total
                shm_record = shm_decode.load(LoadSpec(f"{rid}-0123abce", shm_handle, remote, local, num_tokens, 0))
                shm_decode.puller.release_hold(shm_handle)
                if shm_record.failed or shm_decode.stats().shm_loads_total != loads_before + 1:
                    raise RuntimeError(f"shared-memory pull of {num_tokens} tokens: {shm_record.error or 'over gRPC'}")
                if i == 0:
                    _check_pulled(expected, shm_caches, remote, local)
                tcp_s, grpc_s = loopback.seconds(num_bytes), ceiling.seconds(num_bytes)
                memcpy_s = memcpy.seconds(num_bytes)
                if num_tokens == max(SIZES_TOKENS):
                    # The prefetch's two paths, side by side: over gRPC, and through shared memory.
                    pf_s, pf_record = _prefetched_load(decode, port, f"bench-pf-{i}", remote, local)
                    prefetches_before = shm_decode.stats().shm_prefetches_total
                    pf_shm_s, pf_shm_record = _prefetched_load(shm_decode, port, f"bench-pf-{i}-shm", remote, local)
                    if shm_decode.stats().shm_prefetches_total != prefetches_before + 1:
                        raise RuntimeError("the prefetch of the shared-memory decode side went over gRPC")
                    if i == 0:
                        _check_pulled(expected, caches, remote, local)
                        _check_pulled(expected, shm_caches, remote, local)
                    if i >= warmup:
                        transport.prefetch_grpc.append(pf_s)
                        transport.prefetch_shm.append(pf_shm_s)
                        transport.prefetch_copy_grpc.append(pf_record.seconds - pf_record.prefetch_wait_s)
                        transport.prefetch_copy_shm.append(pf_shm_record.seconds - pf_shm_record.prefetch_wait_s)
                if i >= warmup:
                    transport.pull.append(record.seconds)
                    transport.loopback.append(tcp_s)
                    transport.grpc.append(grpc_s)
                    transport.shm.append(shm_record.seconds)
                    transport.memcpy.append(memcpy_s)
        concurrent = Transport()
        size = Size(CONCURRENT_TOKENS)
        remote = tuple(range(size.num_blocks))
        # Each stream lands in blocks of its own, from the end of the cache down.
        locals_ = [
            tuple(NUM_CACHE_BLOCKS - 1 - j * size.num_blocks - b for b in remote) for j in range(CONCURRENT_STREAMS)
        ]
        for i in range(warmup + repeats):
            timed = concurrent if i >= warmup else Transport()
            handles = [
                KVHandleParams(
                    "prefill",
                    f"127.0.0.1:{port}",
                    f"bench-c{j}-{i}",
                    remote,
                    size.num_tokens,
                    time.time() + 600,
                    CAPABILITY,
                )
                for j in range(CONCURRENT_STREAMS)
            ]
            specs = [
                LoadSpec(f"{h.request_id}-0123abcd", h, remote, local, size.num_tokens, 0)
                for h, local in zip(handles, locals_, strict=True)
            ]
            pull_s = _with_cpu(timed, "pull", proc.pid, partial(_pull_checked, decode, specs, via_shm=False))
            for handle in handles:
                decode.puller.release_hold(handle)
            if i == 0:
                _check_pulled(expected, caches, remote * CONCURRENT_STREAMS, sum(locals_, ()))
            # The same through shared memory: a segment each (the pool's default, as many as the pulls).
            shm_specs = [
                replace(
                    s,
                    engine_request_id=f"{s.handle.request_id}-shm",
                    handle=replace(s.handle, request_id=f"{s.handle.request_id}-shm"),
                )
                for s in specs
            ]
            shm_s = _with_cpu(timed, "shm", proc.pid, partial(_pull_checked, shm_decode, shm_specs, via_shm=True))
            for spec in shm_specs:
                shm_decode.puller.release_hold(spec.handle)
            if i == 0:
                _check_pulled(expected, shm_caches, remote * CONCURRENT_STREAMS, sum(locals_, ()))
            tcp_s = _with_cpu(
                timed,
                "loopback",
                loopback.pid,
                lambda: loopback.concurrent_seconds(concurrent_bytes, CONCURRENT_STREAMS),
            )
            grpc_s = _with_cpu(
                timed, "grpc", ceiling.pid, lambda: ceiling.concurrent_seconds(concurrent_bytes, CONCURRENT_STREAMS)
            )
            timed.pull.append(pull_s)
            timed.shm.append(shm_s)
            timed.loopback.append(tcp_s)
            timed.grpc.append(grpc_s)
    finally:
        conn.send("stop")
        proc.join(timeout=10)
        loopback.close()
        ceiling.close()
        decode.shutdown()
        shm_decode.shutdown()
        shutil.rmtree(shm_dir, ignore_errors=True)
    return results, concurrent


def _check_pulled(
    expected: dict[str, Any], caches: dict[str, Any], remote: tuple[int, ...], local: tuple[int, ...]
) -> None:
    import torch

    index_remote, index_local = torch.tensor(remote), torch.tensor(local)
    for name, tensor in caches.items():
        want = expected[name].index_select(1, index_remote)
        if not torch.equal(tensor.index_select(1, index_local).view(torch.uint8), want.view(torch.uint8)):
            raise AssertionError(f"pulled KV differs from the prefill side's in {name}")
        tensor.view(torch.uint8).numpy().fill(0)  # the next size's check must not pass on this size's bytes


def breakdown_s(dtype_name: str, num_tokens: int, max_chunk_bytes: int) -> dict[str, float]:
    """The pull's two copies for one prompt, each timed alone in this process (no network): the
    prefill side writing blocks out of its cache as wire messages (each dropped once made, as
    gRPC does once it has sent it), the decode side copying wire messages into its cache. They
    run in two processes at once, so the pull takes at least the slower of the two plus what
    gRPC adds (the ceiling)."""
    from tandem.worker.kv_connector import wire

    side = _side(_free_port(), max_chunk_bytes)
    caches = _caches(dtype_name, SEED)
    side.register_kv_caches(caches)
    assert side.layout is not None
    try:
        blocks = list(range(Size(num_tokens).num_blocks))
        element_size = next(iter(caches.values())).element_size()
        chunk_bytes = wire.pull_chunk_bytes(Size(num_tokens).num_bytes(element_size), max_chunk_bytes)
        chunks = list(side.server.read_chunks(blocks, chunk_bytes))
        started = time.perf_counter()
        for _ in side.server.read_chunks(blocks, chunk_bytes):
            pass
        read_s = time.perf_counter() - started
        started = time.perf_counter()
        wire.write_chunks(list(caches.values()), side.layout.block_dim, blocks, chunk_bytes, chunks)
        write_s = time.perf_counter() - started
    finally:
        side.shutdown()
    return {"prefill side: cache blocks to wire bytes": read_s, "decode side: wire bytes into the cache": write_s}


# --- part 2: engines ----------------------------------------------------------------------------------------


@dataclass
class GapParts:
    """Where Tandem's first→second token gaps went, per request (seconds), from the gateway's stage
    timings (``X-Tandem-Timings``): the decode worker's own figures of each request."""

    #: The KV load, as the decode engine's connector timed it: a pull after the prefill, or the wait for
    #: the prefetch (streamed while the prefill ran) and the copy from its staging.
    pull: list[float] = field(default_factory=list)
    #: Whether each load came from a prefetch.
    prefetched: list[bool] = field(default_factory=list)
    #: Of ``pull``, for a load from a prefetch: waiting for the prefetch's stream to end.
    prefetch_wait: list[float] = field(default_factory=list)
    #: From the load's end to the engine step that reported it to vLLM's scheduler.
    reported: list[float] = field(default_factory=list)
    #: From the Decode RPC's start in the worker to decode's first new token (the pull included).
    decode_first_token: list[float] = field(default_factory=list)
    #: The decode engine's own timeline of the same span (vLLM's request events): the Decode RPC's start
    #: to the engine queueing the request, queued to the step that scheduled its forward pass (the load
    #: and its report inside), that step's start to the engine sending the first new token.
    engine_queued: list[float] = field(default_factory=list)
    engine_scheduled: list[float] = field(default_factory=list)
    engine_first_token: list[float] = field(default_factory=list)


@dataclass
class Gaps:
    """First→second token gaps of ~2k-token prompts, three ways, alternating in one run."""

    #: Tandem as shipped: the decode worker prefetches the prompt's KV while the prefill runs.
    tandem: list[float] = field(default_factory=list)
    #: Tandem through a second gateway with ``TANDEM_GATEWAY_KV_PREFETCH=false``: the pull after the
    #: prefill.
    without_prefetch: list[float] = field(default_factory=list)
    #: Plain vLLM's inter-token gaps for the same prompts.
    vllm: list[float] = field(default_factory=list)
    parts: GapParts = field(default_factory=GapParts)
    parts_without_prefetch: GapParts = field(default_factory=GapParts)


def _document(word: str, i: int) -> str:
    """A ~2.3k-token prompt of its own for each (word, i)."""
    return " ".join(f"{word} {i}-{j}: the number {j * 7 + i} is interesting." for j in range(150))


def _record_parts(parts: GapParts, timings: dict[str, Any]) -> None:
    worker = timings.get("worker", {})
    parts.pull.append(worker.get("kv_transfer_ms", 0.0) / 1e3)
    parts.decode_first_token.append(worker.get("decode_first_token_ms", 0.0) / 1e3)
    parts.prefetched.append(bool(worker.get("kv_prefetched")))
    parts.prefetch_wait.append(worker.get("kv_prefetch_wait_ms", 0.0) / 1e3)
    parts.reported.append(worker.get("kv_reported_after_ms", 0.0) / 1e3)
    parts.engine_queued.append(worker.get("decode_engine_queued_after_ms", 0.0) / 1e3)
    parts.engine_scheduled.append(worker.get("decode_engine_scheduled_after_ms", 0.0) / 1e3)
    parts.engine_first_token.append(worker.get("decode_engine_first_token_after_ms", 0.0) / 1e3)


def second_token_gaps(num_requests: int, kv_thread_cpus: str | None = None) -> Gaps:
    """First→second token gaps for ~2k-token prompts through Tandem with and without the prefetch (two
    gateways in front of the same workers) and plain vLLM's inter-token gaps, one request at a time,
    the three in turn."""
    import uuid
    from pathlib import Path

    from request_path import stream_once  # type: ignore[import-not-found]

    from tandem.local.plain_vllm import start_plain_vllm, stop_plain_vllm
    from tandem.local.stack import LocalStack, StackConfig

    run_dir = Path(".run/bench-kv")
    run_dir.mkdir(parents=True, exist_ok=True)
    extra_env = {} if kv_thread_cpus is None else {"TANDEM_WORKER_KV__THREAD_CPUS": kv_thread_cpus}
    config = StackConfig.with_free_ports(
        key_prefix=f"tandem-bench-kv-{uuid.uuid4().hex[:6]}", log_dir=run_dir, extra_env=extra_env
    )
    stack = LocalStack(config, progress=lambda m: print(f"[bench-kv] {m}", flush=True))
    vllm_proc = None
    gaps = Gaps()
    try:
        stack.start()
        pull_url = stack.start_gateway_variant("gateway-pull", _free_port(), {"TANDEM_GATEWAY_KV_PREFETCH": "false"})
        vllm_port = _free_port()
        vllm_proc, _ = start_plain_vllm(config.model_dir, config.served_model_name, vllm_port, run_dir / "vllm.log")
        vllm_url = f"http://127.0.0.1:{vllm_port}"
        model = config.served_model_name
        for url, headers in ((config.gateway_url, stack.auth_headers), (pull_url, stack.auth_headers)):
            stream_once(url, model, "Hello", 4, headers)
        stream_once(vllm_url, model, "Hello", 4, {})
        for i in range(num_requests):
            # Distinct documents, one per arm (the two gateways share the workers and their prefix
            # caches): nothing is prefix-cached, every request moves its whole KV.
            prompt = _document("Fact", i) + " Summarize."
            other = _document("Note", i) + " Summarize."
            arms = [
                (config.gateway_url, prompt, gaps.tandem, gaps.parts),
                (pull_url, other, gaps.without_prefetch, gaps.parts_without_prefetch),
            ]
            for url, text, out, parts in arms if i % 2 == 0 else reversed(arms):
                timings: dict[str, Any] = {}
                _, request_gaps = stream_once(url, model, text, 8, stack.auth_headers, timings_out=timings)
                out.append(request_gaps[0])
                _record_parts(parts, timings)
            _, request_gaps = stream_once(vllm_url, model, prompt + "  ", 8, {})
            gaps.vllm.extend(request_gaps)
            print(f"[bench-kv] {i + 1}/{num_requests}", flush=True)
    finally:
        if vllm_proc is not None:
            stop_plain_vllm(vllm_proc)
        stack.stop()
    return gaps


def _print_breakdown(title: str, gaps: list[float], parts: GapParts) -> None:
    gap_p50 = statistics.median(gaps)
    pull_p50 = statistics.median(parts.pull)
    decode_p50 = statistics.median(parts.decode_first_token)
    print(
        f"{title}: second-token gap p50 {gap_p50 * 1e3:.0f} ms (p50 of each request's own figures; "
        f"{sum(parts.prefetched)} of {len(parts.prefetched)} loads came from a prefetch):"
    )
    print(f"  {'KV load (prefetch wait + copy, or pull)':44} {pull_p50 * 1e3:8.1f} ms")
    if any(parts.prefetched):
        waits = [w for w, p in zip(parts.prefetch_wait, parts.prefetched, strict=True) if p]
        loads = [t for t, p in zip(parts.pull, parts.prefetched, strict=True) if p]
        wait_p50 = statistics.median(waits)
        copy_p50 = statistics.median(t - w for t, w in zip(loads, waits, strict=True))
        print(f"  {'  of which waiting for the stream to end':44} {wait_p50 * 1e3:8.1f} ms")
        print(f"  {'  of which the copy from staging':44} {copy_p50 * 1e3:8.1f} ms")
    reported_p50 = statistics.median(parts.reported)
    print(f"  {'load reported to the scheduler after':44} {reported_p50 * 1e3:8.1f} ms")
    print(f"  {'rest of decode to its first token':44} {(decode_p50 - pull_p50 - reported_p50) * 1e3:8.1f} ms")
    print(f"  {'gateway, RPCs and streaming around them':44} {(gap_p50 - decode_p50) * 1e3:8.1f} ms")
    if all(parts.engine_first_token):
        queued_p50, scheduled_p50, first_token_p50 = (
            statistics.median(p) for p in (parts.engine_queued, parts.engine_scheduled, parts.engine_first_token)
        )
        print("  the decode worker's span on the engine's own clock (vLLM's request events):")
        print(f"  {'  Decode call to the engine queueing it':44} {queued_p50 * 1e3:8.1f} ms")
        print(f"  {'  queued to the step scheduling its forward':44} {scheduled_p50 * 1e3:8.1f} ms")
        print(f"  {'  that step to the engine sending its token':44} {first_token_p50 * 1e3:8.1f} ms")
        rest_p50 = decode_p50 - queued_p50 - scheduled_p50 - first_token_p50
        print(f"  {'  the token from the engine to the worker':44} {rest_p50 * 1e3:8.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--max-chunk-bytes", type=int, default=4 << 20, help="the worker's default")
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed rounds of the largest size (smaller ones: up to 4x as many)"
    )
    parser.add_argument("--warmup", type=int, default=5, help="untimed rounds of each size first (at least 1)")
    parser.add_argument("--engines", action="store_true", help="also measure the second-token gap on engines")
    parser.add_argument("--num-requests", type=int, default=6, help="~2k-token prompts per server (--engines)")
    parser.add_argument(
        "--kv-thread-cpus",
        default=None,
        help="the workers' kv.thread_cpus (--engines): inherit (their default), all, or a CPU list",
    )
    args = parser.parse_args()

    import torch

    element_size = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    results, concurrent = measure_transport(args.dtype, args.max_chunk_bytes, args.repeats, args.warmup)
    largest = max(SIZES_TOKENS)
    steps = breakdown_s(args.dtype, largest, args.max_chunk_bytes)

    print(
        f"\nKV pull, {args.dtype}, messages of at most {args.max_chunk_bytes / 2**20:g} MiB, median of"
        f" {', '.join(str(timed_rounds(n, args.repeats)) for n in SIZES_TOKENS)} rounds by size (concurrent:"
        f" {args.repeats}), each after {max(1, args.warmup)} untimed"
    )
    print(
        "  loopback: one TCP stream between two processes; gRPC: a bare two-process raw-bytes stream in"
        " messages of the pull's size (msg)"
    )
    header = ("prompt", "bytes", "msg", "pull ms", "GB/s", "loopback", "gRPC", "÷loopback", "÷gRPC")
    widths = (12, 9, 7, 8, 6, 9, 6, 10, 6)
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, widths, strict=True)))
    block_bytes = Size(BLOCK_TOKENS).num_bytes(element_size) // NUM_LAYERS
    ratios: dict[int, tuple[float, float]] = {}
    for num_tokens, transport in results.items():
        n = Size(num_tokens).num_bytes(element_size)
        message_mb = _message_bytes(n, args.max_chunk_bytes, block_bytes) / 1e6
        pull, tcp, grpc_ = (transport.gbps(n, way) for way in ("pull", "loopback", "grpc"))
        ratios[num_tokens] = (pull / tcp, pull / grpc_)
        print(
            f"{num_tokens:>6} tokens {n / 1e6:>7.1f}MB {message_mb:>5.2f}MB"
            f" {statistics.median(transport.pull) * 1e3:>8.1f} {pull:>6.2f}"
            f" {tcp:>9.2f} {grpc_:>6.2f} {pull / tcp:>10.2f} {pull / grpc_:>6.2f}"
        )
    n = CONCURRENT_STREAMS * Size(CONCURRENT_TOKENS).num_bytes(element_size)
    message_mb = _message_bytes(n // CONCURRENT_STREAMS, args.max_chunk_bytes, block_bytes) / 1e6
    pull, tcp, grpc_ = (concurrent.gbps(n, way) for way in ("pull", "loopback", "grpc"))
    concurrent_ratio = pull / tcp
    print(
        f"{CONCURRENT_STREAMS} x {CONCURRENT_TOKENS} at once {n / 1e6:>5.1f}MB {message_mb:>5.2f}MB"
        f" {statistics.median(concurrent.pull) * 1e3:>8.1f} {pull:>6.2f} {tcp:>9.2f} {grpc_:>6.2f}"
        f" {concurrent_ratio:>10.2f} {pull / grpc_:>6.2f}"
    )
    print(
        f"  (concurrent: {CONCURRENT_STREAMS} pulls into distinct blocks, {CONCURRENT_STREAMS} loopback streams,"
        f" {CONCURRENT_STREAMS} gRPC streams over one channel; GB/s of all bytes over the round's wall time)"
    )
    shm_concurrent = concurrent.gbps(n, "shm")
    concurrent_shm_ratio = shm_concurrent / tcp
    print(
        f"  the same {CONCURRENT_STREAMS} pulls at once through shared memory:"
        f" {statistics.median(concurrent.shm) * 1e3:.1f} ms, {shm_concurrent:.2f} GB/s,"
        f" {concurrent_shm_ratio:.2f} of loopback"
    )
    if concurrent.cpu:
        # With every core busy, the ratio of two ways' throughputs is at most the inverse ratio of their CPU per byte.
        per_gb = {way: sum(cpu) / len(cpu) / n * 1e9 * 1e3 for way, cpu in concurrent.cpu.items()}
        print(
            "  CPU of both processes per GB moved at once: "
            + ", ".join(f"{way} {per_gb[way]:.0f} ms" for way in ("pull", "shm", "loopback", "grpc") if way in per_gb)
        )
    print("\nthrough shared memory (a decode side of the same host and directory) against a plain memcpy")
    shm_header = ("prompt", "bytes", "shm ms", "GB/s", "memcpy", "÷memcpy", "÷gRPC pull")
    print(" ".join(f"{h:>{w}}" for h, w in zip(shm_header, (12, 9, 8, 6, 7, 8, 11), strict=True)))
    for num_tokens, transport in results.items():
        n = Size(num_tokens).num_bytes(element_size)
        shm, copy, pull = (transport.gbps(n, way) for way in ("shm", "memcpy", "pull"))
        print(
            f"{num_tokens:>6} tokens {n / 1e6:>7.1f}MB {statistics.median(transport.shm) * 1e3:>8.1f} {shm:>6.2f}"
            f" {copy:>7.2f} {shm / copy:>8.2f} {shm / pull:>11.2f}"
        )
    num_bytes = Size(largest).num_bytes(element_size)
    largest_result = results[largest]
    print(f"\nprefetch of the {largest}-token prompt (a PrefetchKV of a held prompt to its load's end):")
    for way, label in (("grpc", "over gRPC (StreamBlockBytes)"), ("shm", "through shared memory (StreamBlocksShm)")):
        total_s = statistics.median(getattr(largest_result, f"prefetch_{way}"))
        copy_s = statistics.median(getattr(largest_result, f"prefetch_copy_{way}"))
        print(
            f"  {label:44} {total_s * 1e3:8.1f} ms ({num_bytes / total_s / 1e9:5.2f} GB/s),"
            f" the load's copy from staging {copy_s * 1e3:.1f} ms"
        )
    pull_s = statistics.median(results[largest].pull)
    print(f"\nwhere the {largest}-token pull's {pull_s * 1e3:.0f} ms go (each copy timed alone):")
    for name, seconds in steps.items():
        print(f"  {name:44} {seconds * 1e3:8.1f} ms ({num_bytes / seconds / 1e9:5.2f} GB/s)")
    grpc_s = statistics.median(results[largest].grpc)
    print(f"  {'gRPC moving the same bytes (ceiling)':44} {grpc_s * 1e3:8.1f} ms")
    print("  (the two copies run in two processes while gRPC streams: the pull is a pipeline of the three)")

    gap_ratio = gap_ratio_without_prefetch = "n/a"
    if args.engines:
        gaps = second_token_gaps(args.num_requests, args.kv_thread_cpus)
        itl_p50 = statistics.median(gaps.vllm)
        print(f"\nsecond token of ~2k-token prompts, one request at a time; plain vLLM ITL p50 {itl_p50 * 1e3:.0f} ms")
        _print_breakdown("Tandem as shipped (the prefetch)", gaps.tandem, gaps.parts)
        _print_breakdown(
            "Tandem with TANDEM_GATEWAY_KV_PREFETCH=false (pull after the prefill)",
            gaps.without_prefetch,
            gaps.parts_without_prefetch,
        )
        print(
            "  (the rest of decode: the request reaching the engine, one forward step, its token reaching the"
            " Decode stream)"
        )
        gap_ratio = f"{statistics.median(gaps.tandem) / itl_p50:.2f}"
        gap_ratio_without_prefetch = f"{statistics.median(gaps.without_prefetch) / itl_p50:.2f}"
    shm_gbps, memcpy_gbps = largest_result.gbps(num_bytes, "shm"), largest_result.gbps(num_bytes, "memcpy")
    print(
        f"bench-kv: pull_gbps={largest_result.gbps(num_bytes, 'pull'):.2f}"
        f" loopback_gbps={largest_result.gbps(num_bytes, 'loopback'):.2f}"
        f" ratio={ratios[largest][0]:.2f} grpc_ceiling_gbps={largest_result.gbps(num_bytes, 'grpc'):.2f}"
        f" min_ratio_vs_grpc={min(r[1] for r in ratios.values()):.2f} concurrent_ratio={concurrent_ratio:.2f}"
        f" shm_gbps={shm_gbps:.2f} memcpy_gbps={memcpy_gbps:.2f} shm_ratio={shm_gbps / memcpy_gbps:.2f}"
        f" concurrent_shm_ratio={concurrent_shm_ratio:.2f}"
        f" prefetch_shm_gbps={largest_result.gbps(num_bytes, 'prefetch_shm'):.2f}"
        f" prefetch_grpc_gbps={largest_result.gbps(num_bytes, 'prefetch_grpc'):.2f}"
        f" second_token_gap_ratio={gap_ratio} second_token_gap_ratio_without_prefetch={gap_ratio_without_prefetch}"
    )


if __name__ == "__main__":
    main()
