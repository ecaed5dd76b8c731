"""Recovery from faults of the real control plane and of the nodes, on the local cluster.

Runs the fault suite (``tests/e2e/test_faults_real.py``) on a fresh local cluster of upstream
binaries (``hack/localcluster``, release ``K8S_VERSION``, default 1.37.2, the driver installed with
its chart, two controller replicas), then reports what the suite recorded: for each fault and each
kind of work (a burst of 20 shares created at once, a gang of 6 pods), the seconds from the fault's
end (the killed component answering its health check again, or the pod deleted) until every pod of
the work runs, beside the same work without a fault. The suite itself asserts the invariants (every
pod runs, no device past its capacity, no half gang, each node's CDI specs exactly its prepared
claims, no restart of any container of the driver); the times are only recorded, never asserted.

One sample per case: each costs a fault of the whole cluster, and the suite's run is about a quarter
of an hour. Read the figures as "seconds, not minutes", not to a tenth.

Writes bench/results/faults.json. Needs root and the upstream binaries (built as for
``make cluster-up`` when missing); no other local cluster may be up. Run:
    .venv/bin/python bench/bench_faults.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import write_result  # noqa: E402  (after the path, as the other benches)

RECORD = ROOT / ".cluster" / "fault-recovery.json"
SUITE = "tests/e2e/test_faults_real.py"
WORK = {"shares": "20 shares (2Gi, 5 %)", "gang": "gang of 6 (4Gi, 5 % each)",
        "shares-on-one-node": "10 shares on one node"}  # fmt: skip


def rows_from(record: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per recorded case, with the same work's no-fault time beside it."""
    rows = []
    for case in sorted(record, key=lambda c: (c.split("/")[0], c.split("/")[1] != "none", c)):
        work, fault = case.split("/", 1)
        entry, baseline = record[case], record.get(f"{work}/none", {})
        rows.append({
            "work": WORK.get(work, work),
            "fault": fault,
            "s to all bound": float(entry["seconds_to_all_bound"]),
            "s to all running": float(entry["seconds_to_all_running"]),
            "without a fault: bound": float(baseline["seconds_to_all_bound"]) if baseline else "",
            "without a fault: running": float(baseline["seconds_to_all_running"]) if baseline else "",
            "pods": int(entry["pods"]),
        })  # fmt: skip
    return rows


def main() -> int:
    if os.geteuid() != 0:
        print("bench_faults: skipped: the local cluster's harness needs root", file=sys.stderr)
        return 0
    if (ROOT / ".cluster" / "state.json").exists():
        print("bench_faults: skipped: a local cluster is up (make cluster-down first)", file=sys.stderr)
        return 0
    python = sys.executable
    RECORD.unlink(missing_ok=True)
    up = subprocess.run([python, "hack/localcluster", "up"], cwd=ROOT, check=False)
    if up.returncode != 0:
        return up.returncode
    try:
        env = dict(
            os.environ,
            KUBECONFIG=str(ROOT / ".cluster" / "kubeconfig"),
            FRACTIONAL_E2E_LOCAL_CLUSTER="1",
            FRACTIONAL_E2E_REQUIRE="1",
            FRACTIONAL_E2E_IMAGE=os.environ.get(
                "FRACTIONAL_E2E_IMAGE", "localhost/fractional-e2e-workload:1"
            ),
            PATH=f"{Path(python).parent}:{os.environ.get('PATH', '')}",
        )
        suite = subprocess.run(
            [python, "-m", "pytest", "-n0", "-m", "e2e", "-p", "no:cacheprovider", SUITE],
            cwd=ROOT, env=env, check=False,
        )  # fmt: skip
        record = json.loads(RECORD.read_text(encoding="utf-8")) if RECORD.exists() else {}
    finally:
        subprocess.run([python, "hack/localcluster", "down"], cwd=ROOT, check=False, capture_output=True)
    if suite.returncode != 0:
        print("bench_faults: the fault suite failed; nothing recorded", file=sys.stderr)
        return suite.returncode
    notes = (
        "The fault suite (tests/e2e/test_faults_real.py) on a fresh local cluster (1.37.2, two kubelet\n"
        "nodes, the chart's two controller replicas). Each fault starts right after its work is applied;\n"
        "time runs from the fault's end (the component answering its health check again; the pod\n"
        "deleted) until every pod of the work is bound (our controller and kube-scheduler), and until\n"
        "every pod runs (the kubelets too). After every case the suite asserted: every pod running, no\n"
        "device past its capacity, the gang whole, each node's CDI specs exactly its prepared claims,\n"
        "and no container of the driver restarted. One sample per case.\n"
        "After a kube-apiserver restart, a kubelet that sees a pod bound before it can read the claim's\n"
        "reservation fails the pod's sandbox ('not allowed to use ResourceClaim') and tries again only\n"
        "on its next sync, up to a minute later: the gap between 'bound' and 'running' is the kubelet's."
    )
    path = write_result(
        "faults", rows_from(record), title="Faults of the control plane and the nodes: recovery", notes=notes
    )
    print(f"bench_faults: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
