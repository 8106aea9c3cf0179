# syntax=docker/dockerfile:1
# Tandem worker on NVIDIA GPUs: vllm 0.32.0 on a CUDA runtime base.
#   docker build -f docker/worker-gpu.Dockerfile -t tandem-worker-gpu .
# Ubuntu 22.04 ships python3.11 (24.04 has 3.12 only).
# vllm 0.32.0's PyPI wheels bring torch 2.13.0+cu130 and the CUDA 13 user-space libraries as nvidia-* wheels
# (docs/images.md): torch does not use the base's CUDA runtime, and the node needs a CUDA 13.0 driver (R580+).
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu22.04

FROM ${CUDA_IMAGE} AS build
# The build's pip index configuration (docker/build-images.sh passes the host's; unset: PyPI).
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_CERT
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
RUN apt-get update && apt-get install -y --no-install-recommends python3.11=3.11.* python3.11-venv=3.11.* \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY requirements/constraints.txt requirements/constraints.txt
RUN python3.11 -m venv /opt/venv && /opt/venv/bin/pip install -c requirements/constraints.txt grpcio-tools
RUN /opt/venv/bin/pip install -c requirements/constraints.txt vllm==0.32.0
COPY protos protos
COPY services/common services/common
COPY services/worker services/worker
RUN /opt/venv/bin/python -m grpc_tools.protoc -Iprotos --python_out=services/common \
        --grpc_python_out=services/common --pyi_out=services/common protos/tandem/v1/*.proto \
    && /opt/venv/bin/pip install -c requirements/constraints.txt ./services/common ./services/worker \
    && /opt/venv/bin/pip uninstall -y grpcio-tools

FROM ${CUDA_IMAGE}
LABEL org.opencontainers.image.title="tandem-worker-gpu"
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update && apt-get install -y --no-install-recommends python3.11=3.11.* libnuma1=2.0.* \
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
HEALTHCHECK --interval=15s --timeout=3s --start-period=900s --retries=3 \
    CMD ["python", "-c", "import socket; socket.create_connection(('127.0.0.1', 50051), 2).close()"]
ENTRYPOINT ["python", "-m", "tandem.worker"]
CMD ["--role", "decode"]
