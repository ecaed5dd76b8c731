"""The Kubernetes AI Conformance test plans of tests/test_ai_conformance.py (docs/conformance.md), on a
real cluster: the local one of upstream binaries (``make e2e``) or kind (``make kind-e2e``). The
same plans as on the demo, checked through what a real cluster shows: the containers' environment
(the CDI edits the runtime applied), the claims' allocations, Events, the agent's and the
controller's metrics through kube-apiserver's pod proxy, and the published driver versions against
the fake NVML of each node's profile.

- secure_accelerator_access (KAR-0049): the container that lists the claim sees its GPU, a
  container of the same pod that does not sees none, a pod without a claim sees none;
- gpu_sharing (KAR-0003): three pods, three claims, one physical GPU (one UUID), three shares;
- gang_scheduling (KAR-0053): a gang that fits runs whole; one no node set can hold has no pod
  running and nothing allocated; deleting the pods releases their allocations;
- accelerator_metrics (KAR-0059): per-GPU utilisation, memory, temperature and power, per-pod
  series, dcgm-exporter's names, and the controller's fragmentation gauges;
- driver_runtime_management (KAR-0001): every node's published driver versions equal NVML's.
"""

from __future__ import annotations

from typing import Any

import pytest
from e2e_support import KubectlError, apply, get, kubectl, list_items, pod, wait_for
from prometheus_client.parser import text_string_to_metric_families
from test_driver import (
    DRIVER,
    POD_START_SECONDS,
    allocation_of,
    attribute,
    gpu_request,
    our_results,
    our_slices,
    running,
    template,
)

from driver.inventory.fake import load_profile, resolve_profile
from driver.inventory.fake_nvml import FakeNVML
from driver.inventory.model import normalize_version

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SYSTEM = "fractional-system"
RELEASE = "fractional-dra"
PROFILE_LABEL = "fractional.dev/fake-profile"


def _env(name: str, namespace: str, container: str) -> dict[str, str]:
    env = {}
    for line in kubectl("logs", "-n", namespace, name, "-c", container).splitlines():
        key, sep, value = line.partition("=")
        if sep and key.isidentifier():
            env[key] = value
    return env


def _claim_of(name: str, namespace: str) -> str:
    statuses = get("pod", name, namespace).get("status", {}).get("resourceClaimStatuses", [])
    (claim,) = [s["resourceClaimName"] for s in statuses if s.get("resourceClaimName")]
    return str(claim)


def _device(result: dict[str, Any]) -> dict[str, Any]:
    for resource_slice in our_slices():
        if resource_slice["spec"]["pool"]["name"] == result["pool"]:
            for device in resource_slice["spec"].get("devices", []):
                if device["name"] == result["device"]:
                    return dict(device)
    raise AssertionError(f"{result['pool']}/{result['device']} is not published")


def _start(objects: list[dict[str, Any]], names: list[str], namespace: str) -> None:
    apply(objects, namespace)
    for name in names:
        wait_for(lambda name=name: running(name, namespace), timeout=POD_START_SECONDS, what=f"pod {name}")


def _scrape(pod_name: str, port: int) -> list[tuple[str, dict[str, str], float]]:
    text = kubectl("get", "--raw", f"/api/v1/namespaces/{SYSTEM}/pods/{pod_name}:{port}/proxy/metrics")
    return [
        (sample.name, dict(sample.labels), sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def test_secure_accelerator_access(user_namespace: str) -> None:
    namespace = user_namespace
    body = pod("secure", {"gpu": {"resourceClaimTemplateName": "secure"}})
    (main,) = body["spec"]["containers"]
    main["name"] = "with-claim"
    body["spec"]["containers"].append({**main, "name": "without-claim", "resources": {}})
    plain = pod("no-claim", {})
    share = template("secure", [gpu_request(memory="2Gi", compute="10")])
    _start([share, body, plain], ["secure", "no-claim"], namespace)
    (result,) = our_results(allocation_of(_claim_of("secure", namespace), namespace) or {})
    uuid = attribute(_device(result), "uuid")
    assert _env("secure", namespace, "with-claim")["FRACTIONAL_GPU_UUID"] == uuid
    for name, container in (("secure", "without-claim"), ("no-claim", "main")):
        leaked = {k: v for k, v in _env(name, namespace, container).items() if k.startswith("FRACTIONAL_")}
        assert leaked == {}, (name, container, leaked)


def test_gpu_sharing_three_pods_on_one_gpu(user_namespace: str) -> None:
    namespace = user_namespace
    (first,) = our_slices()[:1]
    gpu = next(d for d in first["spec"]["devices"] if attribute(d, "type") == "gpu")
    selector = f'device.attributes["{DRIVER}"].uuid == "{attribute(gpu, "uuid")}"'
    names = [f"share-{i}" for i in range(3)]
    objects: list[dict[str, Any]] = [
        template("share", [gpu_request(memory="4Gi", compute="10", selectors=[selector])])
    ]
    objects += [pod(name, {"gpu": {"resourceClaimTemplateName": "share"}}) for name in names]
    _start(objects, names, namespace)
    results = [r for n in names for r in our_results(allocation_of(_claim_of(n, namespace), namespace) or {})]
    assert len(results) == 3 and len({attribute(_device(r), "uuid") for r in results}) == 1
    assert len({r["shareID"] for r in results}) == 3  # each its own share
    assert len({_env(n, namespace, "main")["FRACTIONAL_GPU_UUID"] for n in names}) == 1


def test_gang_scheduling_positive_negative_and_cleanup(user_namespace: str) -> None:
    namespace = user_namespace
    gpus = sum(1 for s in our_slices() for d in s["spec"].get("devices", []) if attribute(d, "type") == "gpu")
    fits = [f"fits-{i}" for i in range(2)]
    objects: list[dict[str, Any]] = [template("fits", [gpu_request(memory="2Gi")])]
    objects += [pod(n, {"gpu": {"resourceClaimTemplateName": "fits"}}, gang=("fits", 2)) for n in fits]
    _start(objects, fits, namespace)
    too_big = [f"too-big-{i}" for i in range(gpus + 1)]  # one whole GPU each: one more than there are
    objects = [template("too-big", [gpu_request()])]
    objects += [pod(n, {"gpu": {"resourceClaimTemplateName": "too-big"}}, gang=("too-big", len(too_big)))
                for n in too_big]  # fmt: skip
    apply(objects, namespace)

    def unschedulable() -> bool:
        return any(
            e.get("reason") == "GangUnschedulable" and e.get("involvedObject", {}).get("name") in too_big
            for e in list_items("events", "-n", namespace)
        )

    wait_for(unschedulable, timeout=180, what="GangUnschedulable for gang 'too-big'")
    for name in too_big:
        stored = get("pod", name, namespace)
        assert stored["status"].get("phase") != "Running" and not stored["spec"].get("nodeName")
        statuses = stored.get("status", {}).get("resourceClaimStatuses", [])
        assert all(
            allocation_of(s["resourceClaimName"], namespace) is None
            for s in statuses
            if s.get("resourceClaimName")
        )
    claims = [_claim_of(n, namespace) for n in fits]
    kubectl("delete", "pod", "-n", namespace, *fits, *too_big, "--wait=true", timeout=180)
    wait_for(lambda: all(_released(c, namespace) for c in claims), timeout=120, what="gang 'fits' released")


def _released(claim: str, namespace: str) -> bool:
    try:
        return allocation_of(claim, namespace) is None
    except KubectlError:  # deleted with its pod (made from a template): released too
        return True


def test_accelerator_metrics_scrape(user_namespace: str) -> None:
    namespace = user_namespace
    metered = pod("metered", {"gpu": {"resourceClaimTemplateName": "metered"}})
    _start([template("metered", [gpu_request(memory="2Gi", compute="10")]), metered], ["metered"], namespace)
    node = get("pod", "metered", namespace)["spec"]["nodeName"]
    agents = list_items("pods", "-n", SYSTEM, "-l", "app.kubernetes.io/component=agent",
                        "--field-selector", f"spec.nodeName={node}")  # fmt: skip
    (agent,) = [a["metadata"]["name"] for a in agents if a["status"].get("phase") == "Running"]

    def scraped_pod() -> list[tuple[str, dict[str, str], float]] | None:
        samples = _scrape(agent, 8080)
        shares = [s for s in samples if s[0] == "fractional_share_memory_allocated_bytes"]
        return samples if any(labels.get("pod") == "metered" for _, labels, _ in shares) else None

    samples = wait_for(scraped_pod, timeout=120, what="the pod's series in the agent's scrape")
    names = {name for name, _, _ in samples}
    gpu_series = {"fractional_gpu_utilization_ratio", "fractional_gpu_memory_used_bytes",
                  "fractional_gpu_memory_total_bytes", "fractional_gpu_temperature_celsius",
                  "fractional_gpu_power_watts"}  # fmt: skip
    assert gpu_series <= names
    for name, labels, _ in samples:
        if name in gpu_series:
            assert {"node", "gpu", "uuid", "product"} <= set(labels) and labels["node"] == node
    allocated = "fractional_share_memory_allocated_bytes"
    (share,) = [labels for n, labels, _ in samples if n == allocated and labels.get("pod") == "metered"]
    assert share["namespace"] == namespace and {"container", "claim", "gpu", "uuid"} <= set(share)
    # dcgm-exporter's names: with the chart's metrics.dcgmNames (off by default), and only then.
    daemonset = get("daemonset", f"{RELEASE}-agent", SYSTEM)
    (container,) = [c for c in daemonset["spec"]["template"]["spec"]["containers"] if c["name"] == "agent"]
    dcgm = any(e.get("name") == "FRACTIONAL_DCGM_METRICS" for e in container.get("env") or ())
    for name in (
        "DCGM_FI_DEV_GPU_UTIL",
        "DCGM_FI_DEV_FB_USED",
        "DCGM_FI_DEV_GPU_TEMP",
        "DCGM_FI_DEV_POWER_USAGE",
    ):
        series = [labels for n, labels, _ in samples if n == name]
        assert bool(series) == dcgm, (name, dcgm)
        if series:
            assert {"gpu", "UUID", "modelName", "Hostname"} <= set(series[0]), name
    controllers = list_items("pods", "-n", SYSTEM, "-l", "app.kubernetes.io/component=controller")
    gauges = {"fractional_controller_gpus_free", "fractional_controller_stranded_memory_bytes"}

    def leader_gauges() -> bool:  # the leader exports them (the standby has no view to compute them)
        return any(gauges <= {n for n, _, _ in _scrape(c["metadata"]["name"], 8081)} for c in controllers
                   if c["status"].get("phase") == "Running")  # fmt: skip

    wait_for(leader_gauges, timeout=60, what="the controller's fragmentation gauges")


def test_driver_versions_equal_nvml(real_cluster: None) -> None:
    profiles = {n["metadata"]["name"]: (n["metadata"].get("labels") or {}).get(PROFILE_LABEL)
                for n in list_items("nodes")}  # fmt: skip
    checked = 0
    for resource_slice in our_slices():
        node = resource_slice["spec"].get("nodeName")
        profile = profiles.get(node) or "h100-8x"  # the chart's default fake profile
        nvml = FakeNVML(load_profile(resolve_profile(profile), node_name=node))
        cuda = nvml.nvmlSystemGetCudaDriverVersion()
        for device in resource_slice["spec"].get("devices", []):
            if attribute(device, "type") != "gpu":
                continue
            assert attribute(device, "driverVersion") == normalize_version(nvml.nvmlSystemGetDriverVersion())
            assert attribute(device, "cudaDriverVersion") == normalize_version(
                f"{cuda // 1000}.{cuda % 1000 // 10}"
            )
            checked += 1
    assert checked > 0
