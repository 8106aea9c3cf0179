"""One router replica assembled from its typed configuration: the one place that does it.

:class:`tandem.router.deployment.RouterDeployment` (each Serve replica), the benchmarks
(``benchmarks/router_fleet.py``, ``benchmarks/bench_router.py``) and the tests
(``tests/kit/router.py``'s ``make_scheduler``) call :func:`build_replica` with a
:class:`tandem.router.settings.RouterConfig`; what differs between them is not configuration but
what they plug in: the worker view (the registry's cache, or a fixed list), the metrics, the
ledger's identity and secret, a clock. Settings groups are passed down whole (``config.queue`` to
the waiting room, ``config.budget`` as the budget), never copied field by field.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from tandem.common.registry import WorkerRegistry
from tandem.router.budget import BudgetConfig
from tandem.router.fair_share import TenantShares
from tandem.router.intake import WorkerView
from tandem.router.kv_index import KVIndex
from tandem.router.kv_subscriber import KVEventSubscriber
from tandem.router.ledger import Ledger
from tandem.router.metrics import NullRouterMetrics, RouterMetrics
from tandem.router.policy import create_policy
from tandem.router.reservations import ReservationTable
from tandem.router.scheduler import Scheduler
from tandem.router.settings import RouterConfig
from tandem.router.worker_view import CachedWorkerView


@dataclass(frozen=True)
class LedgerIdentity:
    """Who this replica is among the replicas that share budgets through Redis (the ledger)."""

    replica_id: str
    #: The secret every replica tags and checks the ledger's messages with (at least 16 bytes).
    secret: bytes
    #: The ledger's Redis keys and channel; None: ``registry.key_prefix`` (the replicas of one
    #: router share it; another prefix makes a ledger alone, as the fleet benchmark's oracle).
    key_prefix: str | None = None


@dataclass(frozen=True)
class KVEventDrops:
    """Fault injection for tests and benchmarks only: that fraction of live KV-event messages is
    discarded on receipt (:class:`tandem.router.kv_subscriber.KVEventSubscriber`'s ``drop_fraction``)."""

    fraction: float
    seed: int = 0


@dataclass(frozen=True)
class Replica:
    """A replica's parts: the scheduler façade and the stateful pieces it was built with."""

    scheduler: Scheduler
    index: KVIndex
    #: None when the replica does not follow KV events (a test feeds the index itself).
    subscriber: KVEventSubscriber | None
    #: None for a replica alone (no Redis).
    ledger: Ledger | None
    #: The registry the replica's view reads (None when the caller brought its own view).
    registry: WorkerRegistry | None = None

    async def aclose(self) -> None:
        if self.subscriber is not None:
            await self.subscriber.aclose()
        if self.ledger is not None:
            await self.ledger.aclose()
        if self.registry is not None:
            await self.registry.aclose()


def young_s(config: RouterConfig) -> float:
    """How long a reservation counts as young: its worker's reports may not show it yet (two
    heartbeats and a second)."""
    return 2 * config.registry.heartbeat_interval_s + 1.0


def build_replica(
    config: RouterConfig,
    view: WorkerView | None = None,
    *,
    metrics: RouterMetrics | None = None,
    ledger: LedgerIdentity | None = None,
    follow_kv_events: bool = True,
    kv_event_drops: KVEventDrops | None = None,
    subscriber: KVEventSubscriber | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Replica:
    """A router replica: its scheduler over ``view`` (by default, the registry's workers through a
    short cache, :class:`tandem.router.worker_view.CachedWorkerView`), its KV index (fed by a KV-event subscriber
    unless ``follow_kv_events`` is False; ``subscriber``: one already following the workers, shared
    with another replica: the real-engine benchmark compares two policies over one index), its
    reservation table on ``clock``, and, when ``ledger`` names it, its ledger on ``config.redis``
    (started by the caller with ``ledger.start()``)."""
    metrics = metrics or NullRouterMetrics()
    redis_url = config.redis.connection_url()  # the router's own Redis user (tandem.common.redis_acl)
    registry: WorkerRegistry | None = None
    if view is None:
        registry = WorkerRegistry(redis_url, key_prefix=config.registry.key_prefix, ttl_s=config.registry.ttl_s)
        view = CachedWorkerView(
            registry,
            refresh_interval_s=config.registry_refresh_interval_s,
            max_stale_s=config.registry.ttl_s,
            refresh_in_background=True,  # a Schedule never waits for the registry read (worker_view)
            removal_check_interval_s=config.registry_removal_check_interval_s,
        )
    queue = config.queue
    shared: Ledger | None = None
    if ledger is not None:
        # The tenants' fair share is the router's: the ledger shares it with the other replicas.
        shares = TenantShares(half_life_s=queue.fair_share_half_life_s, weights=dict(queue.tenant_weights))
        shared = Ledger(
            redis_url,
            key_prefix=ledger.key_prefix or config.registry.key_prefix,
            replica_id=ledger.replica_id,
            secret=ledger.secret,
            max_replicas=config.ledger.max_replicas,
            max_message_age_s=config.ledger.max_message_age_s,
            metrics=metrics,
            lease_s=config.lease_s,
            young_s=young_s(config),
            flush_interval_s=config.ledger.flush_interval_s,
            snapshot_interval_s=config.replica_sync_interval_s,
            ttl_s=config.ledger.replica_ttl_s,
            shares=shares,
        )
    index = KVIndex(max_blocks_per_worker=config.kv_index.max_blocks_per_worker)
    if subscriber is not None:
        index = subscriber.index
    elif follow_kv_events:
        drops = kv_event_drops or KVEventDrops(0.0)
        subscriber = KVEventSubscriber(
            index,
            replay_timeout_s=config.kv_index.replay_timeout_s,
            catch_up_interval_s=config.kv_index.catch_up_interval_s,
            drop_fraction=drops.fraction,
            drop_seed=drops.seed,
        )
    scheduler = Scheduler(
        view,
        create_policy(config.policy, config.weights),
        ReservationTable(lease_s=config.lease_s, young_s=young_s(config), clock=clock),
        metrics,
        budget=BudgetConfig(**config.budget.model_dump()),
        index=index,
        subscriber=subscriber,
        ledger=shared,
        queue=queue,
        min_uncached_tokens_to_disaggregate=config.disaggregation.min_uncached_tokens,
        burst_stall_weight=(
            config.disaggregation.burst_stall_weight if config.disaggregation.burst_local_prefill else None
        ),
    )
    return Replica(scheduler, index, subscriber, shared, registry)
