# Load testing (loadtest/, docs/loadtest.md). Included from the Makefile, which defines VENV and PY.
#
#   make loadtest                                  short mixed run against a fresh local stack
#   make loadtest TANDEM_LOADTEST_URL=http://...   the same workload against a running deployment
#   make loadtest LOADTEST_ARGS="--arrival concurrency:4 --num-requests 50"
#   make loadtest-sweep                            capacity sweep (knee, per-worker capacity) on a fresh local stack
#   make loadtest-sweep SWEEP_ARGS="--rates 0.5,1,2,4 --slo ttft:3000 itl:250"

LOADTEST_ARGS ?=
LOADTEST_STAMP := $(VENV)/.tandem-stamps/loadtest-$(shell cat loadtest/pyproject.toml | sha256sum | cut -c1-16)

SWEEP_ARGS ?=

.PHONY: loadtest-setup loadtest loadtest-sweep

loadtest-setup: $(LOADTEST_STAMP)  ## install the load tester (pip install -e loadtest)

$(LOADTEST_STAMP): loadtest/pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e loadtest
	@mkdir -p $(dir $@) && rm -f $(dir $@)loadtest-* && touch $@

# The unit tests in tests/unit/loadtest import the package.
test: loadtest-setup

# A deployment URL needs only the tool; the local stack needs the whole setup and Redis.
loadtest: loadtest-setup $(if $(TANDEM_LOADTEST_URL),,setup redis)  ## load-test the local stack (or $$TANDEM_LOADTEST_URL); report in reports/
	TANDEM_LOADTEST_URL="$(TANDEM_LOADTEST_URL)" $(PY) loadtest/run_local.py $(LOADTEST_ARGS)

loadtest-sweep: loadtest-setup $(if $(TANDEM_LOADTEST_URL),,setup redis)  ## capacity sweep of the local stack (or $$TANDEM_LOADTEST_URL): knee, plot, capacity.json in reports/
	TANDEM_LOADTEST_URL="$(TANDEM_LOADTEST_URL)" $(PY) loadtest/run_local.py sweep $(SWEEP_ARGS)
