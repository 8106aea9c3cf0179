"""The router pairs a prefill worker only with decode workers of the same KV-layout fingerprint
(tandem.router.pairing): during a rollout old and new workers are registered side by side, and no
placement crosses them; a decode worker with no partner computes the prompt itself."""

from __future__ import annotations

import pytest

from tandem.common.errors import NoCapacityError
from tandem.common.registry import WorkerRecord
from tandem.router.metrics import NullRouterMetrics
from tandem.router.pairing import Pairing
from tandem.router.policy import ScheduleRequest
from tandem.router.scheduler import Scheduler
from tests.kit.router import make_scheduler

BLOCK = 16
OLD = "kv1-00000000000000aa"
NEW = "kv1-00000000000000bb"
#: A prompt long enough to disaggregate (min_uncached_tokens 0 in the kit anyway).
PROMPT = list(range(3000, 3000 + 6 * BLOCK))


def worker(worker_id: str, role: str, fingerprint: str, *, num_kv_blocks: int = 1000) -> WorkerRecord:
    return WorkerRecord(
        worker_id,
        role,
        "m",
        f"{worker_id}:1",
        block_size_tokens=BLOCK,
        num_kv_blocks=num_kv_blocks,
        kv_fingerprint=fingerprint,
        model_revision=fingerprint[-2:],
    )


class Unpaired(NullRouterMetrics):
    def __init__(self) -> None:
        self.by_model: dict[str, int] = {}

    def count_unpaired(self, *, model: str) -> None:
        self.by_model[model] = self.by_model.get(model, 0) + 1


def scheduler(workers: list[WorkerRecord], policy: str = "cache_aware") -> tuple[Scheduler, Unpaired]:
    metrics = Unpaired()
    s = make_scheduler(workers, lease_s=60, policy=policy, metrics=metrics, budget={"prefill_tokens_in_flight": 10_000})
    return s, metrics


def request(request_id: str, **kwargs: object) -> ScheduleRequest:
    return ScheduleRequest(
        request_id=request_id,
        model="m",
        num_prompt_tokens=len(PROMPT),
        max_tokens=16,
        prompt_token_ids=tuple(PROMPT),
        **kwargs,  # type: ignore[arg-type]
    )


def fingerprint_of(workers: list[WorkerRecord], worker_id: str) -> str:
    return next(w.kv_fingerprint for w in workers if w.worker_id == worker_id)


@pytest.mark.parametrize("policy", ["cache_aware", "round_robin", "least_loaded"])
def test_no_placement_crosses_fingerprints_while_both_revisions_serve(policy: str) -> None:
    fleet = [
        worker("p-old", "prefill", OLD),
        worker("d-old", "decode", OLD),
        worker("p-new", "prefill", NEW),
        worker("d-new", "decode", NEW),
        worker("d-new2", "decode", NEW),
    ]
    s, metrics = scheduler(fleet, policy)
    pairs = []
    for i in range(40):
        placement = s.place_now(request(f"r{i}"), fleet)
        assert placement.prefill is not None and not placement.local_prefill
        pairs.append((placement.prefill.worker_id, placement.decode.worker_id))
    assert all(fingerprint_of(fleet, p) == fingerprint_of(fleet, d) for p, d in pairs), pairs
    assert {fingerprint_of(fleet, d) for _, d in pairs} == {OLD, NEW}  # both revisions serve meanwhile
    assert metrics.by_model == {}


def test_a_new_decode_worker_without_its_prefill_partner_takes_requests_only_as_local_prefills() -> None:
    # The rollout's first step: the new revision's decode worker is up, its prefill worker not yet.
    fleet = [
        worker("p-old", "prefill", OLD),
        worker("d-old", "decode", OLD, num_kv_blocks=8),
        worker("d-new", "decode", NEW),
    ]
    s, metrics = scheduler(fleet)
    first = s.place_now(request("r0"), fleet)
    assert first.prefill is not None and (first.prefill.worker_id, first.decode.worker_id) == ("p-old", "d-old")
    # d-old's KV budget (8 blocks) is spent by the first request: the next one goes to d-new, alone.
    second = s.place_now(request("r1"), fleet)
    assert second.local_prefill and second.prefill is None and second.decode.worker_id == "d-new"
    assert "local_prefill unpaired" in second.reason
    assert metrics.by_model == {"m": 1}


def test_a_new_prefill_worker_without_its_decode_partner_is_never_paired() -> None:
    fleet = [worker("p-new", "prefill", NEW), worker("p-old", "prefill", OLD), worker("d-old", "decode", OLD)]
    s, metrics = scheduler(fleet, "round_robin")
    prefills = {s.place_now(request(f"r{i}"), fleet).prefill.worker_id for i in range(10)}  # type: ignore[union-attr]
    assert prefills == {"p-old"}
    assert metrics.by_model == {}


def test_the_old_revision_gone_its_decode_worker_computes_prompts_alone_until_a_partner_registers() -> None:
    fleet = [worker("p-new", "prefill", NEW), worker("d-old", "decode", OLD)]
    s, metrics = scheduler(fleet)
    placement = s.place_now(request("r0"), fleet)
    assert placement.local_prefill and placement.decode.worker_id == "d-old"
    fleet = [*fleet, worker("d-new", "decode", NEW)]  # a new registry read
    placement = s.place_now(request("r1"), fleet)
    assert placement.prefill is not None and (placement.prefill.worker_id, placement.decode.worker_id) == (
        "p-new",
        "d-new",
    )
    assert metrics.by_model == {"m": 1}


def test_a_busy_partner_is_waited_for_not_replaced_by_another_fingerprint() -> None:
    # Prefill of the decode worker's fingerprint exists but has no budget: the request waits as for
    # no capacity; it is never sent to the other fingerprint's idle prefill worker.
    fleet = [worker("p-old", "prefill", OLD), worker("d-old", "decode", OLD), worker("p-new", "prefill", NEW)]
    s = make_scheduler(fleet, lease_s=60, budget={"prefill_tokens_in_flight": len(PROMPT)})
    assert s.place_now(request("r0"), fleet).prefill.worker_id == "p-old"  # type: ignore[union-attr]
    with pytest.raises(NoCapacityError, match="no worker has budget"):
        s.place_now(request("r1"), fleet)


def test_a_decode_only_placement_stays_on_the_fingerprint_of_the_prefill_worker_holding_the_kv() -> None:
    fleet = [
        worker("p-old", "prefill", OLD),
        worker("d-old", "decode", OLD),
        worker("d-old2", "decode", OLD),
        worker("p-new", "prefill", NEW),
        worker("d-new", "decode", NEW),
    ]
    s, _ = scheduler(fleet, "round_robin")
    for i in range(6):
        replaced = s.place_now(
            request(f"r{i}", prefill_done_on_worker_id="p-old", exclude_worker_ids=frozenset({"d-old"})), fleet
        )
        assert replaced.prefill is not None and replaced.prefill.worker_id == "p-old"
        assert replaced.decode.worker_id == "d-old2"
    # Its one decode worker of that fingerprint excluded too: it waits / fails as for no capacity,
    # never crossing to d-new.
    with pytest.raises(NoCapacityError):
        s.place_now(
            request("last", prefill_done_on_worker_id="p-old", exclude_worker_ids=frozenset({"d-old", "d-old2"})),
            fleet,
        )


def test_workers_of_an_older_tandem_without_fingerprints_pair_only_with_each_other() -> None:
    fleet = [
        worker("p-legacy", "prefill", ""),
        worker("d-legacy", "decode", ""),
        worker("p-new", "prefill", NEW),
        worker("d-new", "decode", NEW),
    ]
    s, _ = scheduler(fleet, "round_robin")
    for i in range(12):
        placement = s.place_now(request(f"r{i}"), fleet)
        assert placement.prefill is not None
        assert fingerprint_of(fleet, placement.prefill.worker_id) == fingerprint_of(fleet, placement.decode.worker_id)


def test_one_fingerprint_leaves_the_request_as_it_was() -> None:
    fleet = [worker("p0", "prefill", OLD), worker("d0", "decode", OLD), worker("x", "decode", NEW)]
    plain = request("r")
    pairing = Pairing.of(plain, fleet[:2], {OLD})
    assert pairing.uniform and pairing.paired_decode(fleet[:2]) is plain and pairing.prefill_for(fleet[1]) is plain
    mixed = Pairing.of(plain, fleet, {OLD, NEW})
    assert mixed.paired_decode(fleet).exclude_worker_ids == {"x"}
    assert mixed.prefill_for(fleet[2]).exclude_worker_ids == {"p0", "d0"}
    assert mixed.decode_for("gone") is plain


def test_the_fleet_table_keeps_each_models_fingerprints() -> None:
    """What Placer hands Pairing.of: a worker changing its fingerprint is a new fleet table."""
    fleet = [worker("p0", "prefill", OLD), worker("d0", "decode", OLD), worker("x", "decode", NEW)]
    s, _ = scheduler(fleet, "round_robin")
    s.place_now(request("r0"), fleet[:2])
    assert s.intake.fleet.kv_fingerprints == {"m": frozenset({OLD})}
    s.place_now(request("r1"), fleet)
    assert s.intake.fleet.kv_fingerprints == {"m": frozenset({OLD, NEW})}
