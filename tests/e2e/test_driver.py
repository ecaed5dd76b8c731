"""End to end on a real cluster with the driver installed by its chart: the local cluster of
upstream binaries (``make e2e``: kube-apiserver, kube-scheduler, kube-controller-manager, two
kubelets with containerd, fake h100-8x and a100-pcie-4x devices) or kind (``make kind-e2e``).

Skipped unless kubectl reaches the cluster and the chart is installed. The claims and pods are
made here (not read from examples/) so that each test controls placement and can check exactly
what it asked for. Each case is checked from outside, as a user would: pod logs, claim status,
events, and the files on the node.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from e2e_support import (
    DRIVER,
    DRIVER_IMAGE,
    IMAGE,
    LOCAL_CLUSTER,
    KubectlError,
    apply,
    cdi_files,
    get,
    kubectl,
    list_items,
    node_dir,
    pod,
    pod_env,
    wait_for,
)
from kubernetes.utils import parse_quantity

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

GIB = 1024**3
POD_START_SECONDS = 300  # includes pulling the test image on a fresh cluster
GANG_DECISION_SECONDS = 120


def claim(
    name: str, requests: list[dict[str, Any]], constraints: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    devices: dict[str, Any] = {"requests": requests}
    if constraints:
        devices["constraints"] = constraints
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": devices},
    }


def template(name: str, requests: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {"spec": {"devices": {"requests": requests}}},
    }


def gpu_request(
    name: str = "gpu", *, memory: str | None = None, compute: str | None = None, count: int | None = None,
    selectors: list[str] | None = None,
) -> dict[str, Any]:  # fmt: skip
    exactly: dict[str, Any] = {"deviceClassName": "gpu.fractional.dev"}
    capacity = {key: value for key, value in (("memory", memory), ("compute", compute)) if value is not None}
    if capacity:
        exactly["capacity"] = {"requests": capacity}
    if count is not None:
        exactly["count"] = count
    if selectors:
        exactly["selectors"] = [{"cel": {"expression": expression}} for expression in selectors]
    return {"name": name, "exactly": exactly}


def our_slices() -> list[dict[str, Any]]:
    return list_items("resourceslices", "--field-selector", f"spec.driver={DRIVER}")


def device_in_slices(pool: str, device: str) -> dict[str, Any]:
    for resource_slice in our_slices():
        if resource_slice["spec"]["pool"]["name"] == pool:
            for candidate in resource_slice["spec"].get("devices", []):
                if candidate["name"] == device:
                    return dict(candidate)
    raise AssertionError(f"device {pool}/{device} is not published")


def attribute(device: dict[str, Any], name: str) -> Any:
    (value,) = device["attributes"][name].values()
    return value


def running(name: str, namespace: str) -> bool:
    phase = get("pod", name, namespace)["status"].get("phase")
    assert phase not in ("Failed", "Succeeded"), f"pod {namespace}/{name} ended: {phase}"
    return phase == "Running"


def allocation_of(name: str, namespace: str) -> dict[str, Any] | None:
    allocation: dict[str, Any] | None = (
        get("resourceclaim", name, namespace).get("status", {}).get("allocation")
    )
    return allocation


def our_results(allocation: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in allocation["devices"]["results"] if r["driver"] == DRIVER]


def start_share(
    name: str, namespace: str, *, memory: str, compute: str | None = None, node: str | None = None
) -> None:
    """A pod with its own share (a ResourceClaimTemplate of one request), running."""
    apply(
        [
            template(name, [gpu_request(memory=memory, compute=compute)]),
            pod(name, {"gpu": {"resourceClaimTemplateName": name}}, node=node),
        ],
        namespace,
    )
    wait_for(lambda: running(name, namespace), timeout=POD_START_SECONDS, what=f"pod {name} running")


def test_the_driver_runs_the_image_make_image_built(real_cluster: None) -> None:
    selector = "app.kubernetes.io/part-of=fractional-dra"
    workloads = ("daemonsets,deployments", "-n", "fractional-system", "-l", selector)
    images = kubectl("get", *workloads, "-o", "jsonpath={.items[*].spec.template.spec.containers[*].image}")
    assert set(images.split()) == {DRIVER_IMAGE}


def test_two_pods_share_one_gpu_and_each_sees_its_own_limits(namespace: str) -> None:
    # Pin both claims to the same GPU of the same node: gpu-0 of the first worker's pool.
    first = min(our_slices(), key=lambda s: s["spec"]["nodeName"])
    node = first["spec"]["nodeName"]
    gpu = device_in_slices(first["spec"]["pool"]["name"], "gpu-0")
    uuid = attribute(gpu, "uuid")
    selector = f'device.attributes["{DRIVER}"].uuid == "{uuid}"'
    shares = {"share-a": ("4Gi", "10"), "share-b": ("8Gi", "30")}
    objects: list[dict[str, Any]] = []
    for name, (memory, compute) in shares.items():
        objects.append(claim(name, [gpu_request(memory=memory, compute=compute, selectors=[selector])]))
        objects.append(pod(name, {"gpu": {"resourceClaimName": name}}, node=node))
    apply(objects, namespace)

    for name in shares:
        wait_for(
            lambda name=name: running(name, namespace), timeout=POD_START_SECONDS, what=f"pod {name} running"
        )
    results = {}
    for name in shares:
        allocation = allocation_of(name, namespace)
        assert allocation is not None
        (results[name],) = our_results(allocation)
    a, b = results["share-a"], results["share-b"]
    assert (a["pool"], a["device"]) == (b["pool"], b["device"]), "the two shares are on different GPUs"
    assert a.get("shareID") and b.get("shareID") and a["shareID"] != b["shareID"]
    for name, (memory, compute) in shares.items():
        consumed = results[name]["consumedCapacity"]
        assert parse_quantity(consumed["memory"]) == parse_quantity(memory)
        assert parse_quantity(consumed["compute"]) == parse_quantity(compute)
        env = pod_env(name, namespace)
        assert env["FRACTIONAL_GPU_UUID"] == uuid
        assert int(env["FRACTIONAL_GPU_MEMORY_LIMIT"]) == int(parse_quantity(memory))
        assert int(env["FRACTIONAL_GPU_COMPUTE_PERCENT"]) == int(compute)
        assert env["FRACTIONAL_CLAIM_UID"] == get("resourceclaim", name, namespace)["metadata"]["uid"]


def test_a_whole_gpu_pod_gets_a_gpu_nobody_shares(namespace: str) -> None:
    apply([claim("whole", [gpu_request()]), pod("whole", {"gpu": {"resourceClaimName": "whole"}})], namespace)
    wait_for(lambda: running("whole", namespace), timeout=POD_START_SECONDS, what="pod whole running")
    allocation = allocation_of("whole", namespace)
    assert allocation is not None
    (result,) = our_results(allocation)
    device = device_in_slices(result["pool"], result["device"])
    total = parse_quantity(device["capacity"]["memory"]["value"])
    assert parse_quantity(result["consumedCapacity"]["memory"]) == total
    assert int(pod_env("whole", namespace)["FRACTIONAL_GPU_MEMORY_LIMIT"]) == int(total)
    # Nobody else, in any namespace, holds that GPU.
    holders = [
        f"{c['metadata']['namespace']}/{c['metadata']['name']}"
        for c in list_items("resourceclaims", "--all-namespaces")
        for r in our_results(c.get("status", {}).get("allocation") or {"devices": {"results": []}})
        if (r["pool"], r["device"]) == (result["pool"], result["device"])
    ]
    assert holders == [f"{namespace}/whole"]


def test_a_claim_in_use_is_not_deleted_until_its_pod_is_gone(namespace: str) -> None:
    """The controller writes no finalizer on the claims it allocates (kube-scheduler's own path has
    none to match it): the chart's claims-in-use policy keeps such a claim while it is reserved, as
    kube-scheduler's delete-protection finalizer keeps its own, and says who uses it."""
    gated = pod("kept", {"gpu": {"resourceClaimName": "kept"}})
    gated["spec"]["schedulingGates"] = [{"name": "fractional.dev/allocation"}]  # ours to place
    apply([claim("kept", [gpu_request(memory="2Gi")]), gated], namespace)
    wait_for(lambda: running("kept", namespace), timeout=POD_START_SECONDS, what="pod kept running")
    stored = get("resourceclaim", "kept", namespace)
    assert not stored["metadata"].get("finalizers"), stored["metadata"]
    placed = get("pod", "kept", namespace)
    assert placed["metadata"]["annotations"]["fractional.dev/placed-on"] == placed["spec"]["nodeName"]
    with pytest.raises(KubectlError, match=r"is in use \(reserved for pods/kept\)"):
        kubectl("delete", "resourceclaim", "kept", "-n", namespace, "--wait=false")
    assert allocation_of("kept", namespace) is not None
    kubectl("delete", "pod", "kept", "-n", namespace, "--wait=true", timeout=120)

    def deleted() -> bool:
        try:
            kubectl("delete", "resourceclaim", "kept", "-n", namespace, "--wait=true")
        except KubectlError as error:
            assert "is in use" in str(error), error  # its reservation not dropped yet: again
            return False
        return True

    wait_for(deleted, timeout=60, what="the claim deleted once its pod is gone")


def test_gpu_and_nic_under_one_pcie_root(namespace: str) -> None:
    nic_request = {"name": "nic", "exactly": {"deviceClassName": "nic.fractional.dev"}}
    pair = claim(
        "pair",
        [gpu_request(), nic_request],
        constraints=[{"requests": ["gpu", "nic"], "matchAttribute": "resource.kubernetes.io/pcieRoot"}],
    )
    apply([pair, pod("pair", {"pair": {"resourceClaimName": "pair"}})], namespace)
    wait_for(lambda: running("pair", namespace), timeout=POD_START_SECONDS, what="pod pair running")
    allocation = allocation_of("pair", namespace)
    assert allocation is not None
    by_request = {r["request"]: r for r in our_results(allocation)}
    assert set(by_request) == {"gpu", "nic"}
    roots = {
        name: attribute(device_in_slices(r["pool"], r["device"]), "resource.kubernetes.io/pcieRoot")
        for name, r in by_request.items()
    }
    assert roots["gpu"] == roots["nic"], roots
    assert by_request["gpu"]["pool"] == by_request["nic"]["pool"]
    assert pod_env("pair", namespace).get("FRACTIONAL_NIC_INTERFACE")


def _gang(namespace: str, gang: str, size: int, request: dict[str, Any]) -> list[str]:
    names = [f"{gang}-{index}" for index in range(size)]
    objects = [template(gang, [request])]
    objects += [pod(name, {"gpu": {"resourceClaimTemplateName": gang}}, gang=(gang, size)) for name in names]
    apply(objects, namespace)
    return names


def _gates(name: str, namespace: str) -> list[str]:
    return [g["name"] for g in get("pod", name, namespace)["spec"].get("schedulingGates", [])]


def _claims_of(name: str, namespace: str) -> list[str]:
    statuses = get("pod", name, namespace).get("status", {}).get("resourceClaimStatuses", [])
    return [s["resourceClaimName"] for s in statuses if s.get("resourceClaimName")]


def test_a_gated_gang_of_four_runs(namespace: str) -> None:
    names = _gang(namespace, "fits", 4, gpu_request(memory="8Gi", compute="10"))
    for name in names:
        wait_for(
            lambda name=name: running(name, namespace), timeout=POD_START_SECONDS, what=f"gang pod {name}"
        )
    for name in names:
        assert "fractional.dev/allocation" not in _gates(name, namespace)
        (claim_name,) = _claims_of(name, namespace)
        allocation = allocation_of(claim_name, namespace)
        assert allocation is not None and len(our_results(allocation)) == 1
        # The pod runs where the controller put its share.
        node = get("pod", name, namespace)["spec"]["nodeName"]
        (result,) = our_results(allocation)
        pools_on_node = {s["spec"]["pool"]["name"] for s in our_slices() if s["spec"]["nodeName"] == node}
        assert result["pool"] in pools_on_node


def test_a_gang_too_large_for_the_cluster_stays_gated_with_an_event(namespace: str) -> None:
    # Three pods of eight whole GPUs each: 24 GPUs, while two h100-8x workers have 16.
    names = _gang(namespace, "too-big", 3, gpu_request(count=8))

    def unschedulable_event() -> dict[str, Any] | None:
        for event in list_items("events", "-n", namespace):
            involved = event.get("involvedObject", {})
            if event.get("reason") == "GangUnschedulable" and involved.get("name") in names:
                return event
        return None

    event = wait_for(unschedulable_event, timeout=GANG_DECISION_SECONDS, what="a GangUnschedulable event")
    assert event["type"] == "Warning" and event.get("message")
    for name in names:
        assert _gates(name, namespace) == ["fractional.dev/allocation"]
        assert get("pod", name, namespace)["spec"].get("nodeName") is None
        for claim_name in _claims_of(name, namespace):
            assert allocation_of(claim_name, namespace) is None, (
                "a claim of an unschedulable gang was allocated"
            )
    hints = [get("pod", name, namespace)["metadata"].get("annotations", {}) for name in names]
    assert any("fractional.dev/scale-up-hint" in annotations for annotations in hints)


# ------------------------------------------------------------------ kube-scheduler alone (no gate)


def _claim_of_pod(name: str, namespace: str) -> dict[str, Any]:
    (claim_name,) = wait_for(
        lambda: _claims_of(name, namespace), timeout=60, what=f"the claim made for pod {name}", interval=1
    )
    return get("resourceclaim", claim_name, namespace)


def _events_of(name: str, namespace: str, reason: str | None = None) -> list[dict[str, Any]]:
    return [
        e
        for e in list_items("events", "-n", namespace, "--field-selector", f"involvedObject.name={name}")
        if reason is None or e.get("reason") == reason
    ]


def test_kube_scheduler_allocates_an_ungated_share_and_the_kubelet_prepares_it(namespace: str) -> None:
    """The README's headline case with no gate: kube-scheduler itself allocates from our slices
    (consumable capacity), the kubelet calls NodePrepareResources, containerd applies our CDI spec,
    and deleting the pod unprepares it and removes the CDI file."""
    start_share("share", namespace, memory="12Gi", compute="15")
    node = get("pod", "share", namespace)["spec"]["nodeName"]
    # kube-scheduler records its Events asynchronously: under load the pod can run first (seen once).
    (scheduled,) = wait_for(lambda: _events_of("share", namespace, "Scheduled"), timeout=60,
                            what="kube-scheduler's Scheduled Event")  # fmt: skip
    assert (
        scheduled.get("reportingComponent") == "default-scheduler"
        or scheduled["source"].get("component") == "default-scheduler"
    ), scheduled
    claim_object = _claim_of_pod("share", namespace)
    (result,) = our_results(claim_object["status"]["allocation"])
    assert result.get("shareID"), "kube-scheduler gave a share of a shared device a shareID"
    consumed = result["consumedCapacity"]
    assert parse_quantity(consumed["memory"]) == 12 * GIB and parse_quantity(consumed["compute"]) == 15
    env = pod_env("share", namespace)
    assert int(env["FRACTIONAL_GPU_MEMORY_LIMIT"]) == 12 * GIB
    assert int(env["FRACTIONAL_GPU_COMPUTE_PERCENT"]) == 15
    uid = claim_object["metadata"]["uid"]
    assert env["FRACTIONAL_CLAIM_UID"] == uid
    assert f"k8s.fractional.dev-gpu_{uid}.json" in cdi_files(node)
    kubectl("delete", "pod", "share", "-n", namespace, "--wait=true", timeout=120)
    wait_for(
        lambda: f"k8s.fractional.dev-gpu_{uid}.json" not in cdi_files(node),
        timeout=120,
        what="the CDI spec removed after the pod is gone",
    )


def test_one_claim_shared_by_two_pods(namespace: str) -> None:
    apply(
        [
            claim("shared", [gpu_request(memory="4Gi", compute="10")]),
            pod("first", {"gpu": {"resourceClaimName": "shared"}}),
            pod("second", {"gpu": {"resourceClaimName": "shared"}}),
        ],
        namespace,
    )
    for name in ("first", "second"):
        wait_for(lambda name=name: running(name, namespace), timeout=POD_START_SECONDS, what=f"pod {name}")
    claim_object = get("resourceclaim", "shared", namespace)
    assert {r["name"] for r in claim_object["status"]["reservedFor"]} == {"first", "second"}
    nodes = {get("pod", name, namespace)["spec"]["nodeName"] for name in ("first", "second")}
    assert len(nodes) == 1, "both pods of one claim run where the claim was allocated"
    envs = [pod_env(name, namespace) for name in ("first", "second")]
    assert envs[0]["FRACTIONAL_GPU_UUID"] == envs[1]["FRACTIONAL_GPU_UUID"]
    assert (
        envs[0]["FRACTIONAL_CLAIM_UID"] == envs[1]["FRACTIONAL_CLAIM_UID"] == claim_object["metadata"]["uid"]
    )


def test_an_init_container_sees_the_claim_too(namespace: str) -> None:
    body = pod("init", {"gpu": {"resourceClaimName": "init"}})
    body["spec"]["initContainers"] = [
        {
            "name": "init",
            "image": IMAGE,
            "command": ["sh", "-c", "env | grep FRACTIONAL_"],
            "resources": {"claims": [{"name": "gpu"}]},
        }
    ]
    apply([claim("init", [gpu_request(memory="2Gi")]), body], namespace)
    wait_for(lambda: running("init", namespace), timeout=POD_START_SECONDS, what="pod init running")
    init_env = dict(
        line.split("=", 1)
        for line in kubectl("logs", "-n", namespace, "init", "-c", "init").splitlines()
        if "=" in line
    )
    assert int(init_env["FRACTIONAL_GPU_MEMORY_LIMIT"]) == 2 * GIB
    assert init_env["FRACTIONAL_GPU_UUID"] == pod_env("init", namespace)["FRACTIONAL_GPU_UUID"]


def test_a_cel_selector_picks_the_product(namespace: str) -> None:
    products = sorted(
        {
            attribute(d, "productName")
            for s in our_slices()
            for d in s["spec"].get("devices", [])
            if "productName" in d.get("attributes", {})
        }
    )
    wanted = products[0]
    selector = f'device.attributes["{DRIVER}"].productName == "{wanted}"'
    apply(
        [
            claim("picked", [gpu_request(memory="1Gi", selectors=[selector])]),
            pod("picked", {"gpu": {"resourceClaimName": "picked"}}),
        ],
        namespace,
    )
    wait_for(lambda: running("picked", namespace), timeout=POD_START_SECONDS, what="pod picked running")
    (result,) = our_results(allocation_of("picked", namespace) or {})
    assert attribute(device_in_slices(result["pool"], result["device"]), "productName") == wanted


def test_first_available_falls_back_to_the_next_subrequest(namespace: str) -> None:
    request = {
        "name": "gpu",
        "firstAvailable": [
            {
                "name": "absent",
                "deviceClassName": "gpu.fractional.dev",
                "selectors": [
                    {"cel": {"expression": f'device.attributes["{DRIVER}"].productName == "no such GPU"'}}
                ],
            },
            {
                "name": "share",
                "deviceClassName": "gpu.fractional.dev",
                "capacity": {"requests": {"memory": "2Gi"}},
            },
        ],
    }
    apply(
        [claim("fallback", [request]), pod("fallback", {"gpu": {"resourceClaimName": "fallback"}})], namespace
    )
    wait_for(lambda: running("fallback", namespace), timeout=POD_START_SECONDS, what="pod fallback running")
    (result,) = our_results(allocation_of("fallback", namespace) or {})
    assert result["request"] == "gpu/share"
    assert parse_quantity(result["consumedCapacity"]["memory"]) == 2 * GIB


def test_admin_access_needs_the_capacity_it_asks_for_and_blocks_nobody(namespace: str) -> None:
    """Recorded from kube-scheduler 1.37.2: an admin-access request on a shared GPU is checked
    against the capacity still free, like any request (one that asks for no memory asks for all of
    it and does not fit a GPU that a share holds part of), but once allocated it holds nothing:
    later shares are placed as if it were not there."""
    kubectl("label", "namespace", namespace, "resource.kubernetes.io/admin-access=true")
    first = min(our_slices(), key=lambda s: s["spec"]["nodeName"])
    device = device_in_slices(first["spec"]["pool"]["name"], "gpu-1")
    uuid = attribute(device, "uuid")
    total = int(parse_quantity(device["capacity"]["memory"]["value"]))
    selector = f'device.attributes["{DRIVER}"].uuid == "{uuid}"'
    big = f"{(total - 2 * GIB) // GIB}Gi"
    apply(
        [
            claim("owner", [gpu_request(memory=big, selectors=[selector])]),
            pod("owner", {"gpu": {"resourceClaimName": "owner"}}),
        ],
        namespace,
    )
    wait_for(lambda: running("owner", namespace), timeout=POD_START_SECONDS, what="pod owner running")
    everything = gpu_request(selectors=[selector])
    everything["exactly"]["adminAccess"] = True
    small = gpu_request(memory="1Gi", selectors=[selector])
    small["exactly"]["adminAccess"] = True
    apply(
        [
            claim("admin-all", [everything]),
            pod("admin-all", {"gpu": {"resourceClaimName": "admin-all"}}),
            claim("admin", [small]),
            pod("admin", {"gpu": {"resourceClaimName": "admin"}}),
        ],
        namespace,
    )
    wait_for(lambda: running("admin", namespace), timeout=POD_START_SECONDS, what="pod admin running")
    (result,) = our_results(allocation_of("admin", namespace) or {})
    assert result.get("adminAccess") is True
    assert pod_env("admin", namespace)["FRACTIONAL_GPU_UUID"] == uuid
    message = wait_for(lambda: _pending_reason("admin-all", namespace), timeout=60, what="FailedScheduling")
    assert "cannot allocate all claims" in message, message
    # The admin share holds nothing: the last free 2Gi still go to an ordinary share.
    apply(
        [
            claim("after", [gpu_request(memory="2Gi", selectors=[selector])]),
            pod("after", {"gpu": {"resourceClaimName": "after"}}),
        ],
        namespace,
    )
    wait_for(lambda: running("after", namespace), timeout=POD_START_SECONDS, what="pod after running")


def _pending_reason(name: str, namespace: str) -> str | None:
    for event in _events_of(name, namespace, "FailedScheduling"):
        return str(event.get("message") or event.get("note") or "")
    return None


def test_a_claim_that_cannot_fit_leaves_the_pod_pending_with_the_schedulers_reason(namespace: str) -> None:
    apply(
        [claim("huge", [gpu_request(memory="500Gi")]), pod("huge", {"gpu": {"resourceClaimName": "huge"}})],
        namespace,
    )
    message = wait_for(lambda: _pending_reason("huge", namespace), timeout=60, what="FailedScheduling")
    assert get("pod", "huge", namespace)["status"].get("phase") == "Pending"
    assert allocation_of("huge", namespace) is None
    assert "cannot allocate all claims" in message, message


def test_a_negative_memory_request_gets_the_smallest_share(namespace: str) -> None:
    """Recorded from kube-apiserver and kube-scheduler 1.37.2: ``memory: -4Gi`` is accepted by the
    server, and the scheduler rounds it up to the request policy's minimum (256Mi), as our
    allocator does; the pod runs with a 256Mi share."""
    bad = claim(
        "negative",
        [
            {
                "name": "gpu",
                "exactly": {
                    "deviceClassName": "gpu.fractional.dev",
                    "capacity": {"requests": {"memory": "-4Gi"}},
                },
            }
        ],
    )
    apply([bad, pod("negative", {"gpu": {"resourceClaimName": "negative"}})], namespace)
    wait_for(lambda: running("negative", namespace), timeout=POD_START_SECONDS, what="pod negative running")
    (result,) = our_results(allocation_of("negative", namespace) or {})
    assert parse_quantity(result["consumedCapacity"]["memory"]) == 256 * 1024**2
    assert int(pod_env("negative", namespace)["FRACTIONAL_GPU_MEMORY_LIMIT"]) == 256 * 1024**2


def test_compute_over_100_is_accepted_then_never_allocated(namespace: str) -> None:
    """Recorded from 1.37.2: the server accepts ``compute: 150``; kube-scheduler finds no device
    (over the policy's maximum of 100) and says so in FailedScheduling, with the pod Pending."""
    bad = claim(
        "over",
        [
            {
                "name": "gpu",
                "exactly": {
                    "deviceClassName": "gpu.fractional.dev",
                    "capacity": {"requests": {"memory": "1Gi", "compute": "150"}},
                },
            }
        ],
    )
    apply([bad, pod("over", {"gpu": {"resourceClaimName": "over"}})], namespace)
    message = wait_for(
        lambda: _pending_reason("over", namespace), timeout=60, what="FailedScheduling of over"
    )
    assert allocation_of("over", namespace) is None
    assert "cannot allocate all claims" in message, message


def test_an_unknown_device_class_is_named_by_the_scheduler(namespace: str) -> None:
    bad = claim("unknown", [{"name": "gpu", "exactly": {"deviceClassName": "tpu.fractional.dev"}}])
    apply([bad, pod("unknown", {"gpu": {"resourceClaimName": "unknown"}})], namespace)
    message = wait_for(lambda: _pending_reason("unknown", namespace), timeout=60, what="FailedScheduling")
    assert "tpu.fractional.dev" in message, message


# ------------------------------------------------------------------ the node agent restarts; taints


def _agent_pod(node: str) -> dict[str, Any]:
    pods = list_items(
        "pods",
        "-n",
        "fractional-system",
        "-l",
        "app.kubernetes.io/component=agent",
        "--field-selector",
        f"spec.nodeName={node}",
    )
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    assert len(live) == 1, [p["metadata"]["name"] for p in live]
    return live[0]


def _ready(pod_object: dict[str, Any]) -> bool:
    conditions = pod_object.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def test_a_killed_agent_comes_back_and_prepares_nothing_twice(namespace: str) -> None:
    start_share("before", namespace, memory="6Gi", compute="10")
    node = get("pod", "before", namespace)["spec"]["nodeName"]
    uid = _claim_of_pod("before", namespace)["metadata"]["uid"]
    old_agent = _agent_pod(node)
    if LOCAL_CLUSTER:
        spec_file = node_dir(node) / "cdi" / f"k8s.fractional.dev-gpu_{uid}.json"
        written = spec_file.stat().st_mtime_ns
    kubectl(
        "delete",
        "pod",
        "-n",
        "fractional-system",
        old_agent["metadata"]["name"],
        "--grace-period=0",
        "--force",
    )
    new_agent = wait_for(
        lambda: (lambda p: p if p["metadata"]["uid"] != old_agent["metadata"]["uid"] and _ready(p) else None)(
            _agent_pod(node)
        ),
        timeout=POD_START_SECONDS,
        what="the DaemonSet's new agent pod Ready",
    )
    assert running("before", namespace), "the running share survives its agent's restart"
    logs = kubectl("logs", "-n", "fractional-system", new_agent["metadata"]["name"])
    restored = re.search(r"kubelet plugin serving.*restored_claims[=\":]+\s*(\d+)", logs)
    assert restored is not None and int(restored.group(1)) >= 1, logs[-2000:]
    if LOCAL_CLUSTER:
        assert spec_file.stat().st_mtime_ns == written, (
            "the restarted agent rewrote a prepared claim's CDI spec"
        )
    start_share("after", namespace, memory="6Gi", compute="10", node=node)
    assert pod_env("after", namespace)["FRACTIONAL_CLAIM_UID"] != uid


def _served_version(group: str, plural: str) -> str:
    """The newest version of ``group`` that serves ``plural`` (DeviceTaintRule: v1 from 1.37,
    v1beta2 in 1.36, v1alpha3 in 1.35)."""
    for entry in json.loads(kubectl("get", "--raw", f"/apis/{group}"))["versions"]:
        resources = json.loads(kubectl("get", "--raw", f"/apis/{entry['groupVersion']}"))["resources"]
        if any(r["name"] == plural for r in resources):
            return str(entry["version"])
    pytest.skip(f"the server serves no {group} {plural}")


def test_a_no_execute_device_taint_evicts_the_gpus_pods_and_new_pods_avoid_it(namespace: str) -> None:
    first = min(our_slices(), key=lambda s: s["spec"]["nodeName"])
    node, pool = first["spec"]["nodeName"], first["spec"]["pool"]["name"]
    uuid = attribute(device_in_slices(pool, "gpu-2"), "uuid")
    selector = f'device.attributes["{DRIVER}"].uuid == "{uuid}"'
    apply(
        [
            claim("victim", [gpu_request(memory="4Gi", selectors=[selector])]),
            pod("victim", {"gpu": {"resourceClaimName": "victim"}}),
        ],
        namespace,
    )
    wait_for(lambda: running("victim", namespace), timeout=POD_START_SECONDS, what="pod victim running")
    rule = f"{namespace}-gpu-2"[:63]
    taint = {
        "apiVersion": f"resource.k8s.io/{_served_version('resource.k8s.io', 'devicetaintrules')}",
        "kind": "DeviceTaintRule",
        "metadata": {"name": rule},
        "spec": {
            "deviceSelector": {"driver": DRIVER, "pool": pool, "device": "gpu-2"},
            "taint": {"key": "example.com/broken", "value": "true", "effect": "NoExecute"},
        },
    }
    kubectl("apply", "-f", "-", stdin=json.dumps(taint))
    try:

        def evicted() -> bool:
            try:
                victim = get("pod", "victim", namespace)
            except KubectlError:
                return True  # deleted by the device-taint eviction controller
            return (
                bool(victim["metadata"].get("deletionTimestamp")) or victim["status"].get("phase") == "Failed"
            )

        wait_for(evicted, timeout=120, what="the pod on the tainted GPU evicted")
        apply(
            [
                claim("newcomer", [gpu_request(memory="4Gi")]),
                pod("newcomer", {"gpu": {"resourceClaimName": "newcomer"}}, node=node),
            ],
            namespace,
        )
        wait_for(
            lambda: running("newcomer", namespace), timeout=POD_START_SECONDS, what="pod newcomer running"
        )
        (result,) = our_results(allocation_of("newcomer", namespace) or {})
        assert (result["pool"], result["device"]) != (pool, "gpu-2"), "a new pod was put on the tainted GPU"
    finally:
        kubectl("delete", "devicetaintrule", rule, "--ignore-not-found")
