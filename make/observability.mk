# Observability part: the real Prometheus (Debian's package, with promtool) that the live-query
# test runs against the local stack and that checks the chart's alert rules. Included from the
# Makefile, which defines the `test` target.
#
#   make prometheus   install Debian's prometheus (/usr/bin/prometheus, /usr/bin/promtool)

PROMETHEUS ?= /usr/bin/prometheus

.PHONY: prometheus

prometheus:  ## install Debian's prometheus and promtool (apt; skipped when present)
	@if [ -x "$(PROMETHEUS)" ] && command -v promtool >/dev/null; then echo "[prometheus] $(PROMETHEUS) present"; \
	else echo "[prometheus] installing prometheus with apt-get"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; fi

test: prometheus

.PHONY: autoscale-demo

# The operator's loop (real signal path and decisions, SIMULATED workers) under a 10x ramp; ~10 min.
# AUTOSCALE_DEMO_ARGS="--scenario short-chats,long-prompts": one pool's load each (~6 min each).
autoscale-demo: setup redis loadtest-setup k8s-setup prometheus  ## the operator's autoscaling loop on this machine under a 10x ramp: reports/autoscale-demo/ (PNG, decision log)
	$(PY) loadtest/autoscale_demo.py $(AUTOSCALE_DEMO_ARGS)

.PHONY: autoscale-scenarios

# The two one-pool ramps as a test (tests/integration/test_autoscale_scenarios.py); ~12 min, so not in `make test`.
autoscale-scenarios: setup redis loadtest-setup k8s-setup prometheus  ## short chats grow prefill one step at most, long prompts decode one step at most (SIMULATED workers)
	TANDEM_AUTOSCALE_SCENARIOS=1 $(PY) -m pytest tests/integration/test_autoscale_scenarios.py --durations=5
