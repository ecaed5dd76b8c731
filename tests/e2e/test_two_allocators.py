"""Both allocators on the same GPUs: our controller (gated pods) and kube-scheduler (ungated pods)
allocate shares of mixed sizes from the same devices at the same time, with deletions in between.

Nothing in the API itself orders two allocators: each decides on what it has seen, and what the
other wrote in the last second or two is not among it. Before the allocation guard (recorded from
kube-scheduler 1.37.2 and our controller, both packing onto the fullest GPU) the *allocations* of
150 + 150 pods summed to up to 2.0x a device's compute and 1.57x its memory. The guard, a validating
webhook served by the leading controller, checks every allocation kube-scheduler writes for our
devices against everything counted before it, ours in flight included, and refuses the one that
would book a device past its capacity (kube-scheduler tries that pod again). What is checked here
from outside, at every point sampled and at the end:
- on every device, the sum of the allocated claims' consumedCapacity stays within the capacity the
  device publishes, per dimension (and so do the shares in use by running pods);
- no device is reported DeviceOvercommitted (nothing is);
- every pod is either running with its claim allocated, or waiting with a reason (kube-scheduler's
  PodScheduled condition or Event, the kubelet's FailedPrepareDynamicResources, or our Events);
- no claim is allocated on a node other than its pod's, and no device appears twice in one claim.

The figures (pods, deletions, the largest sum seen against capacity, the guard's refusals) are
written to ``.cluster/two-allocators.json`` for the record. FRACTIONAL_E2E_STRESS_PODS sets the
number of pods of each kind (150 by default).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import threading
import time
import urllib.request
from collections import defaultdict
from typing import Any

import pytest
from e2e_support import DRIVER, REPO_ROOT, apply, kubectl, list_items, pod, wait_for
from kubernetes.utils import parse_quantity
from test_driver import gpu_request, our_slices, template

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

PODS_EACH = int(os.environ.get("FRACTIONAL_E2E_STRESS_PODS", "150"))
SIZES = [("2Gi", "5"), ("4Gi", "10"), ("6Gi", "10"), ("8Gi", "15"), ("12Gi", "20"), ("20Gi", "25")]
GATE = "fractional.dev/allocation"
SAMPLE_SECONDS = 3.0
RESULTS = REPO_ROOT / ".cluster" / "two-allocators.json"

Device = tuple[str, str]  # (pool, device)


def _capacities() -> dict[Device, dict[str, float]]:
    capacity: dict[Device, dict[str, float]] = {}
    for resource_slice in our_slices():
        pool = resource_slice["spec"]["pool"]["name"]
        for device in resource_slice["spec"].get("devices", []):
            values = {k: float(parse_quantity(v["value"])) for k, v in device.get("capacity", {}).items()}
            capacity[(pool, device["name"])] = values
    return capacity


def _booked(claims: list[dict[str, Any]]) -> tuple[dict[Device, dict[str, float]], list[str]]:
    """Per device, the sum of what allocated claims consume; and claims that name a device twice."""
    sums: dict[Device, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    doubled = []
    for claim in claims:
        allocation = (claim.get("status") or {}).get("allocation")
        if not allocation:
            continue
        seen: set[tuple[Device, str | None]] = set()
        for result in allocation["devices"].get("results", []):
            if result["driver"] != DRIVER:
                continue
            key = ((result["pool"], result["device"]), result.get("shareID"))
            if key in seen:
                doubled.append(claim["metadata"]["name"])
            seen.add(key)
            for name, value in (result.get("consumedCapacity") or {}).items():
                sums[key[0]][name] += float(parse_quantity(value))
    return sums, doubled


class _Sampler:
    """Samples every claim in the cluster every few seconds and keeps the worst figures."""

    def __init__(self, capacity: dict[Device, dict[str, float]], namespace: str) -> None:
        self.capacity = capacity
        self.namespace = namespace
        self.samples = 0
        self.over: list[str] = []  # booked (allocated) past capacity: two allocators raced
        self.over_in_use: list[str] = []  # in use by running pods past capacity: must never be
        self.doubled: set[str] = set()
        self.highest: dict[str, float] = defaultdict(float)  # dimension -> largest booked / capacity
        self.highest_in_use: dict[str, float] = defaultdict(float)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def check(self, claims: list[dict[str, Any]], running: set[tuple[str, str]]) -> None:
        """``running``: (namespace, name) of the pods running now."""
        sums, doubled = _booked(claims)
        self.doubled.update(doubled)
        in_use, _ = _booked([c for c in claims if _reserved_by_running(c, running)])
        for booked, highest, over in ((sums, self.highest, self.over),
                                      (in_use, self.highest_in_use, self.over_in_use)):  # fmt: skip
            for device, dims in booked.items():
                for name, total in dims.items():
                    limit = self.capacity.get(device, {}).get(name)
                    if not limit:
                        continue
                    highest[name] = max(highest[name], total / limit)
                    if total > limit:
                        over.append(f"{device[0]}/{device[1]} {name}: {total:.0f} > {limit:.0f}")
        self.samples += 1

    def sample(self) -> None:
        pods = list_items("pods", "--all-namespaces")
        running = {
            (p["metadata"]["namespace"], p["metadata"]["name"])
            for p in pods
            if p.get("status", {}).get("phase") == "Running"
        }
        self.check(list_items("resourceclaims", "--all-namespaces"), running)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            try:
                self.sample()
            except Exception:  # a slow answer under load: the next sample counts
                continue

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def _devices_of(claim: dict[str, Any]) -> set[Device]:
    allocation = (claim.get("status") or {}).get("allocation") or {}
    return {(r["pool"], r["device"]) for r in allocation.get("devices", {}).get("results", [])}


def _reserved_by_running(claim: dict[str, Any], running: set[tuple[str, str]]) -> bool:
    namespace = claim["metadata"]["namespace"]
    reserved = (claim.get("status") or {}).get("reservedFor") or []
    return any(r.get("resource") == "pods" and (namespace, r.get("name")) in running for r in reserved)


def _pods(namespace: str) -> dict[str, dict[str, Any]]:
    return {p["metadata"]["name"]: p for p in list_items("pods", "-n", namespace)}


def _settled(namespace: str, quiet: float = 30.0, timeout: float = 900.0) -> dict[str, dict[str, Any]]:
    """Wait until the number of running pods has not changed for ``quiet`` seconds."""
    deadline = time.monotonic() + timeout
    last, since = -1, time.monotonic()
    while True:
        pods = _pods(namespace)
        running = sum(1 for p in pods.values() if p.get("status", {}).get("phase") == "Running")
        if running != last:
            last, since = running, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return pods
        assert time.monotonic() < deadline, f"never settled: {running} running"
        time.sleep(5)


def _waiting_reason(pod_object: dict[str, Any], events: dict[str, list[str]]) -> str | None:
    for condition in pod_object.get("status", {}).get("conditions", []):
        said = condition.get("message") or condition.get("reason") not in (None, "SchedulingGated")
        if condition["type"] == "PodScheduled" and condition["status"] == "False" and said:
            return str(condition.get("message") or condition.get("reason"))
    reasons = events.get(pod_object["metadata"]["name"])
    return "; ".join(reasons) if reasons else None


def _guard_reviews() -> dict[str, float] | None:
    """The leading controller's allocation guard counters, read from its metrics port when this
    machine can reach it (the local cluster's pods run on the host network); None otherwise."""
    counts: dict[str, float] = {}
    for controller in list_items(
        "pods", "-n", "fractional-system", "-l", "app.kubernetes.io/component=controller"
    ):
        address = (controller.get("status") or {}).get("podIP")
        if not address:
            continue
        try:
            with urllib.request.urlopen(f"http://{address}:8081/metrics", timeout=5) as response:
                text = response.read().decode()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("fractional_controller_allocation_guard_reviews_total{"):
                outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
                counts[outcome] = counts.get(outcome, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts or None


def test_both_allocators_never_book_the_same_capacity_twice(namespace: str) -> None:
    rng = random.Random(20261201)
    capacity = _capacities()
    objects: list[dict[str, Any]] = []
    ours, theirs = [], []
    for index in range(PODS_EACH * 2):
        gated = index % 2 == 0
        name = f"{'ours' if gated else 'theirs'}-{index // 2:03d}"
        memory, compute = rng.choice(SIZES)
        body = pod(name, {"gpu": {"resourceClaimTemplateName": name}}, command="exec sleep 3600")
        if gated:
            body["spec"]["schedulingGates"] = [{"name": GATE}]
        objects += [template(name, [gpu_request(memory=memory, compute=compute)]), body]
        (ours if gated else theirs).append(name)
    deleted: list[str] = []
    with _Sampler(capacity, namespace) as sampler:
        for start in range(0, len(objects), 100):  # one apply per 50 pods: both kinds arrive together
            apply(objects[start : start + 100], namespace)
        first = _settled(namespace)
        running = [n for n, p in first.items() if p.get("status", {}).get("phase") == "Running"]
        deleted = rng.sample(running, len(running) // 3)
        kubectl("delete", "pod", "-n", namespace, "--wait=false", *deleted, timeout=300)
        final = _settled(namespace)
        sampler.sample()

    def unreported() -> list[str]:
        """Devices booked past capacity none of whose claims has our DeviceOvercommitted Event."""
        claims = list_items("resourceclaims", "-n", namespace)
        told = {
            e["involvedObject"]["name"]
            for e in list_items("events", "-n", namespace)
            if e.get("reason") == "DeviceOvercommitted"
        }
        booked, _ = _booked(claims)
        missing = []
        for device, dims in booked.items():
            limits = capacity.get(device, {})
            over = any(total > limits.get(name, float("inf")) for name, total in dims.items())
            if over and not {c["metadata"]["name"] for c in claims if device in _devices_of(c)} & told:
                missing.append(f"{device[0]}/{device[1]}")
        return missing

    # The controller reports what it sees on its periodic pass: give the last change one pass.
    with contextlib.suppress(AssertionError):  # the figures below name what is left
        wait_for(lambda: not unreported(), timeout=120, what="every overbooked device reported")
    left_unreported = unreported()
    claims = {c["metadata"]["name"]: c for c in list_items("resourceclaims", "-n", namespace)}
    events: dict[str, list[str]] = defaultdict(list)
    for event in list_items("events", "-n", namespace):
        if event.get("type") == "Warning":
            events[event["involvedObject"]["name"]].append(f"{event['reason']}: {event.get('message', '')}")
    problems = []
    running_by_kind = {"ours": 0, "theirs": 0}
    for name, pod_object in final.items():
        phase = pod_object.get("status", {}).get("phase")
        statuses = pod_object.get("status", {}).get("resourceClaimStatuses", [])
        claim = claims.get(statuses[0]["resourceClaimName"]) if statuses else None
        if phase == "Running":
            running_by_kind[name.split("-")[0]] += 1
            allocation = (claim or {}).get("status", {}).get("allocation")
            if not allocation:
                problems.append(f"{name} runs without an allocated claim")
                continue
            (result,) = [r for r in allocation["devices"]["results"] if r["driver"] == DRIVER]
            pool_nodes = {s["spec"]["pool"]["name"]: s["spec"]["nodeName"] for s in our_slices()}
            if pool_nodes.get(result["pool"]) != pod_object["spec"]["nodeName"]:
                node = pod_object["spec"]["nodeName"]
                problems.append(f"{name} runs on {node}, its GPU is in pool {result['pool']}")
        elif phase == "Pending":
            if _waiting_reason(pod_object, events) is None:
                problems.append(f"{name} is Pending with no reason")
        else:
            problems.append(f"{name} is {phase}")
    refused_by_guard = sum(
        1
        for e in list_items("events", "-n", namespace)
        if e.get("reason") == "FailedScheduling" and "allocation guard" in (e.get("message") or "")
    )
    figures = {
        "pods_each_kind": PODS_EACH,
        "pods_told_the_guard_refused_their_allocation": refused_by_guard,
        "guard_reviews": _guard_reviews(),
        "deleted": len(deleted),
        "samples": sampler.samples,
        "largest_booked_over_capacity": dict(sampler.highest),
        "largest_in_use_over_capacity": dict(sampler.highest_in_use),
        "samples_with_a_device_booked_past_capacity": len(sampler.over),
        "booked_past_capacity": sampler.over[:10],
        "in_use_past_capacity": sampler.over_in_use[:10],
        "overbooked_devices_unreported": left_unreported,
        "claims_naming_a_device_twice": sorted(sampler.doubled),
        "running_at_end": running_by_kind,
        "pending_at_end": sum(1 for p in final.values() if p.get("status", {}).get("phase") == "Pending"),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    assert sampler.samples >= 3, figures
    assert not sampler.over, figures  # booked: the allocation guard orders the two allocators
    assert not sampler.over_in_use, figures
    assert not left_unreported, figures
    assert not sampler.doubled, figures
    assert not problems, problems[:20]
    assert running_by_kind["ours"] > 0 and running_by_kind["theirs"] > 0, figures
