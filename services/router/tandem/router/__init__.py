"""Tandem router: places each request on a (prefill, decode) worker pair.

The gateway calls it over gRPC (``tandem.v1.Router``: Schedule, Release) through
Ray Serve's gRPC proxy; it reads the live workers from the Redis worker
registry. Importing this package is light: Ray is imported only by
:mod:`tandem.router.deployment` and :mod:`tandem.router.__main__`, and the
gateway-side :mod:`tandem.common.router_client` needs only grpc.

Request path inside the router::

    deployment.RouterDeployment.Schedule      (Ray Serve replica, gRPC mapping)
      └── scheduler.Scheduler.schedule         (pure logic, no Ray)
            ├── worker_view.CachedWorkerView   (registry read through a short cache)
            ├── policy.RoutingPolicy            (filter → score → pick, chosen by name)
            └── reservations.ReservationTable   (in-flight leases, swept on expiry)
"""
