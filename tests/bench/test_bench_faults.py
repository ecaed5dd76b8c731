"""bench/bench_faults.py: the suite's record becomes one row per case, beside its work's baseline."""

from __future__ import annotations

from bench.bench_faults import rows_from


def test_each_fault_is_reported_beside_the_same_work_without_a_fault() -> None:
    record = {
        "gang/kube-apiserver-15s": {"seconds_to_all_running": 9.5, "seconds_to_all_bound": 4.75, "pods": 6},
        "shares/etcd-5s": {"seconds_to_all_running": 4.0, "seconds_to_all_bound": 2.0, "pods": 20},
        "gang/none": {"seconds_to_all_running": 3.25, "seconds_to_all_bound": 1.625, "pods": 6},
        "shares/none": {"seconds_to_all_running": 5.0, "seconds_to_all_bound": 2.5, "pods": 20},
        "shares-on-one-node/agent-pod-deleted": {
            "seconds_to_all_running": 12.0,
            "seconds_to_all_bound": 6.0,
            "pods": 10,
        },
    }
    rows = rows_from(record)
    assert [(r["work"].split()[0], r["fault"]) for r in rows] == [
        ("gang", "none"), ("gang", "kube-apiserver-15s"), ("20", "none"), ("20", "etcd-5s"),
        ("10", "agent-pod-deleted"),
    ]  # fmt: skip
    by_fault = {(r["work"], r["fault"]): r for r in rows}
    etcd = by_fault[("20 shares (2Gi, 5 %)", "etcd-5s")]
    assert (etcd["s to all bound"], etcd["s to all running"]) == (2.0, 4.0)
    assert (etcd["without a fault: bound"], etcd["without a fault: running"]) == (2.5, 5.0)
    assert by_fault[("10 shares on one node", "agent-pod-deleted")]["without a fault: running"] == ""
