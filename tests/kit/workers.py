"""Worker records and what the router reads them through: a fake registry and
fixed views (router unit tests)."""

from __future__ import annotations

from collections.abc import Iterable

from tandem.common.errors import BackendUnavailableError
from tandem.common.registry import WorkerLoad, WorkerRecord


def make_worker(
    worker_id: str,
    role: str,
    *,
    model: str = "m",
    num_running: int = 0,
    num_waiting: int = 0,
) -> WorkerRecord:
    return WorkerRecord(
        worker_id=worker_id,
        role=role,
        model=model,
        address=f"{worker_id}.local:7000",
        load=WorkerLoad(num_running_requests=num_running, num_waiting_requests=num_waiting),
    )


def make_pool(num_prefill: int, num_decode: int, *, model: str = "m") -> list[WorkerRecord]:
    return [make_worker(f"p{i}", "prefill", model=model) for i in range(num_prefill)] + [
        make_worker(f"d{i}", "decode", model=model) for i in range(num_decode)
    ]


class FakeRegistry:
    """Stands in for WorkerRegistry.list_workers; counts calls, can be made to fail."""

    def __init__(self, workers: Iterable[WorkerRecord] = ()) -> None:
        self.workers = list(workers)
        self.num_calls = 0
        self.fail = False

    async def list_workers(self, *, role: str | None = None, model: str | None = None) -> list[WorkerRecord]:
        self.num_calls += 1
        if self.fail:
            raise BackendUnavailableError("redis down")
        return [w for w in self.workers if (role is None or w.role == role) and (model is None or w.model == model)]


class StaticLoad:
    """A LoadView with fixed in-flight counts."""

    def __init__(self, counts: dict[str, int] | None = None) -> None:
        self.counts = counts or {}

    def num_in_flight(self, worker_id: str) -> int:
        return self.counts.get(worker_id, 0)


#: One small prefill and one large decode worker (block size 16).
TWO_WORKERS = [
    WorkerRecord("p0", "prefill", "m", "p0:1", block_size_tokens=16, num_kv_blocks=100),
    WorkerRecord("d0", "decode", "m", "d0:1", block_size_tokens=16, num_kv_blocks=10_000),
]


class StaticView:
    """A WorkerView over a fixed list (``TWO_WORKERS`` unless given)."""

    def __init__(self, workers: list[WorkerRecord] | None = None) -> None:
        self.list = TWO_WORKERS if workers is None else workers

    async def workers(self) -> list[WorkerRecord]:
        return self.list
