#!/usr/bin/env bash
# Copy the fake-device profiles (fake_devices/*.yaml) into the Helm chart, which ships them as a
# ConfigMap (.Files.Glob cannot reach outside the chart directory). tests/chart checks that the
# copies are equal to the originals; run this after changing a profile.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source_dir="${repo_root}/fake_devices"
target_dir="${repo_root}/charts/fractional-dra/files/profiles"

shopt -s nullglob
profiles=("${source_dir}"/*.yaml)
if [[ ${#profiles[@]} -eq 0 ]]; then
  echo "sync-chart-profiles: no profiles in ${source_dir}" >&2
  exit 1
fi

mkdir -p "${target_dir}"
# Drop copies whose original is gone, then copy every profile.
for copy in "${target_dir}"/*.yaml; do
  if [[ ! -e "${source_dir}/$(basename "${copy}")" ]]; then
    rm -- "${copy}"
    echo "removed $(basename "${copy}")"
  fi
done
for profile in "${profiles[@]}"; do
  cp -- "${profile}" "${target_dir}/"
  echo "copied $(basename "${profile}")"
done
