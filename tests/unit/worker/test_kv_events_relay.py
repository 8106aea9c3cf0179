"""The worker's KV-event relay against vLLM's REAL publisher (``ZmqEventPublisher`` bound on the
relay's private ipc endpoints, as the engine runs it): a subscriber on the public endpoint and a
replay client through the relay get vLLM's framing and every batch, but never a token id, a cache
salt or a session id, and the router's decoder reads from them exactly what it reads from the raw
feed. Imports vLLM, hence ``slow``."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
import zmq

from tandem.common.kv_events import END_SEQ, decode_batch
from tandem.worker.kv_events_relay import BatchRedactor, KVEventRedactError, KVEventRelay, plan_endpoints
from tests.kit.net import free_port

pytestmark = pytest.mark.slow

BLOCK = 16
SALT = "tenant-salt-7f3a"


@pytest.fixture(scope="module")
def vkv() -> Any:
    """``vllm.distributed.kv_events`` (imported here, not at collection: importing vLLM takes seconds)."""
    return pytest.importorskip("vllm.distributed.kv_events")


def stored(vkv: Any, first_token: int, num_blocks: int, *, digests: bool = False) -> Any:
    hashes: list[Any] = [
        (first_token + i).to_bytes(32, "big") if digests else first_token * 1_000 + i for i in range(num_blocks)
    ]
    return vkv.BlockStored(
        block_hashes=hashes,
        parent_block_hash=first_token - 1 if first_token else None,
        token_ids=list(range(first_token + 1, first_token + 1 + num_blocks * BLOCK)),
        block_size=BLOCK,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=[(SALT,)] * num_blocks,
        group_idx=0,
        session_id=f"session-{first_token}",
    )


def batch(vkv: Any, i: int) -> Any:
    """Batch ``i``: blocks stored (raw digests every third batch), now and then a removal."""
    events: list[Any] = [stored(vkv, 100 + 97 * i, 1 + i % 4, digests=i % 3 == 2)]
    if i % 5 == 4:
        events.append(vkv.BlockRemoved(block_hashes=[(100 + 97 * (i - 1)) * 1_000], medium="GPU"))
    if i % 11 == 10:
        events.append(vkv.AllBlocksCleared())
    return vkv.KVEventBatch(ts=1_000.0 + i, events=events, data_parallel_rank=0)


def assert_redacted(vkv: Any, payload: bytes, original: Any) -> None:
    """``payload`` holds ``original``'s events with no request data, and reads as it for the router."""
    got = msgspec.msgpack.Decoder(vkv.KVEventBatch).decode(payload)
    assert len(got.events) == len(original.events)
    for event, before in zip(got.events, original.events, strict=True):
        assert type(event) is type(before)
        if isinstance(event, vkv.BlockStored):
            assert event.token_ids == [0] * len(before.token_ids) and before.token_ids[0] != 0
            assert event.extra_keys is None and event.session_id is None
            assert (event.block_hashes, event.parent_block_hash) == (before.block_hashes, before.parent_block_hash)
            assert (event.block_size, event.medium, event.group_idx) == (before.block_size, before.medium, 0)
    assert SALT.encode() not in payload and b"session-" not in payload
    assert decode_batch(payload) == decode_batch(msgspec.msgpack.encode(original))


@dataclass
class Relayed:
    engine: Any  # vllm.distributed.kv_events.ZmqEventPublisher
    relay: KVEventRelay
    ctx: zmq.Context[Any]
    published: list[Any]

    def publish(self, vkv: Any, n: int) -> None:
        for _ in range(n):
            b = batch(vkv, len(self.published))
            self.published.append(b)
            self.engine.publish(b)


@pytest.fixture
def relayed(vkv: Any, tmp_path: Any) -> Iterator[Relayed]:
    plan = plan_endpoints("127.0.0.1", free_port(), free_port(), run_dir=str(tmp_path))
    relay = KVEventRelay(plan)
    relay.start()
    engine = vkv.ZmqEventPublisher(0, endpoint=plan.engine_publish, replay_endpoint=plan.engine_replay)
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        yield Relayed(engine, relay, ctx, [])
    finally:
        engine.shutdown()
        relay.close()
        ctx.destroy(linger=0)


def test_the_redactor_zeroes_token_ids_and_drops_the_salt_and_session(vkv: Any) -> None:
    redact = BatchRedactor()
    for i in range(12):
        original = batch(vkv, i)
        assert_redacted(vkv, redact(msgspec.msgpack.encode(original)), original)
    with pytest.raises(KVEventRedactError):
        redact("東京 🙂".encode())


def test_a_subscriber_on_the_public_endpoint_sees_vllms_framing_and_no_token_ids(relayed: Relayed, vkv: Any) -> None:
    sub = relayed.ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(relayed.relay.endpoints.public_publish)
    # Slow joiner: publish until the subscription has reached the relay's PUB.
    deadline = time.monotonic() + 20
    first: list[bytes] | None = None
    while first is None and time.monotonic() < deadline:
        relayed.publish(vkv, 1)
        if sub.poll(200):
            first = sub.recv_multipart()
    assert first is not None, "nothing arrived through the relay"
    received = [first]
    relayed.publish(vkv, 30)
    while len(received) < 31 and sub.poll(5_000):
        received.append(sub.recv_multipart())
    assert len(received) == 31
    first_seq = int.from_bytes(first[1], "big")
    for k, frames in enumerate(received):
        seq = first_seq + k
        # vLLM's framing, unchanged: (topic, seq as 8 bytes big-endian, payload)
        assert len(frames) == 3 and frames[0] == b"" and frames[1] == seq.to_bytes(8, "big")
        assert_redacted(vkv, frames[2], relayed.published[seq])
    assert relayed.relay.stats.num_dropped == 0


def ask(dealer: Any, start_seq: int) -> list[list[bytes]]:
    """One replay request as the router's subscriber sends it; the answer up to the end marker."""
    dealer.send_multipart((b"", start_seq.to_bytes(8, "big", signed=True)))
    answer: list[list[bytes]] = []
    while dealer.poll(5_000):
        frames = dealer.recv_multipart()
        answer.append(frames)
        if frames[2] == END_SEQ:
            return answer
    raise AssertionError(f"no end marker after {len(answer)} messages")


def test_replays_through_the_relay_are_vllms_answers_without_token_ids(relayed: Relayed, vkv: Any) -> None:
    relayed.publish(vkv, 40)
    first = relayed.ctx.socket(zmq.DEALER)
    second = relayed.ctx.socket(zmq.DEALER)
    for sock in (first, second):
        sock.setsockopt(zmq.RCVTIMEO, 5_000)
        sock.connect(relayed.relay.endpoints.public_replay)
    deadline = time.monotonic() + 10
    while len(answer := ask(first, 0)) < 41 and time.monotonic() < deadline:
        time.sleep(0.05)  # vLLM buffers a batch right after sending it
    assert len(answer) == 41
    assert answer[-1] == [b"", b"", END_SEQ, b""]
    for seq, frames in enumerate(answer[:-1]):
        assert len(frames) == 4 and frames[:3] == [b"", b"", seq.to_bytes(8, "big")]
        assert_redacted(vkv, frames[3], relayed.published[seq])

    # From a sequence number, and two clients at once: each gets its own answer, whole.
    first.send_multipart((b"", (25).to_bytes(8, "big")))
    second.send_multipart((b"", (37).to_bytes(8, "big")))
    for client, start_seq in ((first, 25), (second, 37)):
        got = [client.recv_multipart() for _ in range(40 - start_seq + 1)]
        assert [int.from_bytes(f[2], "big", signed=True) for f in got] == [*range(start_seq, 40), -1]
        for frames in got[:-1]:
            assert_redacted(vkv, frames[3], relayed.published[int.from_bytes(frames[2], "big")])
    assert relayed.relay.num_replay_clients == 2 and relayed.relay.stats.num_dropped == 0
    assert relayed.relay.stats.num_replay_requests >= 3


def test_a_payload_that_is_not_a_batch_is_dropped_and_nothing_listens_elsewhere(vkv: Any, tmp_path: Any) -> None:
    plan = plan_endpoints("127.0.0.1", free_port(), free_port(), run_dir=str(tmp_path))
    relay = KVEventRelay(plan)
    relay.start()
    ctx: zmq.Context[Any] = zmq.Context()
    pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
    try:
        pub.bind(plan.engine_publish)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(plan.public_publish)
        good = msgspec.msgpack.encode(batch(vkv, 0))
        deadline = time.monotonic() + 20
        got: list[list[bytes]] = []
        seq = 0
        while not got and time.monotonic() < deadline:
            pub.send_multipart((b"", seq.to_bytes(8, "big"), "東京 🙂".encode()))
            pub.send_multipart((b"", (seq + 1).to_bytes(8, "big"), good))
            seq += 2
            if sub.poll(200):
                got.append(sub.recv_multipart())
        assert got and int.from_bytes(got[0][1], "big") % 2 == 1  # only the batches
        assert_redacted(vkv, got[0][2], batch(vkv, 0))
        assert relay.stats.num_dropped >= 1
        other = socket.gethostbyname(socket.gethostname())
        for endpoint in (plan.public_publish, plan.public_replay) if not other.startswith("127.") else ():
            with socket.socket() as probe:  # bound on loopback only: not on another address of this host
                assert probe.connect_ex((other, int(endpoint.rsplit(":", 1)[1]))) != 0
    finally:
        sub.close(linger=0)
        pub.close(linger=0)
        ctx.term()
        relay.close()


def test_a_wildcard_host_is_relayed_too(tmp_path: Any) -> None:
    plan = plan_endpoints("0.0.0.0", 5557, 6557, run_dir=str(tmp_path))
    assert plan.engine_publish.startswith("ipc://") and plan.engine_replay.startswith("ipc://")
    assert (plan.public_publish, plan.public_replay) == ("tcp://0.0.0.0:5557", "tcp://0.0.0.0:6557")
