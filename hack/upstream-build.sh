#!/usr/bin/env bash
# Builds a real Kubernetes node's binaries from upstream's Go modules, at pinned versions, through
# the Go module proxy alone (no GitHub download, no prebuilt binary, no vendored upstream code), and
# caches them outside the checkout:
#   kubernetes  kube-apiserver, kube-controller-manager, kube-scheduler (CGO off, as upstream) and
#               kubelet (CGO on) from k8s.io/kubernetes ${K8S_VERSION}, default 1.37.2
#               (1.36.3 and 1.35.4 are the other releases the proxy serves);
#   etcd        go.etcd.io/etcd/server/v3: v3.7.3 for Kubernetes >= 1.37 (1.37's hack/lib/etcd.sh
#               pins 3.7.0), v3.6.16 below (the newest 3.6.x served);
#   containerd  containerd, containerd-shim-runc-v2, ctr from github.com/containerd/containerd/v2
#               v2.3.7 (the newest patch of 2.3, containerd's LTS branch), -tags no_btrfs;
#   cni         bridge, host-local, loopback, portmap from github.com/containernetworking/plugins
#               v1.10.0 (the newest v1.x served);
#   kueue       the manager (cmd/kueue) of sigs.k8s.io/kueue v0.19.2, the newest the proxy serves
#               (v0.19.3 and later, v0.20+ are refused), CGO off, its version stamped as upstream's
#               Makefile does (sigs.k8s.io/kueue/pkg/version.GitVersion).
#   kwok        sigs.k8s.io/kwok/cmd/kwok v0.8.0 (fake nodes for the fleet of hack/localcluster fleet),
#               CGO off; not part of `all`: COMPONENTS=kwok builds it.
#   kind node   (COMPONENTS=kind-node, never in all; what hack/kind-node-image.sh puts in a kind node
#               image) kubeadm, kubectl, kube-proxy (CGO off) from k8s.io/kubernetes beside the
#               four above; kind itself (sigs.k8s.io/kind v0.33.0, CGO off, as its Makefile);
#               crictl (sigs.k8s.io/cri-tools/cmd/crictl v1.37.0, the newest served); coredns
#               (github.com/coredns/coredns v1.14.6, the version kubeadm 1.37 deploys); and the
#               cni plugins, whose set includes ptp for kind's multi-node networking.
#   helm        helm.sh/helm/v4/cmd/helm v4.3.2 (what hack/kind-up.sh installs the chart with),
#               CGO off, version stamped as its Makefile does; never in all: COMPONENTS=helm.
# runc is not built: containerd needs Debian's (`apt-get install -y runc`); this script only checks
# that one is on PATH and says so when it is not (it installs nothing).
#
# k8s.io/kubernetes and go.etcd.io/etcd/server/v3 have replace directives, so `go install pkg@v` is
# refused for them. For each, the script generates a tiny module of its own under
# ${FRACTIONAL_CACHE}/src/ (no Go source: a go.mod with `tool` lines naming upstream's own main
# packages) and builds from there. For Kubernetes it adds one `replace k8s.io/X => k8s.io/X v0.Y.Z`
# per `=> ./staging/src/k8s.io/` line of the kubernetes go.mod, and copies its `go` and `godebug`
# lines. Flags follow upstream's hack/lib/golang.sh: -trimpath, -tags selinux,notest,grpcnotrace,
# -s -w, and the version stamped into k8s.io/component-base/version and k8s.io/client-go/pkg/version
# (gitVersion, gitMajor, gitMinor, gitTreeState=clean, buildDate = the module's publication time).
# containerd and the CNI plugins have no replace directives: `go install pkg@version`.
#
# Cache: ${FRACTIONAL_CACHE:-$HOME/.cache/fractional-dra}
#   go/mod (GOMODCACHE, written with -modcacherw so `rm -rf` works), go/build (GOCACHE),
#   src/kubernetes-vX, src/etcd-vX (the generated modules),
#   bin/kubernetes-vX/, bin/etcd-vX/, bin/containerd-vX/, bin/cni-vX/, bin/kueue-vX/, bin/kwok-vX/,
#   bin/kind-vX/, bin/crictl-vX/, bin/coredns-vX/, bin/helm-vX/ (the binaries).
# A component is skipped when its binaries exist and answer --version (or equivalent) with the
# right version. Concurrent runs wait for each other (flock on the cache).
#
# Usage: hack/upstream-build.sh [--print-env] [--help]
#   (no option)  build what is missing; progress and one line per component on stderr:
#                  upstream-build: <component> built|cached <seconds>s <dir>
#                then the environment lines (below) on stdout, so `eval "$(hack/upstream-build.sh)"`
#                builds if needed and sets them.
#   --print-env  never builds: prints the environment lines on stdout; exits 1 (lines still
#                printed, the missing components named on stderr) when a selected component is
#                missing or stale. Use: `paths="$(hack/upstream-build.sh --print-env)" && eval "${paths}"`.
#   Environment lines (paths whether built or not), then one export line:
#     KUBE_BIN=...  ETCD_BIN=...  CONTAINERD_BIN=...  CNI_BIN=...  KUEUE_BIN=...  KWOK_BIN=...
#     KIND_BIN=...  CRICTL_BIN=...  COREDNS_BIN=...  HELM_BIN=...
#     export KUBE_BIN ETCD_BIN CONTAINERD_BIN CNI_BIN KUEUE_BIN KWOK_BIN KIND_BIN CRICTL_BIN COREDNS_BIN HELM_BIN
# Environment:
#   K8S_VERSION         1.37.2 (default) | 1.36.3 | 1.35.4 (a leading v is accepted)
#   COMPONENTS          space/comma-separated, default all:
#                         all = etcd kube-apiserver kube-controller-manager kube-scheduler kubelet
#                               containerd cni kueue
#                         control-plane = etcd kube-apiserver kube-controller-manager kube-scheduler
#                         node = kubelet containerd cni;  kubernetes = the four kube binaries;
#                         kwok (never in all);
#                         kind-node = kubeadm kubectl kube-proxy kubelet containerd cni kind crictl
#                               coredns (never in all);  or any single name above
#   ETCD_VERSION, CONTAINERD_VERSION, CNI_VERSION, KUEUE_VERSION, KWOK_VERSION, KIND_VERSION,
#   CRICTL_VERSION, COREDNS_VERSION, HELM_VERSION   override the pins above
#   FRACTIONAL_CACHE    the cache directory
#   GO_BUILD_P          go build -p (default 2). Every go command runs under nice -n 19.
#
# Measured on this project's 2-core, 24 GiB VM (Go 1.26.8), K8S_VERSION=1.37.2, everything:
#   cold (empty cache, downloads and go mod tidy included, tests running beside it): etcd 75 s,
#   kube-apiserver 451 s (its first minute resolves the kubernetes module), kube-controller-manager
#   150 s, kube-scheduler 13 s, kubelet 464 s (CGO on: most packages compile again), containerd 94 s,
#   cni 14 s; 21 min in all, 2.5 GiB peak RSS. Warm (second run): 0.3 s in all.
#   Cache after that: 8.1 GiB = go/mod 1.4G + go/build 6.4G + bin 387M (kubernetes 275M, containerd
#   74M, etcd 24M, cni 15M) + src 92K. go/build may be deleted once built (only rebuilds need it).
#   COMPONENTS=kind-node and helm, cold after that (the kubernetes module resolved): kubeadm 22 s,
#   kubectl 21 s, kube-proxy 13 s, kind 6 s, crictl 31 s, coredns 131 s, helm 140 s, cni with ptp 2 s.
set -euo pipefail

log() { echo "upstream-build: $*" >&2; }
die() {
  log "error: $*"
  exit 2
}
usage() { sed -n '2,/^set -euo pipefail$/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; }

mode=build
for arg in "$@"; do
  case "${arg}" in
    --print-env) mode=print ;;
    -h | --help)
      usage
      exit 0
      ;;
    *) die "unknown argument ${arg} (see --help)" ;;
  esac
done

# -- versions -------------------------------------------------------------------------------------
version_of() { echo "v${1#v}"; } # 1.37.2 and v1.37.2 both give v1.37.2
k8s_version="$(version_of "${K8S_VERSION:-1.37.2}")"
[[ "${k8s_version}" =~ ^v1\.([0-9]+)\.([0-9]+)(-[0-9A-Za-z.-]+)?$ ]] ||
  die "K8S_VERSION=${K8S_VERSION:-} is not a Kubernetes release (1.37.2, 1.36.3, 1.35.4)"
k8s_minor="${BASH_REMATCH[1]}"
k8s_prerelease="${BASH_REMATCH[3]}"
staging_version="v0.${k8s_version#v1.}" # kubernetes#79384: staging v0.37.2 is v1.37.2
if ((k8s_minor >= 37)); then etcd_default=3.7.3; else etcd_default=3.6.16; fi
etcd_version="$(version_of "${ETCD_VERSION:-${etcd_default}}")"
containerd_version="$(version_of "${CONTAINERD_VERSION:-2.3.7}")"
cni_version="$(version_of "${CNI_VERSION:-1.10.0}")"
kueue_version="$(version_of "${KUEUE_VERSION:-0.19.2}")"
kwok_version="$(version_of "${KWOK_VERSION:-0.8.0}")"
kind_version="$(version_of "${KIND_VERSION:-0.33.0}")"
crictl_version="$(version_of "${CRICTL_VERSION:-1.37.0}")"
coredns_version="$(version_of "${COREDNS_VERSION:-1.14.6}")"
helm_version="$(version_of "${HELM_VERSION:-4.3.2}")"

cache="${FRACTIONAL_CACHE:-${HOME}/.cache/fractional-dra}"
kube_bin="${cache}/bin/kubernetes-${k8s_version}"
etcd_bin="${cache}/bin/etcd-${etcd_version}"
containerd_bin="${cache}/bin/containerd-${containerd_version}"
cni_bin="${cache}/bin/cni-${cni_version}"
kueue_bin="${cache}/bin/kueue-${kueue_version}"
kwok_bin="${cache}/bin/kwok-${kwok_version}"
kind_bin="${cache}/bin/kind-${kind_version}"
crictl_bin="${cache}/bin/crictl-${crictl_version}"
coredns_bin="${cache}/bin/coredns-${coredns_version}"
helm_bin="${cache}/bin/helm-${helm_version}"

kube_binaries=(kube-apiserver kube-controller-manager kube-scheduler kubelet)
kube_node_tools=(kubeadm kubectl kube-proxy) # named in the generated module too, built on demand
cni_plugins=(main/bridge main/ptp ipam/host-local main/loopback meta/portmap)

# -- components -----------------------------------------------------------------------------------
all_components=(etcd kube-apiserver kube-controller-manager kube-scheduler kubelet containerd cni kueue)
every_component=("${all_components[@]}" kwok kubeadm kubectl kube-proxy kind crictl coredns helm) # only when named
declare -A wanted=()
IFS=$', \t\n' read -ra names <<<"${COMPONENTS:-all}"
for name in "${names[@]}"; do
  case "${name}" in
    all) for c in "${all_components[@]}"; do wanted[${c}]=1; done ;;
    control-plane) for c in etcd kube-apiserver kube-controller-manager kube-scheduler; do wanted[${c}]=1; done ;;
    node) for c in kubelet containerd cni; do wanted[${c}]=1; done ;;
    kubernetes) for c in "${kube_binaries[@]}"; do wanted[${c}]=1; done ;;
    kind-node) for c in kubeadm kubectl kube-proxy kubelet containerd cni kind crictl coredns; do wanted[${c}]=1; done ;;
    etcd | kube-apiserver | kube-controller-manager | kube-scheduler | kubelet | containerd | cni | kueue | kwok | \
      kubeadm | kubectl | kube-proxy | kind | crictl | coredns | helm)
      wanted[${name}]=1
      ;;
    *) die "COMPONENTS: unknown component ${name} (all, control-plane, node, kubernetes, ${every_component[*]})" ;;
  esac
done
selected=()
for c in "${every_component[@]}"; do
  if [[ -n "${wanted[${c}]:-}" ]]; then selected+=("${c}"); fi
done
((${#selected[@]} > 0)) || die "COMPONENTS selects nothing"

print_env() {
  printf 'KUBE_BIN=%q\n' "${kube_bin}"
  printf 'ETCD_BIN=%q\n' "${etcd_bin}"
  printf 'CONTAINERD_BIN=%q\n' "${containerd_bin}"
  printf 'CNI_BIN=%q\n' "${cni_bin}"
  printf 'KUEUE_BIN=%q\n' "${kueue_bin}"
  printf 'KWOK_BIN=%q\n' "${kwok_bin}"
  printf 'KIND_BIN=%q\n' "${kind_bin}"
  printf 'CRICTL_BIN=%q\n' "${crictl_bin}"
  printf 'COREDNS_BIN=%q\n' "${coredns_bin}"
  printf 'HELM_BIN=%q\n' "${helm_bin}"
  echo "export KUBE_BIN ETCD_BIN CONTAINERD_BIN CNI_BIN KUEUE_BIN KWOK_BIN KIND_BIN CRICTL_BIN COREDNS_BIN HELM_BIN"
}

# -- is a component current? -------------------------------------------------------------------------
# answers FILE ARGS... PATTERN: FILE is executable and its output for ARGS contains PATTERN.
answers() {
  local file="$1" pattern="${*: -1}" out
  local -a args=("${@:2:$#-2}")
  [[ -x "${file}" ]] || return 1
  out="$(timeout 20 "${file}" "${args[@]}" </dev/null 2>&1 || true)"
  [[ "${out}" == *"${pattern}"* ]]
}

current() {
  local name="$1" plugin
  case "${name}" in
    kube-* | kubelet) answers "${kube_bin}/${name}" --version "Kubernetes ${k8s_version}" ;;
    kubeadm) answers "${kube_bin}/kubeadm" version -o short "${k8s_version}" ;;
    kubectl) answers "${kube_bin}/kubectl" version --client "Client Version: ${k8s_version}" ;;
    kind) answers "${kind_bin}/kind" version "kind ${kind_version} " ;;
    crictl) answers "${crictl_bin}/crictl" --version "crictl version ${crictl_version}" ;;
    coredns) answers "${coredns_bin}/coredns" -version "CoreDNS-${coredns_version#v}" ;;
    helm) answers "${helm_bin}/helm" version --short "${helm_version}" ;;
    etcd) answers "${etcd_bin}/etcd" --version "etcd Version: ${etcd_version#v}" ;;
    containerd)
      answers "${containerd_bin}/containerd" --version " ${containerd_version}" &&
        answers "${containerd_bin}/ctr" --version " ${containerd_version}" &&
        answers "${containerd_bin}/containerd-shim-runc-v2" -v "Version:  ${containerd_version}"
      ;;
    cni)
      for plugin in "${cni_plugins[@]}"; do
        # A plugin run without CNI_COMMAND prints "CNI <name> plugin <version>".
        answers "${cni_bin}/${plugin#*/}" "plugin ${cni_version}" || return 1
      done
      ;;
    # The manager has no --version flag: the build info names the module and its version.
    kueue) [[ -x "${kueue_bin}/kueue" ]] && go version -m "${kueue_bin}/kueue" 2>/dev/null |
      grep -q "mod[[:space:]]*sigs.k8s.io/kueue[[:space:]]*${kueue_version}" ;;
    kwok) [[ -x "${kwok_bin}/kwok" ]] && go version -m "${kwok_bin}/kwok" 2>/dev/null |
      grep -q "mod[[:space:]]*sigs.k8s.io/kwok[[:space:]]*${kwok_version}" ;;
  esac
}

if [[ "${mode}" == print ]]; then
  missing=()
  for c in "${selected[@]}"; do
    current "${c}" || missing+=("${c}")
  done
  print_env
  if ((${#missing[@]} > 0)); then
    log "missing or stale: ${missing[*]} (run hack/upstream-build.sh to build them)"
    exit 1
  fi
  exit 0
fi

# -- the Go environment -----------------------------------------------------------------------------
command -v go >/dev/null || die "go is not on PATH (Go 1.26 is needed)"
export GOMODCACHE="${cache}/go/mod" GOCACHE="${cache}/go/build"
# Only what this script passes: no GOFLAGS from the caller, no go.work, no toolchain download.
export GOFLAGS="-modcacherw" GOWORK=off GO111MODULE=on GOTOOLCHAIN=local
build_p="${GO_BUILD_P:-2}"
mkdir -p "${GOMODCACHE}" "${GOCACHE}" "${cache}/src" "${cache}/bin"

# One run at a time per cache: a second waits for the first, then finds everything cached.
if command -v flock >/dev/null; then
  exec 9>"${cache}/.lock"
  if ! flock -n 9; then
    log "another upstream-build.sh holds ${cache}/.lock: waiting"
    flock 9
  fi
fi

gonice() { nice -n 19 go "$@"; }

# module_field MODULE@VERSION TEMPLATE: go list -m -f for a module outside any main module.
module_field() { (cd "${cache}" && gonice list -m -f "$2" "$1"); }

# write_module DIR CONTENT: (re)generates DIR/go.mod and resolves it (go mod tidy) when CONTENT
# differs from what DIR was last resolved from.
write_module() {
  local dir="$1" content="$2"
  mkdir -p "${dir}"
  if [[ -f "${dir}/go.mod.in" && "$(cat "${dir}/go.mod.in")" == "${content}" && -f "${dir}/go.sum" ]]; then
    return 0
  fi
  log "resolving ${dir#"${cache}/"} (go mod tidy)"
  rm -f "${dir}/go.mod.in" "${dir}/go.sum"
  printf '%s\n' "${content}" >"${dir}/go.mod"
  (cd "${dir}" && gonice mod tidy)
  printf '%s\n' "${content}" >"${dir}/go.mod.in"
}

# -- kubernetes ---------------------------------------------------------------------------------------
kube_src="${cache}/src/kubernetes-${k8s_version}"
kube_module_ready=""
prepare_kube_module() {
  [[ -n "${kube_module_ready}" ]] && return 0
  local gomod staging content b
  gomod="$(module_field "k8s.io/kubernetes@${k8s_version}" '{{.GoMod}}')"
  [[ -f "${gomod}" ]] || die "no go.mod for k8s.io/kubernetes@${k8s_version}"
  staging="$(sed -n 's#^[[:space:]]*\(k8s\.io/[^[:space:]]*\)[[:space:]]*=>[[:space:]]*\./staging/src/k8s\.io/.*#\1#p' "${gomod}")"
  [[ -n "${staging}" ]] || die "no ./staging/src/k8s.io/ replace lines in ${gomod}"
  content="// Generated by hack/upstream-build.sh: builds upstream's own main packages.
module fractional-dra.local/upstream/kubernetes

$(grep -m1 '^go ' "${gomod}")
$(awk '/^godebug \(/ {block = 1} block || /^godebug / {print} block && /^\)/ {block = 0}' "${gomod}")

require k8s.io/kubernetes ${k8s_version}

tool (
$(for b in "${kube_binaries[@]}" "${kube_node_tools[@]}"; do printf '\tk8s.io/kubernetes/cmd/%s\n' "${b}"; done)
)

// One per ./staging/src/k8s.io/ replace of k8s.io/kubernetes's go.mod (which consumers ignore).
replace (
$(for m in ${staging}; do printf '\t%s => %s %s\n' "${m}" "${m}" "${staging_version}"; done)
)"
  write_module "${kube_src}" "${content}"
  kube_build_date="$(module_field "k8s.io/kubernetes@${k8s_version}" '{{.Time.UTC.Format "2006-01-02T15:04:05Z"}}')"
  kube_module_ready=1
}

build_kube() {
  local name="$1" cgo=0 ldflags="-s -w" pkg minor="${k8s_minor}"
  [[ "${name}" == kubelet ]] && cgo=1
  [[ -n "${k8s_prerelease}" ]] && minor="${minor}+"
  prepare_kube_module
  for pkg in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
    ldflags+=" -X ${pkg}.gitVersion=${k8s_version} -X ${pkg}.gitMajor=1 -X ${pkg}.gitMinor=${minor}"
    ldflags+=" -X ${pkg}.gitTreeState=clean -X ${pkg}.buildDate=${kube_build_date}"
  done
  mkdir -p "${kube_bin}"
  (cd "${kube_src}" && CGO_ENABLED="${cgo}" gonice build -p "${build_p}" -trimpath \
    -tags selinux,notest,grpcnotrace -ldflags "${ldflags}" \
    -o "${kube_bin}/.${name}.tmp" "k8s.io/kubernetes/cmd/${name}")
  mv -f "${kube_bin}/.${name}.tmp" "${kube_bin}/${name}"
}

# -- etcd -------------------------------------------------------------------------------------------
build_etcd() {
  local gomod dir="${cache}/src/etcd-${etcd_version}"
  gomod="$(module_field "go.etcd.io/etcd/server/v3@${etcd_version}" '{{.GoMod}}')"
  [[ -f "${gomod}" ]] || die "no go.mod for go.etcd.io/etcd/server/v3@${etcd_version}"
  # go.etcd.io/etcd/server/v3 is itself etcd's main package (main.go: etcdmain.Main(os.Args)).
  write_module "${dir}" "// Generated by hack/upstream-build.sh: builds etcd's own main package.
module fractional-dra.local/upstream/etcd

$(grep -m1 '^go ' "${gomod}")

require go.etcd.io/etcd/server/v3 ${etcd_version}

tool go.etcd.io/etcd/server/v3"
  mkdir -p "${etcd_bin}"
  (cd "${dir}" && CGO_ENABLED=0 gonice build -p "${build_p}" -trimpath -ldflags "-s -w" \
    -o "${etcd_bin}/.etcd.tmp" go.etcd.io/etcd/server/v3)
  mv -f "${etcd_bin}/.etcd.tmp" "${etcd_bin}/etcd"
}

# -- go install pkg@version into DIR (atomically per binary) ----------------------------------------
# install_into DIR CGO TAGS LDFLAGS PKG@VERSION...
install_into() {
  local dir="$1" cgo="$2" tags="$3" ldflags="$4" tmp f
  shift 4
  mkdir -p "${dir}"
  tmp="$(mktemp -d "${dir}/.install.XXXXXX")"
  if ! (cd "${cache}" && GOBIN="${tmp}" CGO_ENABLED="${cgo}" gonice install -p "${build_p}" \
    -trimpath ${tags:+-tags "${tags}"} -ldflags "${ldflags}" "$@"); then
    rm -rf "${tmp}"
    return 1
  fi
  for f in "${tmp}"/*; do mv -f "${f}" "${dir}/"; done
  rmdir "${tmp}"
}

build_containerd() {
  local p=github.com/containerd/containerd/v2 ldflags
  ldflags="-s -w -X ${p}/version.Version=${containerd_version} -X ${p}/version.Package=${p}"
  # As containerd's Makefile: the daemon and ctr with CGO (default), the shim static (CGO off).
  install_into "${containerd_bin}" 1 no_btrfs "${ldflags}" \
    "${p}/cmd/containerd@${containerd_version}" "${p}/cmd/ctr@${containerd_version}"
  install_into "${containerd_bin}" 0 no_btrfs "${ldflags}" \
    "${p}/cmd/containerd-shim-runc-v2@${containerd_version}"
}

build_cni() {
  local p=github.com/containernetworking/plugins plugin
  local -a pkgs=()
  for plugin in "${cni_plugins[@]}"; do pkgs+=("${p}/plugins/${plugin}@${cni_version}"); done
  install_into "${cni_bin}" 0 "" \
    "-s -w -X ${p}/pkg/utils/buildversion.BuildVersion=${cni_version}" "${pkgs[@]}"
}

build_kueue() {
  install_into "${kueue_bin}" 0 "" \
    "-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=${kueue_version}" \
    "sigs.k8s.io/kueue/cmd/kueue@${kueue_version}"
}

build_kwok() {
  install_into "${kwok_bin}" 0 "" "-s -w" \
    "sigs.k8s.io/kwok/cmd/kwok@${kwok_version}"
}

# kind's Makefile: CGO off, -trimpath, the version in sigs.k8s.io/kind/pkg/internal/kindversion.
build_kind() {
  install_into "${kind_bin}" 0 "" "-s -w -buildid=" "sigs.k8s.io/kind@${kind_version}"
}

build_crictl() {
  install_into "${crictl_bin}" 0 selinux \
    "-s -w -X sigs.k8s.io/cri-tools/pkg/version.Version=${crictl_version}" \
    "sigs.k8s.io/cri-tools/cmd/crictl@${crictl_version}"
}

build_helm() {
  install_into "${helm_bin}" 0 "" "-s -w -X helm.sh/helm/v4/internal/version.version=${helm_version}" \
    "helm.sh/helm/v4/cmd/helm@${helm_version}"
}

# coredns's Makefile stamps the git commit only; the version is a constant of the source.
build_coredns() {
  install_into "${coredns_bin}" 0 "" "-s -w" "github.com/coredns/coredns@${coredns_version}"
}

# -- run --------------------------------------------------------------------------------------------
now_ms() { echo $((${EPOCHREALTIME//[.,]/} / 1000)); }
dir_of() {
  case "$1" in
    etcd) echo "${etcd_bin}" ;;
    containerd) echo "${containerd_bin}" ;;
    cni) echo "${cni_bin}" ;;
    kueue) echo "${kueue_bin}" ;;
    kwok) echo "${kwok_bin}" ;;
    kind) echo "${kind_bin}" ;;
    crictl) echo "${crictl_bin}" ;;
    coredns) echo "${coredns_bin}" ;;
    helm) echo "${helm_bin}" ;;
    *) echo "${kube_bin}" ;;
  esac
}

# In braces: bash reads the whole block before running it, so editing this file (a git checkout)
# while a build runs cannot change what the running script does next.
{
  log "Kubernetes ${k8s_version}, etcd ${etcd_version}, containerd ${containerd_version}, CNI plugins ${cni_version}, Kueue ${kueue_version}; $(go version | cut -d' ' -f3); cache ${cache}"
  total_start="$(now_ms)"
  for c in "${selected[@]}"; do
    start="$(now_ms)"
    if current "${c}"; then
      state=cached
    else
      log "building ${c}"
      case "${c}" in
        etcd) build_etcd ;;
        containerd) build_containerd ;;
        cni) build_cni ;;
        kueue) build_kueue ;;
        kwok) build_kwok ;;
        kind) build_kind ;;
        crictl) build_crictl ;;
        coredns) build_coredns ;;
        helm) build_helm ;;
        *) build_kube "${c}" ;;
      esac
      current "${c}" || die "${c} was built but does not answer with the expected version"
      state=built
    fi
    elapsed="$(($(now_ms) - start))"
    log "$(printf '%-24s %-6s %6d.%01ds  %s' "${c}" "${state}" $((elapsed / 1000)) $((elapsed % 1000 / 100)) "$(dir_of "${c}")")"
  done
  elapsed="$(($(now_ms) - total_start))"
  log "$(printf '%-24s %-6s %6d.%01ds' total '' $((elapsed / 1000)) $((elapsed % 1000 / 100)))"

  if [[ -n "${wanted[containerd]:-}" ]] && ! command -v runc >/dev/null; then
    log "note: runc is not on PATH; containerd needs it (Debian: apt-get install -y runc)"
  fi
  print_env
  exit 0
}
