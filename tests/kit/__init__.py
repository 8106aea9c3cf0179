"""Test doubles and helpers shared by the suites, each written once.

* :mod:`tests.kit.clock`: a clock a test moves by hand.
* :mod:`tests.kit.workers`: worker records, a fake registry and fixed views of them (router tests).
* :mod:`tests.kit.router`: a ``tandem.v1.Router`` gRPC servicer and the server around it; the real
  router as a process; a real replica in-process (``make_scheduler``, ``make_replica``: the
  deployment's own ``build_replica``).
* :mod:`tests.kit.gateway`: the gateway's doubles (fake workers over gRPC, an in-process router, readiness).
* :mod:`tests.kit.openai_server`: an OpenAI-compatible streaming server as an httpx transport (load test).
* :mod:`tests.kit.net` and :mod:`tests.kit.redis`: free ports, serving an ASGI app, raw HTTP clients,
  a private redis-server, Redis key clean-up.

Fakes stand in for one neighbour in a unit test; the integration and fault suites use real components.
"""
