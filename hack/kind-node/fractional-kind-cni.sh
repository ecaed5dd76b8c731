#!/usr/bin/env bash
# The pod network of a kind node made by hack/kind-node-image.sh (kind's own kindnetd is not
# served here): every node gives its pods addresses from its spec.podCIDR with the ptp and
# host-local CNI plugins, and routes every other node's podCIDR through that node's address on the
# node containers' shared bridge. Runs as a systemd service on every node; every few seconds it
# reads the Nodes with the kubelet's own credentials and converges (idempotent).
set -uo pipefail

kubeconfig=/etc/kubernetes/kubelet.conf
conf_dir=/etc/cni/net.d
conf="${conf_dir}/10-fractional-ptp.conflist"
self="$(hostname)"

log() { echo "fractional-kind-cni: $*"; }

write_conf() {
  local cidr="$1" tmp
  tmp="$(mktemp "${conf_dir}/.conf.XXXXXX")"
  cat > "${tmp}" << CONF
{
  "cniVersion": "1.0.0",
  "name": "fractional-kind",
  "plugins": [
    {
      "type": "ptp",
      "ipMasq": false,
      "mtu": 1500,
      "ipam": {
        "type": "host-local",
        "dataDir": "/run/cni-ipam-state",
        "routes": [{"dst": "0.0.0.0/0"}],
        "ranges": [[{"subnet": "${cidr}"}]]
      }
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
CONF
  chmod 0644 "${tmp}"
  mv -f "${tmp}" "${conf}"
  log "wrote ${conf} for ${cidr}"
}

# Traffic from a pod to outside the cluster's pod subnets leaves with the node's address.
masquerade() {
  local cidr="$1"
  if ! iptables -t nat -C POSTROUTING -s "${cidr}" ! -d 10.0.0.0/8 -j MASQUERADE 2> /dev/null; then
    iptables -t nat -A POSTROUTING -s "${cidr}" ! -d 10.0.0.0/8 -j MASQUERADE
  fi
}

mkdir -p "${conf_dir}"
while true; do
  if [[ -s "${kubeconfig}" ]]; then
    nodes="$(kubectl --kubeconfig "${kubeconfig}" get nodes --request-timeout=10s -o \
      jsonpath='{range .items[*]}{.metadata.name}{" "}{.spec.podCIDR}{" "}{.status.addresses[?(@.type=="InternalIP")].address}{"\n"}{end}' \
      2> /dev/null)" || nodes=""
    while read -r name cidr address; do
      [[ -n "${name}" && -n "${cidr}" ]] || continue
      if [[ "${name}" == "${self}" ]]; then
        if ! grep -q "\"${cidr}\"" "${conf}" 2> /dev/null; then
          write_conf "${cidr}"
        fi
        masquerade "${cidr}"
      elif [[ -n "${address}" ]]; then
        ip route replace "${cidr}" via "${address%% *}"
      fi
    done <<< "${nodes}"
  fi
  sleep 5
done
