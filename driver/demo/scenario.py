"""`fractional demo`: the whole system on one machine, with progress lines for a person to read.

The outcome is in the API (allocations, events, annotations), which is what the tests check;
the text is for people.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO, cast

from kubernetes import client

from driver.config import DemoConfig
from driver.demo.binder import PodBinder
from driver.demo.cluster import DemoNode, FakeCluster, wait_until
from driver.demo.consolidation_scene import run_consolidation_scene
from driver.demo.objects import (
    build_claim,
    build_pod,
    build_pod_group,
    build_workload,
    gpu_request,
    nic_request,
)
from driver.demo.preemption_scene import run_preemption_scene
from driver.demo.report import render_scrape_excerpt, write_packing_png
from driver.gpu_usage import compute_gpu_usage, render_usage_table
from driver.kube import REQUEST_TIMEOUT_SECONDS, as_dict, new_api_client

__all__ = ["SCENARIOS", "Scenario", "run_demo"]

NAMESPACE = "demo"
HINT_ANNOTATION = "fractional.dev/scale-up-hint"
STEP_TIMEOUT_SECONDS = 60.0


@dataclass(frozen=True, slots=True)
class Scenario:
    nodes: tuple[tuple[str, str, str], ...]  # (name, profile, zone)
    inference_pods: int
    inference_memory: str
    inference_compute: int
    training_pods: int
    too_large_pods: int
    too_large_selector: str


SCENARIOS = {
    "full": Scenario(
        nodes=(
            ("node-a", "h100-8x", "zone-1"),
            ("node-b", "h100-8x", "zone-1"),
            ("node-c", "a100-pcie-4x", "zone-2"),
        ),
        inference_pods=18,
        inference_memory="12Gi",
        inference_compute=15,
        training_pods=4,
        too_large_pods=20,
        too_large_selector='device.attributes["fractional.dev"].productName.startsWith("NVIDIA H100")',
    ),
    "small": Scenario(
        nodes=(
            ("node-a", "h100-8x", "zone-1"),
            ("node-b", "a100-pcie-4x", "zone-1"),
            ("node-c", "l4-2x", "zone-2"),
        ),
        inference_pods=6,
        inference_memory="12Gi",
        inference_compute=15,
        training_pods=2,
        too_large_pods=10,
        too_large_selector='device.attributes["fractional.dev"].productName.startsWith("NVIDIA H100")',
    ),
}


class _Demo:
    def __init__(self, config: DemoConfig, stop: threading.Event, out: TextIO) -> None:
        self.config = config
        self.stop = stop
        self.out = out
        self.scenario = SCENARIOS[config.scenario]
        self.cluster = FakeCluster(nodes_spec=list(self.scenario.nodes))
        self.started = time.monotonic()
        self.binder_stop = threading.Event()  # the binder ends before the API and the agents do
        self.binder: PodBinder | None = None
        self.core: client.CoreV1Api
        self.resource: client.ResourceV1Api

    def say(self, message: str) -> None:
        self.out.write(f"[{time.monotonic() - self.started:5.1f}s] {message}\n")
        self.out.flush()

    # ---- API helpers ---------------------------------------------------------------------------
    def _raw(self, obj: Any) -> dict[str, Any]:
        return as_dict(obj)

    def claims(self) -> list[dict[str, Any]]:
        items = self.resource.list_namespaced_resource_claim(
            NAMESPACE, _request_timeout=REQUEST_TIMEOUT_SECONDS
        )
        return [self._raw(c) for c in items.items]

    def pods(self) -> list[dict[str, Any]]:
        items = self.core.list_namespaced_pod(NAMESPACE, _request_timeout=REQUEST_TIMEOUT_SECONDS)
        return [self._raw(p) for p in items.items]

    def slices(self) -> list[dict[str, Any]]:
        items = self.resource.list_resource_slice(_request_timeout=REQUEST_TIMEOUT_SECONDS)
        return [self._raw(s) for s in items.items]

    def create_workload(
        self,
        name: str,
        requests: list[dict[str, Any]],
        *,
        match_pcie_root: bool = False,
        gang: str | None = None,
        gang_size: int | None = None,
        pod_group: str | None = None,
    ) -> None:
        claim = build_claim(f"{name}-claim", NAMESPACE, requests, match_pcie_root=match_pcie_root)
        self.resource.create_namespaced_resource_claim(
            NAMESPACE, cast(Any, claim), _request_timeout=REQUEST_TIMEOUT_SECONDS
        )
        pod = build_pod(
            name, NAMESPACE, [f"{name}-claim"], gang=gang, gang_size=gang_size, pod_group=pod_group
        )
        self.core.create_namespaced_pod(NAMESPACE, cast(Any, pod), _request_timeout=REQUEST_TIMEOUT_SECONDS)

    def running(self, names: list[str]) -> bool:
        phases = {p["metadata"]["name"]: (p.get("status") or {}).get("phase") for p in self.pods()}
        return all(phases.get(n) == "Running" for n in names)

    def allocation_of(self, claim_name: str) -> list[dict[str, Any]]:
        for claim in self.claims():
            if claim["metadata"]["name"] == claim_name:
                allocation = (claim.get("status") or {}).get("allocation") or {}
                results: list[dict[str, Any]] = (allocation.get("devices") or {}).get("results") or []
                return results
        return []

    def expect(self, predicate: Any, what: str) -> None:
        if not wait_until(predicate, STEP_TIMEOUT_SECONDS, self.stop):
            if self.stop.is_set():
                raise KeyboardInterrupt
            raise TimeoutError(f"demo step did not complete within {STEP_TIMEOUT_SECONDS:.0f}s: {what}")

    # ---- the story -----------------------------------------------------------------------------
    def run(self) -> int:
        s = self.scenario
        self.say("starting the embedded Kubernetes API (a test double) on 127.0.0.1")
        configuration = self.cluster.start_api(write_delay_ms=self.config.write_delay_ms)
        api_client = new_api_client(configuration)
        self.core = client.CoreV1Api(api_client)
        self.resource = client.ResourceV1Api(api_client)
        self.cluster.create_base_objects(configuration, NAMESPACE)
        node_list = ", ".join(f"{n} ({p})" for n, p, _ in s.nodes)
        self.say(f"starting {len(s.nodes)} node agents with fake devices: {node_list}")
        self.cluster.start_agents()
        self.cluster.register_kubelets()
        self.say("kubelet simulators registered with every node agent over its unix socket")
        self.expect(
            lambda: {sl["spec"]["nodeName"] for sl in self.slices()} >= {n for n, _, _ in s.nodes},
            "every node publishes its ResourceSlices",
        )
        published = self.slices()
        device_count = sum(len(sl["spec"].get("devices") or []) for sl in published)
        self.say(f"{len(published)} ResourceSlices published, {device_count} devices")
        self.cluster.start_controller()
        binder = PodBinder(configuration, NAMESPACE, {n.name: n.kubelet for n in self.cluster.nodes})
        binder.start(self.binder_stop)
        self.binder = binder
        self.say(f"allocation controller started (policy {self.cluster.policy})")
        for node in self.cluster.nodes:
            self.say(f"metrics of node agent {node.name}: {node.metrics_url}")
        self.say(f"metrics of the allocation controller: {self.cluster.controller_metrics_url}")

        # 1. inference shares, packed
        names = [f"infer-{i}" for i in range(s.inference_pods)]
        self.say(
            f"creating {len(names)} inference pods, each asking for a {s.inference_memory} / "
            f"{s.inference_compute}% GPU share"
        )
        for name in names:
            self.create_workload(name, [gpu_request(memory=s.inference_memory, compute=s.inference_compute)])
        self.expect(lambda: self.running(names), "inference pods allocated, bound and prepared")
        gpus_used = {(r["pool"], r["device"]) for n in names for r in self.allocation_of(f"{n}-claim")}
        self.say(
            f"{len(names)} inference pods running on {len(gpus_used)} GPUs: "
            + ", ".join(f"{p}/{d}" for p, d in sorted(gpus_used))
        )

        # 2. a training gang: whole GPUs, each paired with a NIC under one PCIe root
        gang = [f"train-{i}" for i in range(s.training_pods)]
        self.say(
            f"creating training gang 'train' as Kubernetes writes gangs (scheduling.k8s.io/v1beta1 Workload "
            f"+ PodGroup, minCount {len(gang)}): {len(gang)} pods, whole GPU + NIC on one PCIe root each"
        )
        custom = client.CustomObjectsApi(self.core.api_client)
        for plural, body in (
            ("workloads", build_workload("train", NAMESPACE, "workers", len(gang))),
            ("podgroups", build_pod_group("train-workers-0", NAMESPACE, "train", "workers", len(gang))),
        ):
            custom.create_namespaced_custom_object(
                "scheduling.k8s.io",
                "v1beta1",
                NAMESPACE,
                plural,
                body,
                _request_timeout=REQUEST_TIMEOUT_SECONDS,
            )
        for name in gang:
            self.create_workload(
                name, [gpu_request(), nic_request()], match_pcie_root=True, pod_group="train-workers-0"
            )
        self.expect(lambda: self.running(gang), "training gang allocated and running")
        for name in gang:
            results = self.allocation_of(f"{name}-claim")
            pairs = " + ".join(f"{r['pool']}/{r['device']}" for r in results)
            self.say(f"  {name}: {pairs}")

        # 3. a gang that cannot fit
        big = [f"big-{i}" for i in range(s.too_large_pods)]
        self.say(
            f"creating gang 'big': {len(big)} pods, each a whole H100 + NIC — more than the cluster has free"
        )
        for name in big:
            self.create_workload(
                name,
                [gpu_request(selector=s.too_large_selector), nic_request()],
                match_pcie_root=True,
                gang="big",
                gang_size=len(big),
            )
        self.expect(lambda: self._gang_event("big") is not None, "GangUnschedulable event for gang 'big'")
        event = self._gang_event("big")
        allocated = sum(1 for n in big if self.allocation_of(f"{n}-claim"))
        self.say(f"gang 'big' stays gated, {allocated} of its claims allocated; Event {event}")
        self.expect(lambda: self._hint(big[0]) is not None, "scale-up hint on gang 'big'")
        self.say(f"scale-up hint on its pods: {self._hint(big[0])}")

        # 4. delete one inference pod, its share is reused
        victim = names[1]
        victim_gpu = [(r["pool"], r["device"]) for r in self.allocation_of(f"{victim}-claim")]
        self.say(f"deleting pod {victim} (share on {victim_gpu[0][0]}/{victim_gpu[0][1]})")
        self.core.delete_namespaced_pod(victim, NAMESPACE, _request_timeout=REQUEST_TIMEOUT_SECONDS)
        self.expect(lambda: not self.allocation_of(f"{victim}-claim"), "controller releases the share")
        self.resource.delete_namespaced_resource_claim(
            f"{victim}-claim", NAMESPACE, _request_timeout=REQUEST_TIMEOUT_SECONDS
        )
        newcomer = f"infer-{s.inference_pods}"
        self.create_workload(newcomer, [gpu_request(memory=s.inference_memory, compute=s.inference_compute)])
        self.expect(lambda: self.running([newcomer]), "new inference pod running")
        new_gpu = [(r["pool"], r["device"]) for r in self.allocation_of(f"{newcomer}-claim")]
        reused = "reusing the freed share's GPU" if new_gpu == victim_gpu else "on another GPU"
        self.say(f"new pod {newcomer} placed on {new_gpu[0][0]}/{new_gpu[0][1]}, {reused}")

        self._report(names[:1] + names[2:] + [newcomer], binder)

        # 5. priority preemption: low-priority shares fill the quietest node, a high-priority gang
        # arrives there (after the report: its victims may include the inference shares above)
        run_preemption_scene(self, NAMESPACE)
        # 6. consolidation: a whole-GPU pod of the same priority, served by moving a share
        run_consolidation_scene(self, NAMESPACE)
        return 0

    def _report_scrape(self, node: DemoNode, pod: str, claim_name: str) -> None:
        results = self.allocation_of(claim_name)
        if not results:
            return
        lines = render_scrape_excerpt(
            _scrape(node.metrics_url), node=node.name, gpu=results[0]["device"], pod=pod
        )
        self.out.write(f"one scrape of {node.metrics_url} (GPU {results[0]['device']} and pod {pod}):\n")
        for line in lines:
            self.out.write(f"  {line}\n")
        self.out.write("\n")

    def _gang_event(self, gang: str) -> str | None:
        events = self.core.list_namespaced_event(NAMESPACE, _request_timeout=REQUEST_TIMEOUT_SECONDS)
        for event in events.items:
            if event.reason == "GangUnschedulable":
                return f"{event.reason}: {event.message}"
        return None

    def _hint(self, pod_name: str) -> str | None:
        pod = self.core.read_namespaced_pod(pod_name, NAMESPACE, _request_timeout=REQUEST_TIMEOUT_SECONDS)
        value = (as_dict(pod)["metadata"].get("annotations") or {}).get(HINT_ANNOTATION)
        return str(value) if value else None

    def _report(self, inference: list[str], binder: PodBinder) -> None:
        usage = compute_gpu_usage(self.slices(), self.claims())
        self.out.write("\nGPU memory and compute in use (from the claims' allocations):\n")
        self.out.write(render_usage_table(usage) + "\n\n")
        bound = binder.bound()
        sample = bound.get(inference[0])
        if sample is not None:
            node = next(n for n in self.cluster.nodes if n.name == sample.node)
            env = _cdi_environment(node.cdi_root, sample.claims[0]["uid"])
            self.out.write(
                f"CDI environment of pod {sample.name} on {sample.node} ({', '.join(sample.cdi_devices)}):\n"
            )
            for line in env:
                self.out.write(f"  {line}\n")
            self.out.write("\n")
            self._report_scrape(node, sample.name, sample.claims[0]["name"])
        inference_gpus = {
            (r["pool"], r["device"]) for n in inference for r in self.allocation_of(f"{n}-claim")
        }
        self.out.write(
            f"these {len(inference)} inference pods used {len(inference_gpus)} GPUs; "
            f"whole-GPU allocation would need {len(inference)}\n"
        )
        picture = write_packing_png(
            usage,
            Path(self.config.output_dir) / "packing.png",
            f"fractional-dra demo: {len(inference)} inference shares on {len(inference_gpus)} GPUs",
        )
        self.out.write(f"packing picture written to {picture.resolve()}\n")


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=REQUEST_TIMEOUT_SECONDS) as answer:
        return str(answer.read().decode("utf-8"))


def _cdi_environment(cdi_root: Path, claim_uid: str) -> list[str]:
    env: list[str] = []
    for spec_path in sorted(cdi_root.glob(f"*_{claim_uid}.json")):
        spec = json.loads(spec_path.read_text(encoding="utf-8"))
        for device in spec.get("devices", []):
            env.extend((device.get("containerEdits") or {}).get("env", []))
        env.extend((spec.get("containerEdits") or {}).get("env", []))
    return env


def run_demo(config: DemoConfig, stop: threading.Event, out: TextIO) -> int:
    demo = _Demo(config, stop, out)
    try:
        status = demo.run()
        demo.say(f"demo finished in {time.monotonic() - demo.started:.1f}s")
        if config.keep_running and not stop.is_set():
            demo.out.write(
                f"\nthe API keeps running at {demo.cluster.api_server.url}\n"
                f"  kubeconfig: {demo.cluster.kubeconfig}\n"
                f"  try: KUBECONFIG={demo.cluster.kubeconfig} kubectl get resourceslices,resourceclaims -A\n"
                "press Ctrl-C to stop\n"
            )
            demo.out.flush()
            stop.wait()
        return status
    except KeyboardInterrupt:
        demo.say("interrupted; stopping everything")
        return 130
    finally:
        demo.binder_stop.set()
        if demo.binder is not None:
            demo.binder.join()
        demo.cluster.close()
