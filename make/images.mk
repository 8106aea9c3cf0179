# Images part: the five images from docker/*.Dockerfile, built and run without a Docker daemon.
# Included from the Makefile, which defines VENV, PY and the `test` target.
#
#   make images        build them with buildah (docker/build-images.sh): IMAGES="gateway router" for some,
#                      TANDEM_IMAGE_PREFIX / TANDEM_IMAGE_TAG for the names (localhost/tandem-<x>:dev)
#   make images-base   the Debian-built Python base (debootstrap) used where python:3.11-slim cannot be pulled
#   make images-test   the CPU images together under podman, a chat answer streamed through the gateway's
#
# Debian's podman, buildah, debootstrap (and runc where crun refuses the host's cgroups): `make images-tools`.

IMAGES ?= gateway router operator worker-cpu worker-gpu
IMAGES_TEST_ARGS ?=

.PHONY: images images-base images-test images-tools

images-tools:  ## install Debian's podman, buildah, debootstrap and runc (apt; skipped when present)
	@if command -v podman >/dev/null && command -v buildah >/dev/null && command -v debootstrap >/dev/null \
		&& command -v runc >/dev/null; then echo "[images] podman, buildah, debootstrap, runc present"; \
	else apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman buildah debootstrap runc; fi

images-base: images-tools  ## build localhost/tandem-base-debian:bookworm from Debian packages (debootstrap)
	docker/base/debian-base.sh

images: images-tools  ## build the five images with buildah from docker/*.Dockerfile (IMAGES=... for some)
	docker/build-images.sh $(IMAGES)

# Too slow for `make test` (the images' start alone takes minutes on two cores): a target of its own.
images-test: setup redis images-tools  ## the CPU images as containers (router, prefill, decode, gateway): SSE chat through the gateway's
	$(PY) -m pytest tests/images --durations=10 $(IMAGES_TEST_ARGS)

test: override PYTEST_ARGS += --ignore=tests/images
