"""A claim reserved for a PodGroup (KEP-5729: ``status.reservedFor`` names the PodGroup, not the
pods) is prepared like any other: the agent never requires a pod consumer."""

from __future__ import annotations

from collections.abc import Callable

from driver.cluster.kubelet import KubeletSimulator
from driver.plugin.agent import NodeAgent
from tests.plugin.conftest import Claims, NodeDirs, new_share_id, result


def test_a_claim_reserved_for_a_podgroup_is_prepared(
    start_agent: Callable[..., NodeAgent],
    node_dirs: NodeDirs,
    claims: Claims,
) -> None:
    start_agent()
    kubelet = KubeletSimulator(node_dirs.registry, kubelet_version="1.35")
    try:
        kubelet.register()
        ref = claims.create(
            "team-shared", [result("gpu-0", share_id=new_share_id(), memory="2Gi", compute="10")]
        )
        claims.reserve(
            "team-shared",
            [
                {
                    "apiGroup": "scheduling.k8s.io",
                    "resource": "podgroups",
                    "name": "team",
                    "uid": "0f6f0c2e-6c1a-4d1e-9a57-1c1d1f0e2a11",
                }
            ],
        )
        answer = kubelet.prepare([ref])
        assert answer[ref["uid"]]["error"] == ""
        assert [d["device_name"] for d in answer[ref["uid"]]["devices"]] == ["gpu-0"]
        assert kubelet.unprepare([ref]) == {ref["uid"]: {"error": ""}}
    finally:
        kubelet.close()
