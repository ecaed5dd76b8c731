"""API objects the demo creates: DeviceClasses, Nodes, ResourceClaims and gated Pods. Pure builders."""

from __future__ import annotations

from typing import Any

from driver.slices import build_device_classes

__all__ = [
    "GATE",
    "GANG_LABEL",
    "GANG_SIZE_ANNOTATION",
    "build_claim",
    "build_device_classes",
    "build_node",
    "build_pod",
    "build_pod_group",
    "build_workload",
    "gpu_request",
    "nic_request",
]

GATE = "fractional.dev/allocation"
GANG_LABEL = "fractional.dev/gang"
GANG_SIZE_ANNOTATION = "fractional.dev/gang-size"
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"


def build_node(name: str, *, profile: str, zone: str) -> dict[str, Any]:
    allocatable = {"cpu": "192", "memory": "2000Gi", "pods": "110"}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "topology.kubernetes.io/zone": zone,
                "fractional.dev/profile": profile,
                "nvidia.com/gpu.present": "true",
            },
        },
        "status": {"allocatable": allocatable, "capacity": allocatable},
    }


def gpu_request(
    name: str = "gpu", *, memory: str | None = None, compute: int | None = None, selector: str | None = None
) -> dict[str, Any]:
    """A request for one GPU: a share when ``memory``/``compute`` are given, else the whole GPU."""
    exactly: dict[str, Any] = {"deviceClassName": "gpu.fractional.dev"}
    requests: dict[str, str] = {}
    if memory is not None:
        requests["memory"] = memory
    if compute is not None:
        requests["compute"] = str(compute)
    if requests:
        exactly["capacity"] = {"requests": requests}
    if selector:
        exactly["selectors"] = [{"cel": {"expression": selector}}]
    return {"name": name, "exactly": exactly}


def nic_request(name: str = "nic") -> dict[str, Any]:
    return {"name": name, "exactly": {"deviceClassName": "nic.fractional.dev"}}


def build_claim(
    name: str,
    namespace: str,
    requests: list[dict[str, Any]],
    *,
    match_pcie_root: bool = False,
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {"devices": {"requests": requests}}
    if match_pcie_root:
        spec["devices"]["constraints"] = [{"matchAttribute": PCIE_ROOT}]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels or {})},
        "spec": spec,
    }


def build_pod(
    name: str,
    namespace: str,
    claim_names: list[str],
    *,
    gang: str | None = None,
    gang_size: int | None = None,
    pod_group: str | None = None,
    cpu: str = "4",
    memory: str = "16Gi",
) -> dict[str, Any]:
    """A pod gated for our controller, referencing existing claims by name; in a gang by our label
    (``gang``) or by ``spec.schedulingGroup`` (``pod_group``, a scheduling.k8s.io PodGroup)."""
    metadata: dict[str, Any] = {"name": name, "namespace": namespace, "labels": {"app": "demo"}}
    if gang:
        metadata["labels"][GANG_LABEL] = gang
        metadata["annotations"] = {GANG_SIZE_ANNOTATION: str(gang_size or 1)}
    resource_claims = [{"name": f"claim-{i}", "resourceClaimName": c} for i, c in enumerate(claim_names)]
    group = {"schedulingGroup": {"podGroupName": pod_group}} if pod_group else {}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {
            **group,
            "schedulingGates": [{"name": GATE}],
            "resourceClaims": resource_claims,
            "containers": [
                {
                    "name": "main",
                    "image": "registry.k8s.io/pause:3.10",
                    "resources": {
                        "requests": {"cpu": cpu, "memory": memory},
                        "claims": [{"name": rc["name"]} for rc in resource_claims],
                    },
                }
            ],
        },
    }


SCHEDULING_API = "scheduling.k8s.io/v1beta1"  # the 1.37 shapes (k8s.io/api scheduling/v1beta1/types.go)


def build_workload(name: str, namespace: str, template: str, min_count: int) -> dict[str, Any]:
    """A Workload with one gang template (what a Job controller writes on 1.37)."""
    return {
        "apiVersion": SCHEDULING_API,
        "kind": "Workload",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "podGroupTemplates": [{"name": template, "schedulingPolicy": {"gang": {"minCount": min_count}}}]
        },
    }


def build_pod_group(
    name: str, namespace: str, workload: str, template: str, min_count: int
) -> dict[str, Any]:
    """The runtime PodGroup made from the Workload's template; pods name it in ``spec.schedulingGroup``."""
    return {
        "apiVersion": SCHEDULING_API,
        "kind": "PodGroup",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "workloadRef": {"workloadName": workload, "templateName": template},
            "schedulingPolicy": {"gang": {"minCount": min_count}},
        },
    }
