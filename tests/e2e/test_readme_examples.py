"""The shipped examples, applied as written (``kubectl apply -f examples/...``), run on the real
cluster, in a namespace as a user makes it: the chart's admission policy gives every pod with a
claim the controller's scheduling gate, so the controller places all of them (none of the examples
writes the gate itself), and kube-scheduler binds.

On the local cluster busybox:1.36 and registry.k8s.io/pause:3.10 are our own images under those
names (hack/localcluster/images.py), since nothing can be pulled.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from e2e_support import REPO_ROOT, kubectl, list_items, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

EXAMPLES = REPO_ROOT / "examples"
# file -> the pods it makes (gangs/workload-podgroup.yaml shows one pod of a gang of 4: alone it
# waits, as it should)
CASES: dict[str, int] = {
    "inference-fractional.yaml": 3,
    "whole-gpu-pod.yaml": 1,
    "cel-selection.yaml": 1,
    "gpu-nic-training.yaml": 1,
    "gang-job.yaml": 4,
}


def _settled(namespace: str, expected: int) -> list[dict[str, Any]] | None:
    pods = list_items("pods", "-n", namespace)
    phases = [p.get("status", {}).get("phase") for p in pods]
    assert "Failed" not in phases, json.dumps([p["status"] for p in pods])[:2000]
    if len(pods) >= expected and all(phase in ("Running", "Succeeded") for phase in phases):
        return pods
    return None


@pytest.mark.parametrize("example", list(CASES))
def test_the_example_runs_as_written(user_namespace: str, example: str) -> None:
    namespace = user_namespace
    expected = CASES[example]
    kubectl("apply", "-n", namespace, "-f", str(EXAMPLES / example))
    pods = wait_for(lambda: _settled(namespace, expected), timeout=300, what=f"the pods of {example}")
    assert len(pods) == expected
    for claim in list_items("resourceclaims", "-n", namespace):
        assert claim.get("status", {}).get("allocation"), claim["metadata"]["name"]
