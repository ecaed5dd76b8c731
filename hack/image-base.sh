#!/usr/bin/env bash
# Prints the base image for the Dockerfile's PYTHON_IMAGE, making sure it is in the local store:
#   1. $PYTHON_IMAGE when set (pulled if missing);
#   2. python:3.11-slim when it is present or can be pulled;
#   3. otherwise an equivalent base built here: `debootstrap --variant=minbase bookworm` with
#      python3 and python3-venv (Debian's Python 3.11), trimmed and imported as
#      localhost/fractional-dra-base:bookworm. Built once: the image, and its tarball under
#      build/image-base/, are reused by later runs. Needs root and debootstrap (installed from
#      Debian when missing).
# Environment: CONTAINER_RUNTIME, PYTHON_IMAGE, DEBIAN_MIRROR (default http://deb.debian.org/debian).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=/dev/null  # container-lib.sh is checked on its own
source "${repo_root}/hack/container-lib.sh"
container_detect

upstream="docker.io/library/python:3.11-slim"
local_base="localhost/fractional-dra-base:bookworm"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
cache_dir="${repo_root}/build/image-base"
tarball="${cache_dir}/bookworm-python3.tar"

log() { echo "image-base: $*" >&2; }

pull() {
  timeout 300 "${CTR[@]}" pull -q "$1" > /dev/null 2>&1
}

if [[ -n "${PYTHON_IMAGE:-}" ]]; then
  if ! image_exists "${PYTHON_IMAGE}" && ! pull "${PYTHON_IMAGE}"; then
    log "PYTHON_IMAGE=${PYTHON_IMAGE} is not in the local store and cannot be pulled"
    exit 1
  fi
  echo "${PYTHON_IMAGE}"
  exit 0
fi
for candidate in "${upstream}" "${local_base}"; do
  if image_exists "${candidate}"; then
    echo "${candidate}"
    exit 0
  fi
done
if pull "${upstream}"; then
  echo "${upstream}"
  exit 0
fi
log "${upstream} cannot be pulled; using a Debian bookworm base of our own (${local_base})"

import_tarball() {
  "${CTR[@]}" import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    "${tarball}" "${local_base}" > "${cache_dir}/import.log" 2>&1 || {
    log "import failed:"
    cat "${cache_dir}/import.log" >&2
    exit 1
  }
}

if [[ ! -s "${tarball}" ]]; then
  if [[ "$(id -u)" != 0 ]]; then
    log "debootstrap needs root; run as root once, or set PYTHON_IMAGE to a Python 3.11 image you can pull"
    exit 1
  fi
  if ! command -v debootstrap > /dev/null 2>&1; then
    log "installing debootstrap from Debian"
    timeout 300 apt-get update -qq
    DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -qq debootstrap > /dev/null
  fi
  mkdir -p "${cache_dir}"
  rootfs="$(mktemp -d "${cache_dir}/rootfs.XXXXXX")"
  cleanup() {
    # Never follow a leftover mount (proc, sys) out of the rootfs.
    for mount in proc sys dev/pts dev; do
      if mountpoint -q "${rootfs}/${mount}"; then umount -l "${rootfs}/${mount}" || true; fi
    done
    rm -rf --one-file-system "${rootfs}"
  }
  trap cleanup EXIT
  log "debootstrap --variant=minbase bookworm (python3, python3-venv) from ${mirror}"
  timeout 1200 debootstrap --variant=minbase --include=python3,python3-venv \
    bookworm "${rootfs}" "${mirror}" > "${cache_dir}/debootstrap.log" 2>&1 || {
    log "debootstrap failed; the last lines of ${cache_dir}/debootstrap.log:"
    tail -n 20 "${cache_dir}/debootstrap.log" >&2
    exit 1
  }
  # What python:3.11-slim leaves out too: package lists and caches, docs, man pages, locales.
  rm -rf "${rootfs}"/var/lib/apt/lists/* "${rootfs}"/var/cache/apt/* "${rootfs}"/var/cache/debconf/*-old \
    "${rootfs}"/var/log/* "${rootfs}"/usr/share/doc/* "${rootfs}"/usr/share/man/* \
    "${rootfs}"/usr/share/info/* "${rootfs}"/usr/share/locale/* "${rootfs}"/tmp/* "${rootfs}"/root/.cache
  cat > "${rootfs}/etc/dpkg/dpkg.cfg.d/01-slim" << 'CFG'
path-exclude /usr/share/doc/*
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
CFG
  tar -C "${rootfs}" --numeric-owner -cf "${tarball}.tmp" .
  mv "${tarball}.tmp" "${tarball}"
fi
import_tarball
log "imported ${local_base} ($(du -m "${tarball}" | cut -f1) MB tarball)"
echo "${local_base}"
