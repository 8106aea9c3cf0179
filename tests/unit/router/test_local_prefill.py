"""Disaggregate only when it pays: a request whose prompt is mostly in the decode worker's prefix
cache (or short) is placed on that decode worker alone; the rest go through a prefill worker."""

from __future__ import annotations

import pytest

from tandem.common.block_hash import BlockHasher
from tandem.common.errors import NoCapacityError
from tandem.common.registry import WorkerRecord
from tandem.router.deployment import placement_to_proto
from tandem.router.kv_index import KVIndex
from tandem.router.metrics import NullRouterMetrics
from tandem.router.policy import ScheduleRequest
from tandem.router.scheduler import Scheduler
from tandem.router.settings import RouterConfig
from tests.kit import router as kit
from tests.kit.clock import FakeClock
from tests.unit.router.test_cache_aware import BLOCK, request, worker

THRESHOLD = 40
#: Three full blocks of a document (48 tokens).
DOC = list(range(2000, 2000 + 3 * BLOCK))


class PlacementCounts(NullRouterMetrics):
    def __init__(self) -> None:
        self.local = 0
        self.disaggregated = 0
        #: Uncached prompt tokens handed to prefill workers (the prefill pool's demand counter).
        self.prefill_tokens = 0

    def count_prefill_tokens(self, num_tokens: int, *, model: str) -> None:
        self.prefill_tokens += num_tokens

    def count_placement(self, *, local_prefill: bool, model: str) -> None:
        if local_prefill:
            self.local += 1
        else:
            self.disaggregated += 1


def make_scheduler(
    workers: list[WorkerRecord], *, threshold: int = THRESHOLD
) -> tuple[Scheduler, KVIndex, PlacementCounts]:
    metrics = PlacementCounts()
    scheduler = kit.make_scheduler(
        workers,
        metrics=metrics,
        clock=FakeClock(),
        lease_s=60,
        budget={"prefill_tokens_in_flight": 10_000},
        disaggregation={"min_uncached_tokens": threshold},
    )
    return scheduler, scheduler.index, metrics


POOL = [worker("p0", "prefill"), worker("d0", "decode")]


async def test_a_short_prompt_runs_on_the_decode_worker_alone() -> None:
    scheduler, _, metrics = make_scheduler(POOL)
    placement = await scheduler.schedule(request("short", [5] * (THRESHOLD - 1)))
    assert placement.local_prefill and placement.prefill is None
    assert placement.decode.worker_id == "d0"
    assert placement.num_cached_tokens == 0 and placement.num_decode_cached_tokens == 0
    assert "local_prefill" in placement.reason
    # Only the decode worker is reserved (prompt + max_tokens of KV); the prefill worker is untouched.
    assert scheduler.reservations.in_flight_by_worker() == {"d0": 1}
    assert scheduler.reservations.tokens_by_worker() == {"d0": THRESHOLD - 1 + 8}
    assert (metrics.local, metrics.disaggregated) == (1, 0)
    assert metrics.prefill_tokens == 0  # the decode worker computed it: no prefill demand


async def test_at_the_threshold_the_request_goes_through_a_prefill_worker() -> None:
    scheduler, _, metrics = make_scheduler(POOL)
    placement = await scheduler.schedule(request("long", [5] * THRESHOLD))
    assert not placement.local_prefill
    assert placement.prefill is not None and placement.prefill.worker_id == "p0"
    assert scheduler.reservations.in_flight_by_worker() == {"p0": 1, "d0": 1}
    assert (metrics.local, metrics.disaggregated) == (0, 1)
    assert metrics.prefill_tokens == THRESHOLD  # nothing cached: the whole prompt is prefill's to compute


async def test_the_decode_workers_cached_prefix_counts_as_computed() -> None:
    """A long prompt whose prefix the chosen decode worker holds (its KV events say so) is finished
    there: what is left to compute is below the threshold, whatever the prefill worker caches. (The
    decode worker is chosen for balance, as before; its own cache then decides the path.)"""
    scheduler, index, _ = make_scheduler([worker("p0", "prefill"), worker("d0", "decode"), worker("d1", "decode")])
    hashes = BlockHasher(BLOCK).block_hashes(DOC)
    index.store("d1", hashes)
    index.store("p0", hashes)
    prompt = DOC + [7] * (THRESHOLD - 1)

    def placed_avoiding(request_id: str, decode_worker_id: str) -> ScheduleRequest:
        return ScheduleRequest(
            request_id=request_id,
            model="m",
            num_prompt_tokens=len(prompt),
            max_tokens=8,
            prompt_token_ids=tuple(prompt),
            exclude_worker_ids=frozenset({decode_worker_id}),
        )

    local = await scheduler.schedule(placed_avoiding("warm", "d0"))
    assert local.local_prefill and local.decode.worker_id == "d1"
    assert local.num_decode_cached_tokens == len(DOC)
    # The same prompt on a decode worker without the prefix: too much to compute there.
    cold = await scheduler.schedule(placed_avoiding("cold", "d1"))
    assert not cold.local_prefill and cold.decode.worker_id == "d0"
    assert cold.num_cached_tokens == len(DOC)  # the prefill worker's prefix still counts for prefill


@pytest.mark.parametrize(
    ("num_prefill_blocks", "num_new_tokens", "local"),
    [
        (3, THRESHOLD + 4, True),  # the prefill worker three blocks behind would compute 48 tokens more
        (5, THRESHOLD + 4, True),  # one block behind: 16 more, still over the handoff's price
        (5, THRESHOLD + 20, False),  # one block behind, but 60 uncached tokens: the handoff pays
        (6, THRESHOLD + 4, False),  # the prefill worker as far as the decode worker: the threshold alone
    ],
)
async def test_a_chain_turn_stays_where_its_previous_turn_was_finished(
    num_prefill_blocks: int, num_new_tokens: int, local: bool
) -> None:
    """A chain's turn N+1 (a Responses chain, a conversation) when turn N ran on the decode worker alone:
    the decode worker holds its prompt and answer, the prefill worker only an older turn's prefix. A
    handoff would make the prefill worker compute again what the decode worker holds: the tokens it would
    recompute add to the handoff's price (the threshold), so the turn stays on the decode worker while its
    own uncached tokens are below both."""
    scheduler, index, metrics = make_scheduler(POOL)
    chain = list(range(3000, 3000 + 6 * BLOCK))  # turn N's prompt and answer: six full blocks
    hashes = BlockHasher(BLOCK).block_hashes(chain)
    index.store("d0", hashes)
    index.store("p0", hashes[:num_prefill_blocks])
    placement = await scheduler.schedule(request("turn", chain + [7] * num_new_tokens))
    assert placement.decode.worker_id == "d0" and placement.num_decode_cached_tokens == len(chain)
    assert placement.local_prefill is local and (placement.prefill is None) is local
    if not local:
        assert placement.prefill is not None and placement.prefill.worker_id == "p0"
        assert placement.num_cached_tokens == num_prefill_blocks * BLOCK
    assert (metrics.local, metrics.disaggregated) == ((1, 0) if local else (0, 1))


async def test_a_request_that_does_not_say_its_prompt_length_is_not_taken_for_short() -> None:
    scheduler, _, _ = make_scheduler(POOL)
    placement = await scheduler.schedule(ScheduleRequest(request_id="unsized", model="m", max_tokens=8))
    assert not placement.local_prefill and placement.prefill is not None


async def test_a_threshold_of_zero_always_disaggregates() -> None:
    scheduler, _, metrics = make_scheduler(POOL, threshold=0)
    placement = await scheduler.schedule(request("one", [5]))
    assert not placement.local_prefill and placement.prefill is not None
    assert (metrics.local, metrics.disaggregated) == (0, 1)


async def test_without_prefill_workers_short_prompts_are_served_and_long_ones_name_the_missing_role() -> None:
    scheduler, _, _ = make_scheduler([worker("d0", "decode")])
    assert (await scheduler.schedule(request("short", [5] * 3))).local_prefill
    with pytest.raises(NoCapacityError, match="no prefill worker"):
        await scheduler.schedule(request("long", [5] * THRESHOLD))


def test_the_placement_proto_of_a_local_prefill_has_no_prefill_worker() -> None:
    scheduler, _, _ = make_scheduler(POOL)
    local = placement_to_proto(scheduler.place_now(request("short", [5] * 3), POOL))
    assert local.local_prefill and not local.HasField("prefill")
    assert local.decode.worker_id == "d0"
    pair = placement_to_proto(scheduler.place_now(request("long", [5] * THRESHOLD), POOL))
    assert not pair.local_prefill and pair.prefill.worker_id == "p0"


def test_the_placement_names_each_workers_kv_server_as_it_registered_it() -> None:
    """The gateway sends the decode worker the prefill worker's KV address (PrefetchKV) from here."""
    import dataclasses

    pool = [dataclasses.replace(w, kv_address=f"{w.worker_id}.local:7100") for w in POOL]
    scheduler, _, _ = make_scheduler(pool)
    pair = placement_to_proto(scheduler.place_now(request("long", [5] * THRESHOLD), pool))
    assert pair.prefill.kv_address == "p0.local:7100" and pair.decode.kv_address == "d0.local:7100"


def test_the_threshold_is_a_router_setting() -> None:
    assert RouterConfig().disaggregation.min_uncached_tokens > 0
    assert (
        RouterConfig.model_validate({"disaggregation": {"min_uncached_tokens": 0}}).disaggregation.min_uncached_tokens
        == 0
    )
    with pytest.raises(ValueError):
        RouterConfig.model_validate({"disaggregation": {"min_uncached_tokens": -1}})
