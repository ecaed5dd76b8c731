#!/usr/bin/env bash
# Builds a kind node image with podman, from nothing that must be pulled: a Debian bookworm
# debootstrap (systemd, iptables, nftables, conntrack, iproute2, runc, ...), kind's base-image files
# (entrypoint, systemd units, containerd config: read from kind's Go module in the module cache at
# build time, not copied into this repository), and binaries built here from their Go modules by
# hack/upstream-build.sh: containerd, crictl, the CNI plugins, kubeadm, kubelet, kubectl, and the
# control-plane images kubeadm expects for the release (hack/images/kind_images.py: kube-apiserver,
# kube-controller-manager, kube-scheduler, kube-proxy, etcd, coredns; hack/images/build.py: pause),
# pre-loaded into the node's containerd as kind's own node images have them.
#
# The layout is what `kind create cluster` expects of a node (sigs.k8s.io/kind pkg/build/nodeimage):
# /kind/version, /kind/manifests/default-cni.yaml and default-storage.yaml, kubeadm, kubelet and
# kubectl in /usr/bin, /usr/local/bin/entrypoint, the images in /var/lib/containerd (namespace k8s.io).
# kindnetd is not served, so the pod network is ours: hack/kind-node/fractional-kind-cni.sh.
#
# Usage: hack/kind-node-image.sh            builds (or finds current) and prints the image name
# Environment:
#   K8S_VERSION           1.37.2 (default, the one tried); 1.36.3 has its pins below, untried
#   KIND_VERSION          0.33.0 (the kind whose base files are used)
#   KIND_NODE_IMAGE_NAME  default localhost/fractional-kind-node:v<K8S_VERSION>
#   DEBIAN_MIRROR         default http://deb.debian.org/debian
#   FRACTIONAL_CACHE      default ~/.cache/fractional-dra; the debootstrap base, the image archives
#                         and a stamp live in ${FRACTIONAL_CACHE}/kind-node/
#   FORCE=1               rebuild even when the stamp matches
# Needs root (debootstrap, chroot, a private containerd for the import), podman, Go (first run).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
log() { echo "kind-node-image: $*" >&2; }
die() {
  log "error: $*"
  exit 1
}

[[ "$(id -u)" == 0 ]] || die "needs root (debootstrap, chroot)"
command -v podman > /dev/null || die "needs podman"
command -v debootstrap > /dev/null || die "needs debootstrap (apt-get install debootstrap)"

k8s_version="${K8S_VERSION:-1.37.2}"
k8s_version="v${k8s_version#v}"
[[ "${k8s_version}" =~ ^v1\.([0-9]+)\. ]] || die "K8S_VERSION=${K8S_VERSION:-} is not a release"
k8s_minor="${BASH_REMATCH[1]}"
kind_version="${KIND_VERSION:-0.33.0}"
kind_version="v${kind_version#v}"
image="${KIND_NODE_IMAGE_NAME:-localhost/fractional-kind-node:${k8s_version}}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
cache="${FRACTIONAL_CACHE:-${HOME}/.cache/fractional-dra}"
work="${cache}/kind-node"
base_tar="${work}/bookworm-node-base.tar"
images_dir="${work}/images-${k8s_version}"
# kubeadm's image tags for etcd and coredns, per release (cmd/kubeadm/app/constants).
case "${k8s_minor}" in
  37) etcd_version=3.7.0 etcd_tag=3.7.0-0 coredns_version=1.14.6 ;;
  36) etcd_version=3.6.8 etcd_tag=3.6.8-0 coredns_version=1.14.2 ;; # untried: 1.37.2 is what ran
  *) die "no etcd/coredns pins for Kubernetes 1.${k8s_minor} (add them from kubeadm's constants.go)" ;;
esac
mkdir -p "${work}"

# -- binaries ---------------------------------------------------------------------------------------
log "binaries (hack/upstream-build.sh; the first run builds them)"
env_lines="$(K8S_VERSION="${k8s_version}" ETCD_VERSION="${etcd_version}" COREDNS_VERSION="${coredns_version}" \
  KIND_VERSION="${kind_version}" COMPONENTS="kind-node etcd kube-apiserver kube-controller-manager kube-scheduler" \
  "${repo_root}/hack/upstream-build.sh")"
eval "${env_lines}"
kind_module="$(cd "${cache}" && GOMODCACHE="${cache}/go/mod" GOFLAGS=-modcacherw GOWORK=off GOTOOLCHAIN=local \
  go mod download -json "sigs.k8s.io/kind@${kind_version}" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
kind_files="${kind_module}/images/base/files"
[[ -d "${kind_files}" ]] || die "kind's base files are not in ${kind_module}"

# -- is the image current? ---------------------------------------------------------------------------
stamp_inputs() {
  local f
  for f in "${KUBE_BIN}"/{kubeadm,kubelet,kubectl,kube-apiserver,kube-controller-manager,kube-scheduler,kube-proxy} \
    "${ETCD_BIN}/etcd" "${COREDNS_BIN}/coredns" "${CONTAINERD_BIN}"/* "${CRICTL_BIN}/crictl" "${CNI_BIN}"/* \
    "${repo_root}"/hack/kind-node/* "${repo_root}/hack/kind-node-image.sh" "${repo_root}"/hack/images/{build,kind_images}.py \
    "${base_tar}"; do
    [[ -e "${f}" ]] && stat -c '%n %s %Y' "${f}"
  done
  echo "image ${image} kind ${kind_version}"
}
stamp="${work}/image-${k8s_version}.stamp"
if [[ "${FORCE:-0}" != 1 && -f "${stamp}" && -s "${base_tar}" ]] &&
  podman image exists "${image}" && [[ "$(stamp_inputs)" == "$(cat "${stamp}")" ]]; then
  log "${image} is current"
  echo "${image}"
  exit 0
fi

# -- the Debian base (cached) --------------------------------------------------------------------------
if [[ ! -s "${base_tar}" ]]; then
  base_root="$(mktemp -d "${work}/debootstrap.XXXXXX")"
  log "debootstrap bookworm (systemd, iptables, runc, ...) from ${mirror}"
  timeout 1800 debootstrap --variant=minbase \
    --include=systemd,conntrack,iptables,nftables,iproute2,ethtool,util-linux,mount,kmod,libseccomp2,pigz,e2fsprogs,bash,ca-certificates,curl,jq,procps,runc \
    bookworm "${base_root}" "${mirror}" > "${work}/debootstrap.log" 2>&1 || {
    tail -n 20 "${work}/debootstrap.log" >&2
    die "debootstrap failed (log: ${work}/debootstrap.log)"
  }
  rm -rf "${base_root}"/var/lib/apt/lists/* "${base_root}"/var/cache/apt/* "${base_root}"/var/log/* \
    "${base_root}"/usr/share/doc/* "${base_root}"/usr/share/man/* "${base_root}"/usr/share/info/* \
    "${base_root}"/usr/share/locale/* "${base_root}"/tmp/*
  tar -C "${base_root}" --numeric-owner -cf "${base_tar}.tmp" .
  mv "${base_tar}.tmp" "${base_tar}"
  rm -rf --one-file-system "${base_root}"
fi

# -- the control-plane images --------------------------------------------------------------------------
log "control-plane images for ${k8s_version} (hack/images/kind_images.py)"
python3 "${repo_root}/hack/images/kind_images.py" --out "${images_dir}" --kube-bin "${KUBE_BIN}" \
  --etcd-bin "${ETCD_BIN}" --coredns-bin "${COREDNS_BIN}" --kubernetes-version "${k8s_version}" \
  --etcd-tag "${etcd_tag}" --coredns-tag "v${coredns_version}" --base-layer "${base_tar}" > "${work}/archives.txt"
pause_line="$(python3 "${repo_root}/hack/images/build.py" pause --out "${images_dir}")"
echo "${pause_line}" >> "${work}/archives.txt"
pause_image="${pause_line#* }"

# -- the node's file system ------------------------------------------------------------------------------
rootfs="$(mktemp -d "${work}/rootfs.XXXXXX")"
containerd_pid=""
cleanup() {
  if [[ -n "${containerd_pid}" ]]; then
    kill "${containerd_pid}" 2> /dev/null || true
    wait "${containerd_pid}" 2> /dev/null || true
  fi
  for m in proc sys dev; do
    if mountpoint -q "${rootfs}/${m}"; then umount -l "${rootfs}/${m}" || true; fi
  done
  rm -rf --one-file-system "${rootfs}" "${work}/containerd-import"
}
trap cleanup EXIT
tar -C "${rootfs}" -xf "${base_tar}"

log "kind ${kind_version}'s base files (from ${kind_module})"
install -d -m 0755 "${rootfs}/kind" "${rootfs}/kind/bin" "${rootfs}/kind/manifests" "${rootfs}/etc/kubernetes/manifests"
install -m 0755 "${kind_files}"/usr/local/bin/* "${rootfs}/usr/local/bin/"
install -m 0755 "${kind_files}"/kind/bin/* "${rootfs}/kind/bin/"
(cd "${kind_files}/etc" && find . -type f) | while read -r f; do
  install -D -m 0644 "${kind_files}/etc/${f}" "${rootfs}/etc/${f}"
done
# Our sandbox image (hack/images/build.py's pause), not registry.k8s.io's, which cannot be pulled.
sed -i "s#^\([[:space:]]*sandbox_image[[:space:]]*=\).*#\1 \"${pause_image}\"#" "${rootfs}/etc/containerd/config.toml"
grep -q "sandbox_image = \"${pause_image}\"" "${rootfs}/etc/containerd/config.toml" ||
  die "kind's containerd config has no sandbox_image line to point at ${pause_image}"

log "binaries into the node"
install -m 0755 "${CONTAINERD_BIN}"/{containerd,ctr,containerd-shim-runc-v2} "${CRICTL_BIN}/crictl" "${rootfs}/usr/local/bin/"
install -d -m 0755 "${rootfs}/opt/cni/bin"
install -m 0755 "${CNI_BIN}"/* "${rootfs}/opt/cni/bin/"
install -m 0755 "${KUBE_BIN}"/{kubeadm,kubelet,kubectl} "${rootfs}/usr/bin/"
printf '%s' "${k8s_version}" > "${rootfs}/kind/version"
install -m 0644 "${repo_root}/hack/kind-node/default-cni.yaml" "${repo_root}/hack/kind-node/default-storage.yaml" \
  "${rootfs}/kind/manifests/"
install -m 0755 "${repo_root}/hack/kind-node/fractional-kind-cni.sh" "${rootfs}/kind/bin/"
install -m 0644 "${repo_root}/hack/kind-node/fractional-kind-cni.service" "${rootfs}/etc/systemd/system/"

log "systemd in a container: no units that need a real machine; kubelet, containerd and our CNI enabled"
find "${rootfs}/lib/systemd/system/sysinit.target.wants/" -name systemd-tmpfiles-setup.service -delete
rm -f "${rootfs}"/lib/systemd/system/multi-user.target.wants/* "${rootfs}"/etc/systemd/system/*.wants/* \
  "${rootfs}"/lib/systemd/system/local-fs.target.wants/* "${rootfs}"/lib/systemd/system/sockets.target.wants/*udev* \
  "${rootfs}"/lib/systemd/system/sockets.target.wants/*initctl* "${rootfs}"/lib/systemd/system/basic.target.wants/*
echo "ReadKMsg=no" >> "${rootfs}/etc/systemd/journald.conf"
ln -sf /usr/lib/systemd/systemd "${rootfs}/sbin/init"
chroot "${rootfs}" systemctl enable kubelet.service containerd.service undo-mount-hacks.service fractional-kind-cni.service
chroot "${rootfs}" systemctl mask systemd-binfmt.service
# containerd's base runtime spec: the default OCI spec with kind's product-files hook, no rlimits.
chroot "${rootfs}" /usr/local/bin/ctr oci spec |
  jq '.hooks.createContainer = ((.hooks.createContainer // []) + [{"path": "/kind/bin/mount-product-files.sh"}]) | del(.process.rlimits)' \
    > "${rootfs}/etc/containerd/cri-base.json"

# -- the images, into the node's containerd (a private containerd on the host, root in the rootfs) --------
log "loading $(wc -l < "${work}/archives.txt") images into the node's containerd"
import_dir="${work}/containerd-import"
rm -rf "${import_dir}"
mkdir -p "${import_dir}"
cat > "${import_dir}/config.toml" << TOML
version = 3
root = "${rootfs}/var/lib/containerd"
state = "${import_dir}/state"
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.cri.v1.runtime", "io.containerd.cri.v1.images", "io.containerd.nri.v1.nri", "io.containerd.internal.v1.opt", "io.containerd.snapshotter.v1.blockfile", "io.containerd.snapshotter.v1.erofs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs"]
[grpc]
  address = "${import_dir}/containerd.sock"
[ttrpc]
  address = "${import_dir}/containerd.sock.ttrpc"
TOML
"${CONTAINERD_BIN}/containerd" --config "${import_dir}/config.toml" > "${import_dir}/containerd.log" 2>&1 &
containerd_pid=$!
for _ in $(seq 1 50); do
  [[ -S "${import_dir}/containerd.sock" ]] && break
  sleep 0.2
done
[[ -S "${import_dir}/containerd.sock" ]] || {
  cat "${import_dir}/containerd.log" >&2
  die "the import containerd did not start"
}
while read -r archive ref; do
  "${CONTAINERD_BIN}/ctr" --address "${import_dir}/containerd.sock" --namespace k8s.io images import \
    --label io.cri-containerd.pinned=pinned --no-unpack "${archive}" > /dev/null
  log "  ${ref}"
done < "${work}/archives.txt"
"${CONTAINERD_BIN}/ctr" --address "${import_dir}/containerd.sock" --namespace k8s.io images ls -q >&2
kill "${containerd_pid}"
wait "${containerd_pid}" 2> /dev/null || true
containerd_pid=""

# -- the image ---------------------------------------------------------------------------------------------
log "podman import -> ${image}"
tar -C "${rootfs}" --numeric-owner -cf - . | podman import --quiet \
  --change 'ENTRYPOINT ["/usr/local/bin/entrypoint", "/sbin/init"]' \
  --change 'ENV container=docker' \
  --change 'STOPSIGNAL SIGRTMIN+3' \
  - "${image}" > /dev/null
stamp_inputs > "${stamp}"
log "built ${image}"
echo "${image}"
