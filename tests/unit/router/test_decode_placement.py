"""Decode placement as its own decision: a decode-only Schedule for a dead decode worker's
replacement, and decode scoring that counts the KV a decode worker already holds."""

from __future__ import annotations

import msgspec
import pytest

from tandem.common.block_hash import BlockHasher
from tandem.common.errors import InvalidRequestError, NoCapacityError
from tandem.common.registry import WorkerRecord
from tandem.router.handoff import _decode_pending, _encode_pending
from tandem.router.kv_index import KVIndex
from tandem.router.ledger import RemoteWaiter
from tandem.router.ledger_events import WaitingRequest
from tandem.router.placement import PendingRequest
from tandem.router.policy import CacheAwareWeights, ScheduleRequest
from tandem.router.scheduler import Scheduler
from tests.kit.router import make_scheduler

BLOCK = 16
DOC = list(range(5000, 5000 + 8 * BLOCK))  # 8 full blocks


def worker(worker_id: str, role: str, num_kv_blocks: int = 1000) -> WorkerRecord:
    return WorkerRecord(worker_id, role, "m", f"{worker_id}:1", block_size_tokens=BLOCK, num_kv_blocks=num_kv_blocks)


WORKERS = [worker("p0", "prefill"), worker("p1", "prefill"), worker("d0", "decode"), worker("d1", "decode")]


def scheduler(
    workers: list[WorkerRecord] = WORKERS, weights: CacheAwareWeights | None = None
) -> tuple[Scheduler, KVIndex]:
    s = make_scheduler(
        workers,
        lease_s=60,
        weights=weights or CacheAwareWeights(),
        budget={"prefill_tokens_in_flight": 10_000},
    )
    return s, s.index


def request(request_id: str, prompt: list[int], **kwargs: object) -> ScheduleRequest:
    return ScheduleRequest(
        request_id=request_id,
        model="m",
        num_prompt_tokens=len(prompt),
        max_tokens=16,
        prompt_token_ids=tuple(prompt),
        **kwargs,  # type: ignore[arg-type]
    )


async def test_a_decode_only_schedule_keeps_the_prefill_worker_and_books_decode_budget_only() -> None:
    s, _ = scheduler()
    prompt = [*DOC, 1, 2, 3]
    first = await s.schedule(request("r", prompt))
    assert first.prefill is not None
    dead = first.decode.worker_id
    replaced = await s.schedule(
        request("r", prompt, prefill_done_on_worker_id=first.prefill.worker_id, exclude_worker_ids=frozenset({dead}))
    )
    assert replaced.decode.worker_id != dead and replaced.decode.role == "decode"
    # the prefill worker that holds the KV is named back, and nothing is reserved on any prefill worker
    assert replaced.prefill == first.prefill and not replaced.local_prefill
    assert "decode_only" in replaced.reason
    tokens = s.reservations.tokens_by_worker()
    assert tokens == {replaced.decode.worker_id: len(prompt) + 16}
    assert s.reservations.num_in_flight(first.prefill.worker_id) == 0
    assert s.reservations.num_in_flight(dead) == 0  # the old pair's reservation was replaced
    # its cost in the tenant's fair share is nothing new to compute
    served_after_first = s.shares.served("")
    assert served_after_first == pytest.approx(len(prompt), rel=1e-3)


async def test_a_decode_only_schedule_without_a_decode_worker_left_is_no_capacity() -> None:
    s, _ = scheduler([worker("p0", "prefill"), worker("d0", "decode")])
    first = await s.schedule(request("r", DOC))
    with pytest.raises(NoCapacityError):
        await s.schedule(request("r", DOC, prefill_done_on_worker_id="p0", exclude_worker_ids=frozenset({"d0"})))
    assert first.prefill is not None


async def test_decode_goes_where_its_prefix_is_held_unless_that_worker_is_much_busier() -> None:
    s, index = scheduler()
    index.store("d1", BlockHasher(BLOCK).block_hashes(DOC))
    prompt = [*DOC, 9, 9, 9]
    placements = [await s.schedule(request(f"r{i}", prompt)) for i in range(3)]
    assert [p.decode.worker_id for p in placements] == ["d1", "d1", "d1"]
    assert all(p.num_decode_cached_tokens == 8 * BLOCK for p in placements)
    # with decode locality weighed at nothing, the same prompts spread for balance
    s2, index2 = scheduler(weights=CacheAwareWeights(decode_prefix_locality=0))
    index2.store("d1", BlockHasher(BLOCK).block_hashes(DOC))
    spread = {(await s2.schedule(request(f"r{i}", prompt))).decode.worker_id for i in range(4)}
    assert spread == {"d0", "d1"}


async def test_a_full_decode_worker_is_left_even_when_it_holds_the_prefix() -> None:
    small = [worker("p0", "prefill"), worker("d0", "decode"), worker("d1", "decode", num_kv_blocks=20)]
    s, index = scheduler(small)
    index.store("d1", BlockHasher(BLOCK).block_hashes(DOC))
    prompt = [*DOC, 9]
    # d1's budget: 0.9 x 20 blocks x 16 = 288 tokens; one 145-token request fits, a second does not
    chosen = [(await s.schedule(request(f"r{i}", prompt))).decode.worker_id for i in range(2)]
    assert chosen == ["d1", "d0"]


async def test_a_local_prefills_replacement_stays_local_and_books_decode_budget_only() -> None:
    """A dead decode worker's replacement for a local prefill (nothing was streamed, no prefill worker
    holds KV): the new decode worker prefills the prompt itself, even one long enough that a normal
    Schedule would take a prefill worker, and no prefill worker's budget is booked for it."""
    s, _ = scheduler()
    prompt = [*DOC, 1, 2, 3]  # over the local-prefill threshold
    assert (await s.schedule(request("normal", prompt))).prefill is not None
    s.end_reservation("normal")
    replaced = await s.schedule(request("r", prompt, local_prefill_only=True, exclude_worker_ids=frozenset({"d0"})))
    assert replaced.local_prefill and replaced.prefill is None
    assert replaced.decode.worker_id == "d1" and "local_prefill" in replaced.reason
    assert s.reservations.tokens_by_worker() == {"d1": len(prompt) + 16}
    assert s.reservations.num_in_flight("p0") == s.reservations.num_in_flight("p1") == 0


async def test_local_prefill_only_and_a_prefill_done_elsewhere_exclude_each_other() -> None:
    s, _ = scheduler()
    with pytest.raises(InvalidRequestError, match="exclude each other"):
        await s.schedule(request("r", DOC, local_prefill_only=True, prefill_done_on_worker_id="p0"))
    assert s.reservations.tokens_by_worker() == {}


def test_a_queued_local_prefills_replacement_travels_to_other_replicas_as_such() -> None:
    """A waiter's hand-off payload carries local_prefill_only (another replica placing it must keep
    it local), and a payload from a replica of the version before (seven fields) still decodes."""
    waiting = PendingRequest(request("r", DOC, local_prefill_only=True, exclude_worker_ids=frozenset({"d0"})))
    waiting.hashes[(BLOCK, "sha256")] = [11, 12]
    payload = _encode_pending(waiting, "normal")
    decoded = _decode_pending(RemoteWaiter("r", "t", 1, 0.0, "replica-b", payload))
    assert decoded is not None
    assert decoded.request.local_prefill_only and decoded.request.exclude_worker_ids == frozenset({"d0"})
    assert decoded.hashes == {(BLOCK, "sha256"): [11, 12]}
    # The version before's seven fields, as the ledger decodes them off the wire.
    seven = msgspec.msgpack.encode(msgspec.to_builtins(payload)[:7])
    older = _decode_pending(
        RemoteWaiter("r", "t", 1, 0.0, "replica-b", msgspec.msgpack.decode(seven, type=WaitingRequest))
    )
    assert older is not None and not older.request.local_prefill_only
