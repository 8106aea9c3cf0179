"""The SIMULATED workers' prefix cache and KV-event publisher.

:class:`SimulatedPrefixCache` is an LRU set of block hashes (hashed exactly as vLLM does,
:mod:`tandem.common.block_hash`); :class:`SimulatedKVEventPublisher` publishes its BlockStored /
BlockRemoved on a ZMQ PUB socket with a replay ROUTER socket, in vLLM's wire format
(:mod:`tandem.common.kv_events`). No KV exists: a block is its hash.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any

from tandem.common.kv_events import END_SEQ, KVEvent, encode_batch, encode_seq


class SimulatedPrefixCache:
    """An LRU set of block hashes, ``num_blocks`` at most (vLLM evicts least recently used free blocks)."""

    def __init__(self, num_blocks: int) -> None:
        self._num_blocks = num_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def admit(self, block_hashes: Sequence[int]) -> tuple[int, list[int], list[int]]:
        """Run a prompt's blocks through the cache: (leading blocks that hit, stored, evicted)."""
        num_hit = 0
        for h in block_hashes:
            if h not in self._blocks:
                break
            num_hit += 1
        stored: list[int] = []
        evicted: list[int] = []
        for h in block_hashes:
            if h in self._blocks:
                self._blocks.move_to_end(h)
                continue
            while len(self._blocks) >= self._num_blocks:
                old, _ = self._blocks.popitem(last=False)
                evicted.append(old)
            self._blocks[h] = None
            stored.append(h)
        return num_hit, stored, evicted


#: Sockets the simulated publishers of one process may hold (two each): ZMQ's default of 1,023
#: stops a benchmark at ~500 simulated workers with "Too many open files".
MAX_SOCKETS = 65_536
_zmq_context: Any = None


def _publisher_context() -> Any:
    """The ZMQ context every simulated publisher in this process shares, created on first use with
    ``MAX_SOCKETS`` raised. Process-wide and never terminated, like ``zmq.Context.instance()``: each
    publisher closes its own sockets, and the context's I/O thread lives as long as the process."""
    global _zmq_context
    if _zmq_context is None:
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context()
        ctx.set(zmq.MAX_SOCKETS, min(MAX_SOCKETS, ctx.get(zmq.SOCKET_LIMIT)))  # before any socket
        _zmq_context = ctx
    return _zmq_context


class SimulatedKVEventPublisher:
    """vLLM's ``ZmqEventPublisher`` protocol: PUB ``(topic, seq, payload)`` plus a
    ROUTER replay socket that streams buffered batches from a start seq, then END_SEQ."""

    def __init__(self, host: str, port: int, replay_port: int, *, buffer_steps: int = 10_000) -> None:
        import zmq

        self._ctx = _publisher_context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._replay = self._ctx.socket(zmq.ROUTER)
        self._replay.setsockopt(zmq.LINGER, 0)
        # port 0: any free port (what tests and benchmarks with many workers want)
        port = self._pub.bind_to_random_port(f"tcp://{host}") if port == 0 else self._bind(self._pub, host, port)
        replay_port = (
            self._replay.bind_to_random_port(f"tcp://{host}")
            if replay_port == 0
            else self._bind(self._replay, host, replay_port)
        )
        self.endpoint = f"tcp://{host}:{port}"
        self.replay_endpoint = f"tcp://{host}:{replay_port}"
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._replay_task: asyncio.Task[None] | None = None

    @staticmethod
    def _bind(sock: Any, host: str, port: int) -> int:
        sock.bind(f"tcp://{host}:{port}")
        return port

    def start(self) -> None:
        self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    async def publish(self, events: Sequence[KVEvent], *, block_size: int, lose: bool = False) -> None:
        """Send one batch; ``lose`` keeps it for replay only, as if the PUB message was dropped."""
        if not events:
            return
        payload = encode_batch(time.time(), events, block_size=block_size)
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        if not lose:
            await self._pub.send_multipart((b"", encode_seq(seq), payload))

    async def _serve_replay(self) -> None:
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                continue
            client_id, _, start = frames
            start_seq = int.from_bytes(start, "big", signed=True)
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await self._replay.send_multipart((client_id, b"", b"", encode_seq(seq), payload))
            await self._replay.send_multipart((client_id, b"", b"", END_SEQ, b""))

    async def aclose(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        self._pub.close(linger=0)
        self._replay.close(linger=0)
