"""Tandem router: places each request on a (prefill, decode) worker pair.

The gateway calls it over gRPC (``tandem.v1.Router``: Schedule, Release) through
Ray Serve's gRPC proxy; it reads the live workers from the Redis worker
registry. Importing this package is light: Ray is imported only by
:mod:`tandem.router.deployment` and :mod:`tandem.router.__main__`, and the
gateway-side :mod:`tandem.common.router_client` needs only grpc.

Request path inside the router::

    deployment.RouterDeployment.Schedule          (Ray Serve replica, gRPC mapping)
      └── scheduler.Scheduler.schedule             (a façade, no Ray; built by replica.build_replica)
            ├── intake.WorkerIntake                (worker_view.CachedWorkerView's list → fleet.FleetTable)
            ├── placement.Placer                   (decide: KV index lookup, policy.RoutingPolicy's
            │                                       filter → score → pick; commit: reservations.ReservationTable)
            ├── waiting.WaitingRoom                (admission queue, its poller and drain)
            ├── handoff.HandOffs                   (other replicas' waiters, through the ledger)
            └── gauges.Gauges                      (per-worker and per-pool gauges)
"""
