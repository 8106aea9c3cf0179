"""The registered workers as arrays, so that a placement costs the same at 10 workers or 1,000.

:class:`tandem.router.scheduler.Scheduler` builds a :class:`FleetTable` whenever the registry's
worker list changes (at most once per registry refresh) and, for every decision, first hands it
the workers whose reservations changed since the last one (this replica's
:meth:`~tandem.router.reservations.ReservationTable.drain_changed` and the other replicas'), then
asks :meth:`FleetTable.arrays` for each role's :class:`~tandem.router.pool.PoolArrays`. Keeping
the per-worker numbers in arrays, updated in place for the few workers a change touches, turns
the filter and the scorers into a handful of operations over the pool instead of a Python
call per worker (the profile at 1,000 workers: 14.6 ms per decision, 87 % of it in per-worker
``score``/``fits`` calls). The budget formulas are :func:`tandem.router.kernels.budget_state`, one
compiled call per pool. Pure data, no I/O.

Layout: one :class:`_Pool` per (role, model), workers in id order; per worker its
:data:`~tandem.router.kernels.WORKER_NUMBERS` record: the registry's numbers (capacity, reported load, KV
usage), this replica's reservations (tokens, the young part, requests, recently placed tokens) and
the other replicas' (the same, from :mod:`tandem.router.ledger`). Workers are grouped by how their
engine hashes prompt blocks, so a request is looked up in the KV index once per hashing
configuration, not once per worker.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from tandem.common.block_hash import HASH_ALGO_SHA256
from tandem.common.registry import ROLE_DECODE, ROLE_PREFILL, WorkerRecord
from tandem.router import budget as formulas
from tandem.router import kernels
from tandem.router.adapter_slots import PoolAdapters
from tandem.router.budget import BudgetConfig
from tandem.router.kernels import BUDGETS, WORKER_NUMBERS, Records
from tandem.router.pool import F64, PoolArrays, worker_key
from tandem.router.reservations import ReservationTable

#: (block size in tokens, hash seed): how an engine hashes its prefix-cache blocks.
HashConfig = tuple[int, str]

#: No per-worker block counts from the KV index (decode pools; no index).
_NO_INDEX: npt.NDArray[np.int64] = np.zeros(0, np.int64)


class IndexSlots(Protocol):
    """What the fleet reads of the KV index (:class:`tandem.router.kv_index.KVIndex`)."""

    @property
    def slots_version(self) -> int: ...

    def slot_of(self, worker_id: str) -> int: ...

    def num_blocks_by_slot(self) -> npt.NDArray[np.int64]: ...


@dataclass(frozen=True)
class CachedPrefix:
    """How much of one request's prompt each worker holds: per hashing configuration, the leading
    blocks held by every index slot (:meth:`~tandem.router.kv_index.KVIndex.match_by_slot`)."""

    blocks_by_config: Mapping[HashConfig, npt.NDArray[np.int64]]
    num_prompt_tokens: int


class OtherReplicaLoads(Protocol):
    """What the other live router replicas hold, per worker (see :mod:`tandem.router.ledger`)."""

    def others_tokens(self, worker_id: str) -> int: ...

    def others_young_tokens(self, worker_id: str) -> int: ...

    def others_in_flight(self, worker_id: str) -> int: ...

    def others_recent_tokens_at(self, worker_id: str) -> tuple[float, float]:
        """Budget tokens the others placed on ``worker_id`` lately, decayed as of the second returned."""
        ...

    def drain_changed(self) -> set[str]:
        """Workers whose numbers changed since the last call (all of them after a full refresh)."""
        ...


@dataclass
class _Pool:
    role: str
    workers: list[WorkerRecord]
    positions: dict[str, int]
    #: What the budget kernel reads (:data:`~tandem.router.kernels.WORKER_NUMBERS` records), updated
    #: in place for the workers a change touches,
    numbers: Records
    #: through these views of its fields (``numbers["own_tokens"]`` makes a new view each time: 4x
    #: slower to update a worker).
    columns: dict[str, npt.NDArray[Any]]
    num_reported_requests: F64
    worker_keys: npt.NDArray[np.uint64]
    #: Per hashing configuration, the positions of the workers that hash that way.
    positions_by_config: dict[HashConfig, npt.NDArray[np.intp]]
    #: Adapter slots and the adapters loaded, from the records.
    adapters: PoolAdapters

    @classmethod
    def build(cls, role: str, workers: list[WorkerRecord], config: BudgetConfig) -> _Pool:
        n = len(workers)

        def column(values: Iterable[float]) -> F64:
            return np.fromiter(values, dtype=np.float64, count=n)

        numbers = np.zeros(n, WORKER_NUMBERS)
        numbers["capacity_tokens"] = column(formulas.capacity_tokens(w, config) for w in workers)
        numbers["reported_tokens"] = column(formulas.reported_tokens(w) for w in workers)
        numbers["kv_usage"] = column(w.load.kv_usage for w in workers)
        numbers["num_kv_blocks"] = column(w.num_kv_blocks for w in workers)
        return cls(
            role=role,
            workers=workers,
            positions={w.worker_id: i for i, w in enumerate(workers)},
            numbers=numbers,
            columns={name: numbers[name] for name in WORKER_NUMBERS.names or ()},
            num_reported_requests=column(w.load.num_running_requests + w.load.num_waiting_requests for w in workers),
            worker_keys=np.fromiter((worker_key(w.worker_id) for w in workers), dtype=np.uint64, count=n),
            positions_by_config=_positions_by_config(workers),
            adapters=PoolAdapters.build(workers),
        )


def _positions_by_config(workers: Sequence[WorkerRecord]) -> dict[HashConfig, npt.NDArray[np.intp]]:
    """Workers whose engines hash prompt blocks alike (sha256 with a block size only: others are cold)."""
    by_config: dict[HashConfig, list[int]] = {}
    for i, w in enumerate(workers):
        if w.block_size_tokens > 0 and w.block_hash_algo == HASH_ALGO_SHA256:
            by_config.setdefault((w.block_size_tokens, w.block_hash_seed), []).append(i)
    return {config: np.asarray(positions, np.intp) for config, positions in by_config.items()}


def _identity(worker: WorkerRecord) -> tuple[object, ...]:
    """What a worker is, as opposed to how loaded it is: a change here rebuilds the table."""
    return (
        worker.worker_id,
        worker.role,
        worker.model,
        worker.address,
        worker.kv_events_endpoint,
        worker.kv_events_replay_endpoint,
        worker.block_hash_algo,
        worker.block_hash_seed,
        worker.block_size_tokens,
        worker.num_kv_blocks,
        worker.started_unix_s,
        worker.kv_fingerprint,
    )


@dataclass(frozen=True)
class HashGroup:
    """Workers of one model whose engines hash prompt blocks alike: one index lookup serves them all."""

    config: HashConfig
    members: frozenset[str]


@dataclass
class FleetTable:
    """Pools of one registry list; see the module docstring."""

    workers: Sequence[WorkerRecord]
    config: BudgetConfig
    recent_half_life_s: float
    pools: dict[tuple[str, str], _Pool] = field(default_factory=dict)
    #: Per model, its hashing configurations (sha256 engines with a block size only: others are cold).
    hash_groups: dict[str, list[HashGroup]] = field(default_factory=dict)
    #: Per model, the KV-layout fingerprints its workers registered (more than one only during a
    #: rollout: :mod:`tandem.router.pairing` then has pairs to keep apart).
    kv_fingerprints: dict[str, frozenset[str]] = field(default_factory=dict)
    _where: dict[str, tuple[_Pool, int]] = field(default_factory=dict)
    #: The KV index's slots_version when the pools' index slots were read (-1: never).
    _index_version: int = -1

    @classmethod
    def build(
        cls,
        workers: Sequence[WorkerRecord],
        config: BudgetConfig,
        reservations: ReservationTable,
        others: OtherReplicaLoads | None = None,
    ) -> FleetTable:
        table = cls(workers, config, reservations.recent_half_life_s)
        members: dict[tuple[str, str], list[WorkerRecord]] = {}
        groups: dict[str, dict[HashConfig, list[str]]] = {}
        fingerprints: dict[str, set[str]] = {}
        for w in workers:
            members.setdefault((w.role, w.model), []).append(w)
            fingerprints.setdefault(w.model, set()).add(w.kv_fingerprint)
            if w.block_size_tokens > 0 and w.block_hash_algo == HASH_ALGO_SHA256:
                key = (w.block_size_tokens, w.block_hash_seed)
                groups.setdefault(w.model, {}).setdefault(key, []).append(w.worker_id)
        for (role, model), pool_workers in members.items():
            pool = _Pool.build(role, sorted(pool_workers, key=lambda w: w.worker_id), config)
            table.pools[(role, model)] = pool
            for worker_id, i in pool.positions.items():
                table._where[worker_id] = (pool, i)
        table.hash_groups = {
            model: [HashGroup(key, frozenset(ids)) for key, ids in by_key.items()] for model, by_key in groups.items()
        }
        table.kv_fingerprints = {model: frozenset(found) for model, found in fingerprints.items()}
        table.refresh_own(table._where, reservations)
        if others is not None:
            others.drain_changed()
            table.refresh_others(table._where, others)
        return table

    # -- kept in step ---------------------------------------------------------------------------

    def update(self, workers: Sequence[WorkerRecord]) -> bool:
        """Take a newer registry list in place when only the workers' reported loads changed (the
        usual heartbeat), touching only the records that are new objects; False when a worker came,
        went or changed what it is (then build a new table)."""
        positions = self.changed_positions(workers)
        if positions is None:
            return False
        self.take_records(workers, positions)
        self.workers = workers
        return True

    def serves(self, model: str) -> bool:
        """Whether some worker in the table serves ``model``."""
        return (ROLE_DECODE, model) in self.pools or (ROLE_PREFILL, model) in self.pools

    def changed_positions(
        self, workers: Sequence[WorkerRecord], start: int = 0, stop: int | None = None
    ) -> list[int] | None:
        """The positions in ``workers[start:stop]`` whose record is a new object with the same identity
        (only its load changed); None when ``workers`` is not the same fleet (a worker came, went or
        changed what it is)."""
        if len(workers) != len(self.workers):
            return None
        stop = len(workers) if stop is None else min(stop, len(workers))
        positions: list[int] = []
        old_workers = self.workers
        for i in range(start, stop):
            new, old = workers[i], old_workers[i]
            if new is old:
                continue
            if _identity(new) != _identity(old):
                return None
            positions.append(i)
        return positions

    def take_records(self, workers: Sequence[WorkerRecord], positions: Iterable[int]) -> None:
        """Take the reported loads of ``workers[i]`` for each of ``positions`` (from
        :meth:`changed_positions`); the table's list stays the old one until the caller sets
        ``workers``."""
        for position in positions:
            new = workers[position]
            pool, i = self._where[new.worker_id]
            pool.adapters.update(i, pool.workers[i], new)
            pool.workers[i] = new
            columns = pool.columns
            columns["capacity_tokens"][i] = formulas.capacity_tokens(new, self.config)
            columns["reported_tokens"][i] = formulas.reported_tokens(new)
            columns["kv_usage"][i] = new.load.kv_usage
            pool.num_reported_requests[i] = new.load.num_running_requests + new.load.num_waiting_requests

    def refresh_own(self, worker_ids: Iterable[str], reservations: ReservationTable) -> None:
        """Re-read this replica's reservations on ``worker_ids`` (the ones that changed)."""
        tokens, young = reservations.token_snapshot()
        for worker_id in worker_ids:
            where = self._where.get(worker_id)
            if where is None:
                continue  # not registered (any more)
            pool, i = where
            columns = pool.columns
            columns["own_tokens"][i] = tokens.get(worker_id, 0)
            columns["own_young_tokens"][i] = young.get(worker_id, 0)
            columns["own_in_flight"][i] = reservations.num_in_flight(worker_id)
            columns["recent_tokens"][i], columns["recent_at_s"][i] = reservations.recent_tokens_at(worker_id)

    def refresh_others(self, worker_ids: Iterable[str], others: OtherReplicaLoads) -> None:
        """Re-read the other replicas' holds on ``worker_ids``."""
        for worker_id in worker_ids:
            where = self._where.get(worker_id)
            if where is None:
                continue
            pool, i = where
            columns = pool.columns
            columns["others_tokens"][i] = others.others_tokens(worker_id)
            columns["others_young_tokens"][i] = others.others_young_tokens(worker_id)
            columns["others_in_flight"][i] = others.others_in_flight(worker_id)
            recent = others.others_recent_tokens_at(worker_id)
            columns["others_recent_tokens"][i], columns["others_recent_at_s"][i] = recent

    def sync_index_slots(self, index: IndexSlots) -> None:
        """Read each worker's KV-index slot again when the index gave or took any."""
        if index.slots_version == self._index_version:
            return
        self._index_version = index.slots_version
        for pool in self.pools.values():
            pool.columns["index_slot"][:] = np.fromiter(
                (index.slot_of(w.worker_id) for w in pool.workers), np.int64, len(pool.workers)
            )

    # -- one decision -------------------------------------------------------------------------

    def arrays(
        self,
        role: str,
        model: str,
        cached: CachedPrefix | Mapping[str, int] | None,
        now_s: float,
        index: IndexSlots | None = None,
    ) -> PoolArrays | None:
        """The pool of ``role`` serving ``model`` as this decision sees it; None when there is none.
        ``cached``: the request's prefix lookup (or prompt tokens cached per worker id); ``index``:
        where prefill workers' KV fullness comes from (the blocks their events say they hold)."""
        pool = self.pools.get((role, model))
        if pool is None:
            return None
        indexed = _NO_INDEX
        if role != ROLE_DECODE and index is not None:
            indexed = index.num_blocks_by_slot()
        budgets = np.empty(len(pool.workers), BUDGETS)
        kernels.budget_state(role == ROLE_DECODE, pool.numbers, now_s, self.recent_half_life_s, indexed, budgets)
        return PoolArrays.of_budgets(
            role,
            pool.workers,
            pool.columns["capacity_tokens"],
            budgets,
            pool.num_reported_requests,
            self._cached(pool, cached),
            pool.worker_keys,
            pool.positions,
            pool.adapters,
        )

    @staticmethod
    def _cached(pool: _Pool, cached: CachedPrefix | Mapping[str, int] | None) -> F64:
        out = np.zeros(len(pool.workers))
        if isinstance(cached, CachedPrefix):
            # vLLM recomputes at least the last prompt token even on a full hit.
            max_tokens = float(max(0, cached.num_prompt_tokens - 1))
            for config, blocks_by_slot in cached.blocks_by_config.items():
                positions = pool.positions_by_config.get(config)
                if positions is not None and positions.size:
                    kernels.credit_cached(
                        out, positions, pool.columns["index_slot"], blocks_by_slot, config[0], max_tokens
                    )
        elif cached:
            for worker_id, num_tokens in cached.items():
                i = pool.positions.get(worker_id)
                if i is not None:
                    out[i] = num_tokens
        return out
