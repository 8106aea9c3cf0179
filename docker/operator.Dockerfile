# syntax=docker/dockerfile:1
# Tandem operator (kopf): reconciles TandemDeployment, scales the pools.
#   docker build -f docker/operator.Dockerfile -t tandem-operator .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# The build's pip index configuration (docker/build-images.sh passes the host's; unset: PyPI).
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_CERT
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY requirements/constraints.txt requirements/constraints.txt
COPY operators operators
# tandem-common: the adapter catalog the operator writes (tandem.common.adapters, .errors, .redis_retry:
# none of them imports the generated tandem.v1 stubs, so no protoc step here).
COPY services/common services/common
RUN python -m venv /opt/venv && /opt/venv/bin/pip install -c requirements/constraints.txt ./services/common ./operators

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="tandem-operator"
ENV PATH=/opt/venv/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp
COPY --from=build /opt/venv /opt/venv
RUN groupadd --gid 10001 tandem && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin tandem
USER 10001:10001
EXPOSE 8081
HEALTHCHECK --interval=15s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8081/healthz', timeout=2)"]
ENTRYPOINT ["python", "-m", "tandem_operator"]
# The chart replaces these with its own (--namespace for each watched namespace).
CMD ["--liveness=http://0.0.0.0:8081/healthz", "--all-namespaces"]
