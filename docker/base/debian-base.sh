#!/usr/bin/env bash
# Builds the Python base image from Debian packages, for hosts that cannot pull python:3.11-slim-bookworm:
# debootstrap (minbase) of bookworm from the host's Debian mirror with python3.11 + venv, imported with
# podman as $TANDEM_BASE_IMAGE (default localhost/tandem-base-debian:bookworm). The images' Dockerfiles
# take it as PYTHON_IMAGE; bookworm's python3 is 3.11, the same minor version as the official image.
#   docker/base/debian-base.sh            # skips the build when the image exists
#   TANDEM_BASE_REBUILD=1 docker/base/debian-base.sh
set -euo pipefail
image="${TANDEM_BASE_IMAGE:-localhost/tandem-base-debian:bookworm}"
mirror="${DEBIAN_MIRROR:-$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)}"
mirror="${mirror:-http://deb.debian.org/debian}"
if [ -z "${TANDEM_BASE_REBUILD:-}" ] && podman image exists "$image"; then
    echo "[base] $image exists (TANDEM_BASE_REBUILD=1 rebuilds it)"
    exit 0
fi
work="$(mktemp -d "${TMPDIR:-/var/tmp}/tandem-base.XXXXXX")"
trap 'rm -rf "$work"' EXIT
echo "[base] debootstrap bookworm from $mirror into $work/rootfs"
nice -n 19 debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
    bookworm "$work/rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 || { tail -20 "$work/debootstrap.log"; exit 1; }
# What an image does not need: package lists and caches, docs, man pages, logs.
rm -rf "$work"/rootfs/var/lib/apt/lists/* "$work"/rootfs/var/cache/apt/*.bin "$work"/rootfs/var/cache/apt/archives/*.deb \
    "$work"/rootfs/usr/share/doc/* "$work"/rootfs/usr/share/man/* "$work"/rootfs/var/log/*.log
echo "[base] importing $image"
tar --numeric-owner -C "$work/rootfs" -c . | podman import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["python3"]' \
    --message "Debian bookworm minbase + python3.11 (tandem docker/base/debian-base.sh)" - "$image"
podman image inspect --format '{{.Id}} {{.Size}}' "$image"
