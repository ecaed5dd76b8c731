"""Production size on the real control plane: thousands of kwok GPU nodes, our controller side by
side with kube-scheduler (its default profile and its packing profile), at two client limits.

Not part of ``make bench`` (it takes an hour and more): ``make bench-scale`` runs it; its section of
BENCHMARKS.md and ``bench/results/scale.json`` come from it.

The control plane (``hack/localcluster``, release ``K8S_VERSION``, default 1.37.2; no kubelet), tuned
for one small machine:
- etcd and every component's state on tmpfs (``FRACTIONAL_BENCH_SCALE_DIR``, default
  ``/dev/shm/fractional-bench-scale``); the audit log on disk (``<dir>-audit.log`` beside ``/tmp``);
- kube-apiserver ``--max-requests-inflight=800 --max-mutating-requests-inflight=400`` (twice the
  defaults: the load generator's bursts are not what is measured), audit policy Metadata for
  kube-scheduler and our controller only, blocking mode;
- kube-controller-manager without its node-lifecycle controller (kwok keeps no heartbeats) and at
  500 qps / 1000 burst: it makes the claims from templates, which both paths need alike;
- identities and priority levels (API Priority and Fairness): the load generator (this script) and
  kwok are ``system:masters`` (the ``exempt`` level: neither throttled nor sharing a level with what
  is measured); kube-scheduler is ``system:kube-scheduler`` (``workload-high``, upstream's own
  FlowSchema); our controller is the user ``fractional-controller``, not a master, bound to
  ``cluster-admin`` and put in ``workload-high`` by the chart's own FlowSchema (rendered from the
  chart, its subject changed from the ServiceAccount to this user), as a chart install does.

The fleet: ``hack/localcluster fleet`` (kwok v0.8.0 on the label ``fractional.dev/fleet=kwok``, each
node's ResourceSlices from our agent's own publisher), ``--nodes`` Nodes of ``h100-8x`` (8 GPUs of
79Gi) with 224 CPUs, 2000Gi of memory and 110 pods each. Bound pods are made Running by kwok.

Paths, each on the same cluster one after the other (their order alternates between settings):
- ``kube-scheduler``: ungated pods, kube-scheduler's default profile allocates (consumable capacity)
  and binds;
- ``kube-scheduler-mostallocated``: the same with NodeResourcesFit's ``MostAllocated`` scoring (cpu
  and memory, weight 1 each): the profile a user who cares about packing configures. kube-scheduler
  scores nodes by CPU and memory, not by devices, so every pod here asks for CPU and memory in
  proportion to its GPU memory (24 CPUs and 200Gi per whole GPU): packing nodes by CPU packs GPUs;
- ``ours``: the same pods gated; our controller allocates and ungates, kube-scheduler (default
  profile) binds.

Settings (client limits, the same for kube-scheduler and our controller in each):
``default`` = kube-scheduler's defaults, 50 qps and bursts of 100; ``raised`` = 500 and 1000.

Cases, per setting and path:
- **fill**: from empty to 90 % of the fleet's GPUs: 8-GPU pods to 80 %, then 1-GPU pods to 85 % and
  shares (10Gi/10 %, 20Gi/25 %, 40Gi/50 %, in turn) to 90 %, created in one seeded shuffled order
  as fast as 6 client threads can (the same list for every path). Bound pods per second (average,
  and the 10th/50th/90th percentiles of the per-second counts), create-to-bound p50/p90/p99, the
  pods left unbound once all are bound, 30 s pass with no bind, or ``--fill-timeout`` (300 s) has
  passed since the first create (``stopped_at_s``); those are deleted before the churn;
- **churn**, on the filled fleet: ``--churn-seconds`` of ``--churn-rate`` departures a second (live
  pods drawn at random), each followed by an arrival of the same shape; create-to-bound of the
  arrivals p50/p99, then the whole GPUs free (no allocation at all), the nodes with 8 free GPUs, the
  GPUs' worth allocated, and ``whole_free_share``: of the capacity left, the share in whole GPUs
  (the paths bind different numbers of pods in the fill: raw counts of free GPUs do not compare);
- **steady**, from empty: 8-GPU pods to 0 %, 50 % and 99 % of the GPUs, and at each level a stream
  of ``--steady-pods`` 12Gi/15 % shares, ``--steady-interval`` apart (a few in flight):
  create-to-bound p50/p99 per level;
- **gangs**: ``--small-gangs`` gangs of 3 pods, then ``--large-gangs`` of ``--large-gang-size``,
  each pod one whole GPU: from the first create to all bound; kube-scheduler's paths by its own gang
  scheduling (a ``scheduling.k8s.io`` PodGroup with ``minCount`` the gang's size, pods ungated), ours
  by the same PodGroup with the pods gated. ``created_s``: from the first create to the last (one
  client, gang after gang: its pace is part of ``all_bound_s``). After 60 s without a bind the
  case prints each pod still unbound (its gates, ``PodScheduled`` condition and claims) and its
  PodGroup's conditions, and stops (``--gang-patience`` waits longer, to see a stall end);

Cost, per case: API requests per bound pod of kube-scheduler and of our controller (audit log,
watches counted once; kube-controller-manager's apart: it makes the claims from templates on every
path and releases the allocations kube-scheduler made, where our controller releases its own), CPU
seconds per 1,000 bound pods of every process (kube-apiserver, etcd, kube-controller-manager,
kube-scheduler, kwok, our controller); our controller's peak RSS and its
start-up (process start to its first decision: a gated pod made before it started is ungated), once
per setting on the idle fleet.

Writes ``bench/results/scale.json`` (rows of other sizes already there are kept, each row has its
own commit and date). Needs root and the upstream binaries with kwok (``COMPONENTS=kwok
hack/upstream-build.sh``); no other local cluster may be up. Run:
    .venv/bin/python bench/production_scale.py --nodes 1000 [--settings default,raised]
        [--paths ...] [--cases fill,churn,steady,gangs] [--small-gangs 1000] [--large-gangs 3]
        [--large-gang-size 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "hack"))

import yaml
from kubernetes import client

from bench._common import RESULTS_DIR, commit, machine, percentile, write_result
from bench.bench_real import Usage
from driver.allocator.quantity import parse_quantity
from driver.kube import load_configuration
from driver.slices import build_device_classes

ROOT = Path(__file__).resolve().parent.parent
VERSION = os.environ.get("K8S_VERSION", "1.37.2").lstrip("v")
STATE_DIR = Path(os.environ.get("FRACTIONAL_BENCH_SCALE_DIR", "/dev/shm/fractional-bench-scale"))
AUDIT_LOG = Path("/tmp") / f"{STATE_DIR.name}-audit.log"
NAMESPACE = "bench"
GATE = "fractional.dev/allocation"
DRIVER = "fractional.dev"
PROFILE = "h100-8x"
GPU_MEMORY_GI = 79
SCHEDULER_USER = "system:kube-scheduler"
MANAGER_USER = (
    "system:kube-controller-manager"  # claims from templates (both paths), kube-scheduler's releases
)
CONTROLLER_USER = "fractional-controller"
PATHS = ("kube-scheduler", "kube-scheduler-mostallocated", "ours")
SETTINGS = {"default": (50, 100), "raised": (500, 1000)}
CASES = ("fill", "churn", "steady", "gangs")
COMPONENTS = ("kube-apiserver", "etcd", "kube-controller-manager", "kube-scheduler", "kwok")
NODE_CPU, NODE_MEMORY_GI, NODE_PODS = 224, 2000, 110
CPU_PER_GPU, MEMORY_GI_PER_GPU = 24, 200
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "Metadata", "users": [SCHEDULER_USER, CONTROLLER_USER, MANAGER_USER]},
        {"level": "None"},
    ],
}


# -------------------------------------------------------------------------------- pod shapes


@dataclass(frozen=True)
class Shape:
    """What one pod asks for: a claim template and the CPU and memory that go with it."""

    name: str
    gpus: int  # whole GPUs (count of the request); 0 for a share
    memory_gi: int = 0  # a share's GPU memory
    compute: int = 0  # a share's compute percent

    @property
    def gpu_fraction(self) -> float:
        return float(self.gpus) if self.gpus else self.memory_gi / GPU_MEMORY_GI

    @property
    def cpu_milli(self) -> int:
        return round(1000 * CPU_PER_GPU * self.gpu_fraction)

    @property
    def memory_mi(self) -> int:
        return round(1024 * MEMORY_GI_PER_GPU * self.gpu_fraction)

    def template(self) -> dict[str, Any]:
        exactly: dict[str, Any] = {"deviceClassName": "gpu.fractional.dev"}
        if self.gpus:
            exactly["count"] = self.gpus
        else:
            exactly["capacity"] = {
                "requests": {"memory": f"{self.memory_gi}Gi", "compute": str(self.compute)}
            }
        return {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": self.name, "namespace": NAMESPACE},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}},
        }  # fmt: skip


WHOLE8 = Shape("whole-8", 8)
WHOLE1 = Shape("whole-1", 1)
SHARES = (
    Shape("share-10gi-10", 0, 10, 10),
    Shape("share-20gi-25", 0, 20, 25),
    Shape("share-40gi-50", 0, 40, 50),
)
STREAM = Shape("share-12gi-15", 0, 12, 15)
SHAPES = {s.name: s for s in (WHOLE8, WHOLE1, *SHARES, STREAM)}


def fill_plan(gpus: int, seed: int = 42) -> list[tuple[str, Shape]]:
    """The fill case's pods, in their (seeded, shuffled) order of creation: 8-GPU pods to 80 % of
    ``gpus``, 1-GPU pods to 85 %, shares to 90 %."""
    pods: list[Shape] = [WHOLE8] * int(0.80 * gpus / 8)
    pods += [WHOLE1] * int(0.05 * gpus)
    asked, turn = sum(p.gpu_fraction for p in pods), 0
    while asked + SHARES[turn % len(SHARES)].gpu_fraction <= 0.90 * gpus:
        pods.append(SHARES[turn % len(SHARES)])
        asked += pods[-1].gpu_fraction
        turn += 1
    random.Random(seed).shuffle(pods)
    return [(f"f{index:05d}", shape) for index, shape in enumerate(pods)]


def pod_body(name: str, shape: Shape, *, gated: bool, group: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": 0,
        "tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}],
        "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": shape.name}],
        "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10", "resources": {
            "requests": {"cpu": f"{shape.cpu_milli}m", "memory": f"{shape.memory_mi}Mi"},
            "claims": [{"name": "gpu"}]}}],
    }  # fmt: skip
    if gated:
        spec["schedulingGates"] = [{"name": GATE}]
    if group:
        spec["schedulingGroup"] = {"podGroupName": group}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": spec,
    }


# -------------------------------------------------------------------------------- the cluster


def scheduler_config(directory: Path, kubeconfig: Path, qps: int, burst: int, packing: bool) -> Path:
    """A KubeSchedulerConfiguration: the client limits, and MostAllocated scoring for ``packing``."""
    profile: dict[str, Any] = {"schedulerName": "default-scheduler"}
    if packing:
        profile["pluginConfig"] = [{"name": "NodeResourcesFit", "args": {"scoringStrategy": {
            "type": "MostAllocated",
            "resources": [{"name": "cpu", "weight": 1}, {"name": "memory", "weight": 1}]}}}]  # fmt: skip
    document = {
        "apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig), "qps": qps, "burst": burst},
        "leaderElection": {"leaderElect": False},
        "profiles": [profile],
    }  # fmt: skip
    path = directory / f"scheduler-{qps}-{'mostallocated' if packing else 'default'}.yaml"
    path.write_text(yaml.safe_dump(document), encoding="utf-8")
    return path


def binaries() -> Any:
    from localcluster.cluster import Binaries

    return Binaries.build(VERSION, "control-plane")


def start_cluster() -> Any:
    from localcluster.cluster import LocalCluster
    from localcluster.fleet import NO_NODE_LIFECYCLE

    STATE_DIR.mkdir(parents=True, exist_ok=True)
    policy = STATE_DIR.parent / f"{STATE_DIR.name}-audit-policy.json"
    policy.write_text(json.dumps(AUDIT_POLICY), encoding="utf-8")
    AUDIT_LOG.unlink(missing_ok=True)
    cluster = LocalCluster(
        state_dir=STATE_DIR, version=VERSION, nodes=(),
        clients={"bench": "/CN=fractional-bench/O=system:masters", "controller": f"/CN={CONTROLLER_USER}"},
        extra_args={
            "kube-apiserver": [f"--audit-policy-file={policy}", f"--audit-log-path={AUDIT_LOG}",
                               "--audit-log-maxsize=0", "--audit-log-mode=blocking",
                               "--max-requests-inflight=800", "--max-mutating-requests-inflight=400"],
            "kube-controller-manager": [NO_NODE_LIFECYCLE, "--kube-api-qps=500", "--kube-api-burst=1000"],
        },
    )  # fmt: skip
    if cluster.processes.get("kube-apiserver") is not None:
        cluster.down()
        return start_cluster()
    cluster.up_control_plane(binaries())
    return cluster


def controller_identity(api: client.ApiClient) -> None:
    """Our controller's user: cluster-admin by RBAC (not a master, so API Priority and Fairness
    classifies it), in the priority level the chart's FlowSchema gives the controller."""
    import helm_python as helm

    client.RbacAuthorizationV1Api(api).create_cluster_role_binding({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": "bench-fractional-controller"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": CONTROLLER_USER}],
    })  # fmt: skip
    chart = helm.Chart.load(str(ROOT / "charts" / "fractional-dra"))
    manifests = chart.render({}, name="fractional-dra", namespace="fractional-system", is_install=True)
    documents = [d for n, text in manifests.items() if n.endswith(".yaml") for d in yaml.safe_load_all(text)]
    schemas = [d for d in documents if d and d.get("kind") == "FlowSchema"]
    if not schemas:
        raise SystemExit("the chart renders no FlowSchema for the controller")
    for schema in schemas:
        schema["metadata"] = {"name": f"bench-{schema['metadata']['name']}"}
        for rule in schema["spec"].get("rules", []):
            rule["subjects"] = [{"kind": "User", "user": {"name": CONTROLLER_USER}}]
        client.FlowcontrolApiserverV1Api(api).create_flow_schema(schema)


def prepare(cluster: Any, nodes: int, *, ours: bool, trace_dir: Path | None = None) -> tuple[list[Any], int]:
    """The fleet (of ``nodes`` h100-8x, or the trace's cluster), the DeviceClasses, the namespace
    and templates (and our controller's identity where our path runs); returns the trace's nodes
    (none for the h100-8x fleet) and the fleet's GPUs."""
    from localcluster.fleet import up_fleet

    configuration = load_configuration(str(cluster.state_dir / "bench.kubeconfig"))
    with client.ApiClient(configuration) as api:
        resource = client.ResourceV1Api(api)
        for device_class in build_device_classes():
            resource.create_device_class(device_class)
        if ours:
            controller_identity(api)
        core = client.CoreV1Api(api)
        core.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        for shape in SHAPES.values():
            resource.create_namespaced_resource_claim_template(NAMESPACE, shape.template())
        deadline = time.monotonic() + 60
        while True:  # pods in a namespace need its default service account
            try:
                core.read_namespaced_service_account("default", NAMESPACE)
                break
            except client.ApiException:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    if trace_dir is not None:
        return trace_fleet(cluster, trace_dir)
    started = time.monotonic()
    up_fleet(cluster, nodes, profile=PROFILE, cpu=str(NODE_CPU), memory=f"{NODE_MEMORY_GI}Gi",
             pods=str(NODE_PODS), say=lambda line: print(line, flush=True))  # fmt: skip
    wait_ready(configuration, nodes)
    print(f"fleet of {nodes} nodes ready in {time.monotonic() - started:.0f} s", flush=True)
    return [], 8 * nodes


def wait_ready(configuration: client.Configuration, nodes: int) -> None:
    with client.ApiClient(configuration) as api:
        core = client.CoreV1Api(api)
        deadline = time.monotonic() + 600
        while True:  # kwok's node-initialize stage makes them Ready
            listed = core.list_node(label_selector="fractional.dev/fleet=kwok").items
            ready = sum(1 for n in listed if any(c.type == "Ready" and c.status == "True"
                                                 for c in n.status.conditions or ()))  # fmt: skip
            if ready >= nodes:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"only {ready} of {nodes} fleet nodes Ready after 600 s")
            time.sleep(2)


# -------------------------------------------------------------------------------- observing


@dataclass
class Tracker:
    """Per pod name: created (before the request), ungated and bound (first seen so on a watch).

    The watch can fall behind: seen at 1,000 nodes after the churn, a gang's pods were bound (their
    ``nodeName`` set) for over a minute before the watch said so, and the case stopped on its stall
    with them counted unbound. So the watch has a client-side read timeout (a silent stream is cut
    and listed again), and ``wait`` reads the pods still missing once before it gives up: a pod bound
    meanwhile takes its bind time from its ``PodScheduled`` condition (seconds, the server's clock)."""

    api: client.ApiClient
    created: dict[str, float] = field(default_factory=dict)
    ungated: dict[str, float] = field(default_factory=dict)
    bound: dict[str, float] = field(default_factory=dict)
    binds: int = 0
    wall_offset: float = field(default_factory=lambda: time.time() - time.monotonic())
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        threading.Thread(target=self._watch, daemon=True, name="tracker").start()

    def _watch(self) -> None:
        """List, then watch from there; raw JSON lines (this process shares the machine with what
        it measures: no model objects)."""
        core = client.CoreV1Api(self.api)
        while not self.stop.is_set():
            try:
                listing = json.loads(core.list_namespaced_pod(NAMESPACE, _preload_content=False).data)
                self._see(listing["items"])
                response = core.list_namespaced_pod(
                    NAMESPACE, watch=True, resource_version=listing["metadata"]["resourceVersion"],
                    timeout_seconds=30, allow_watch_bookmarks=True, _preload_content=False,
                    _request_timeout=(10, 40),
                )  # fmt: skip
                buffer = b""
                for chunk in response.stream(65536):
                    if self.stop.is_set():
                        return
                    *lines, buffer = (buffer + chunk).split(b"\n")
                    events = [json.loads(line) for line in lines if line.strip()]
                    if any(e["type"] == "ERROR" for e in events):
                        break  # a 410: list again
                    self._see([e["object"] for e in events if e["type"] in ("ADDED", "MODIFIED")])
            except Exception:  # a dropped stream: list again
                time.sleep(0.2)

    def _see(self, pods: list[dict[str, Any]]) -> None:
        now = time.monotonic()
        with self.lock:
            for pod in pods:
                name, spec = pod["metadata"]["name"], pod.get("spec") or {}
                if name not in self.ungated and not any(
                    g.get("name") == GATE for g in spec.get("schedulingGates") or ()
                ):
                    self.ungated[name] = now
                if spec.get("nodeName") and name not in self.bound:
                    self.bound[name] = now
                    self.binds += 1

    def forget(self, names: list[str]) -> None:
        with self.lock:
            for name in names:
                for table in (self.created, self.ungated, self.bound):
                    table.pop(name, None)

    def wait(self, names: list[str], timeout: float, stall: float = 30.0) -> list[str]:
        """The names not bound once all are, after ``timeout``, or after ``stall`` seconds without a bind."""
        deadline = time.monotonic() + timeout
        progress, left_before = time.monotonic(), len(names) + 1
        while True:
            with self.lock:
                left = [n for n in names if n not in self.bound]
            now = time.monotonic()
            if len(left) < left_before:
                progress, left_before = now, len(left)
            if not left or now > deadline or now - progress > stall:
                return self.catch_up(left) if left else left
            time.sleep(0.05)

    def catch_up(self, names: list[str]) -> list[str]:
        """Of ``names`` (not seen bound), those still unbound after one read of the namespace."""
        listing = json.loads(
            client.CoreV1Api(self.api).list_namespaced_pod(NAMESPACE, _preload_content=False).data
        )
        found = bound_from_listing(listing["items"], set(names), self.wall_offset)
        with self.lock:
            for name, at in found.items():
                if name not in self.bound:
                    self.bound[name] = at
                    self.binds += 1
        if found:
            print(
                f"tracker: {len(found)} bind(s) the watch had not delivered, timed by PodScheduled",
                flush=True,
            )
        return [n for n in names if n not in found]

    def latencies(self, names: list[str]) -> list[float]:
        with self.lock:
            return [self.bound[n] - self.created[n] for n in names if n in self.bound and n in self.created]

    def decided(self, names: list[str]) -> list[float]:
        """Create-to-ungated of the gated pods among ``names`` (our controller's part of the path)."""
        with self.lock:
            return [
                self.ungated[n] - self.created[n] for n in names if n in self.ungated and n in self.created
            ]

    def bind_times(self, names: list[str]) -> list[float]:
        with self.lock:
            return sorted(self.bound[n] for n in names if n in self.bound)


def bound_from_listing(pods: list[dict[str, Any]], names: set[str], wall_offset: float) -> dict[str, float]:
    """Per pod of ``names`` bound in ``pods`` (a list's items): when, on the monotonic clock, from its
    ``PodScheduled=True`` transition (``wall_offset``: wall clock minus monotonic clock)."""
    found: dict[str, float] = {}
    for pod in pods:
        name = pod["metadata"]["name"]
        if name not in names or not (pod.get("spec") or {}).get("nodeName"):
            continue
        for condition in (pod.get("status") or {}).get("conditions") or ():
            if condition.get("type") == "PodScheduled" and condition.get("status") == "True":
                stamp = datetime.fromisoformat(str(condition["lastTransitionTime"]).replace("Z", "+00:00"))
                found[name] = stamp.timestamp() - wall_offset
                break
        else:
            found[name] = time.monotonic()  # bound, its condition not written yet: now
    return found


def _pod_scheduled(pod: dict[str, Any]) -> dict[str, Any]:
    """The pod's ``PodScheduled`` condition, or an empty dict."""
    conditions = (pod.get("status") or {}).get("conditions") or ()
    return next((c for c in conditions if c.get("type") == "PodScheduled"), {})


def stuck_report(pods: list[dict[str, Any]], claims: list[dict[str, Any]], names: set[str]) -> list[str]:
    """One line per pod of ``names`` still unbound in ``pods`` (a list's items): its scheduling
    gates, its ``PodScheduled`` condition, and each of its claims' allocation (node) and reservation.
    Printed when a case stops on a stall, so a stall can be told apart in the log: a pod our
    controller never ungated, one kube-scheduler holds as unschedulable (and why), one it has not
    tried yet."""
    by_name = {str(c["metadata"]["name"]): c for c in claims}
    lines = []
    for pod in sorted(pods, key=lambda p: str(p["metadata"]["name"])):
        name = str(pod["metadata"]["name"])
        spec, status = pod.get("spec") or {}, pod.get("status") or {}
        if name not in names or spec.get("nodeName"):
            continue
        gates = ",".join(str(g.get("name")) for g in spec.get("schedulingGates") or ()) or "-"
        scheduled = _pod_scheduled(pod)
        condition = (
            f"{scheduled.get('status')}/{scheduled.get('reason')} "
            f"since {scheduled.get('lastTransitionTime')}: {str(scheduled.get('message') or '')[:200]}"
            if scheduled
            else "no PodScheduled condition"
        )
        held = []
        for entry in status.get("resourceClaimStatuses") or ():
            claim = by_name.get(str(entry.get("resourceClaimName")))
            if claim is None:
                held.append(f"{entry.get('name')}: no claim")
                continue
            claim_status = claim.get("status") or {}
            allocation = claim_status.get("allocation") or {}
            terms = ((allocation.get("nodeSelector") or {}).get("nodeSelectorTerms") or [{}])[0]
            node = next((f.get("values", ["?"])[0] for f in terms.get("matchFields") or ()), "-")
            where = f"allocated on {node}" if allocation else "not allocated"
            held.append(f"{claim['metadata']['name']}: {where}, reserved for "
                        f"{len(claim_status.get('reservedFor') or ())}")  # fmt: skip
        said = "; ".join(held) or "-"
        lines.append(f"stuck {name}: gates {gates}; PodScheduled {condition}; claims: {said}")
    return lines


def unbound_summary(pods: list[dict[str, Any]], names: set[str], top: int = 10) -> list[tuple[int, str]]:
    """The pods of ``names`` still unbound in ``pods``, counted by what holds them: still gated, or
    kube-scheduler's ``PodScheduled`` reason and the start of its message; most first."""
    counts: Counter[str] = Counter()
    for pod in pods:
        spec = pod.get("spec") or {}
        if pod["metadata"]["name"] not in names or spec.get("nodeName"):
            continue
        if spec.get("schedulingGates"):
            counts["gated"] += 1
            continue
        scheduled = _pod_scheduled(pod)
        counts[f"{scheduled.get('reason') or 'not tried'}: {str(scheduled.get('message') or '')[:90]}"] += 1
    return [(n, what) for what, n in counts.most_common(top)]


def audit_requests(start: int) -> Counter[str]:
    """Requests per user from ``start`` in the audit log (one per audit ID: a watch counts once)."""
    seen: dict[str, str] = {}
    with AUDIT_LOG.open("rb") as handle:
        handle.seek(start)
        for line in handle:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            seen[event["auditID"]] = event["user"]["username"]
    return Counter(seen.values())


def audit_offset() -> int:
    try:
        return AUDIT_LOG.stat().st_size
    except FileNotFoundError:
        return 0


def rate_row(names: list[str], tracker: Tracker, started: float, gated: bool) -> dict[str, Any]:
    """Throughput and create-to-bound figures of ``names`` (created from ``started``)."""
    times = tracker.bind_times(names)
    latency = tracker.latencies(names)
    row: dict[str, Any] = {"pods": len(names), "unbound": len(names) - len(times)}
    if times:
        span = max(times[-1] - started, 1e-9)
        per_second = Counter(int(t - started) for t in times)
        counts = [per_second.get(second, 0) for second in range(int(span) + 1)]
        row["pods_per_s"] = len(times) / span
        for pct in (10, 50, 90):
            row[f"pods_per_s_p{pct}"] = percentile([float(c) for c in counts], pct)
    if latency:
        row.update({"p50_s": statistics.median(latency), "p90_s": percentile(latency, 90),
                    "p99_s": percentile(latency, 99)})  # fmt: skip
    decided = tracker.decided(names) if gated else []
    if decided:  # how much of it was ours: create to the gate removed
        row.update({"decided_p50_s": statistics.median(decided), "decided_p99_s": percentile(decided, 99)})
    return row


# -------------------------------------------------------------------------------- one path


@dataclass
class Run:
    cluster: Any
    configuration: client.Configuration
    tracker: Tracker
    path: str
    setting: str
    log_level: str = "warning"
    controller: subprocess.Popen[bytes] | None = None
    serial: Iterator[int] = field(default_factory=lambda: iter(range(10**9)))

    def __post_init__(self) -> None:
        self.api = client.ApiClient(self.configuration)
        self.core = client.CoreV1Api(self.api)
        self.resource = client.ResourceV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)

    @property
    def gated(self) -> bool:
        return self.path == "ours"

    def start_controller(self) -> float:
        """Our controller's process for our path, at the setting's client limits; returns its
        start-up: from the process's start to its first decision (a gated pod made before it)."""
        if not self.gated:
            return float("nan")
        probe = f"startup-{next(self.serial)}"
        self.create([(probe, STREAM)], threads=1)
        qps, burst = SETTINGS[self.setting]
        log = (STATE_DIR / "logs" / "fractional-controller.log").open("ab")
        started = time.monotonic()
        self.controller = subprocess.Popen(
            [sys.executable, "-m", "driver", "controller", "--kubeconfig",
             str(self.cluster.state_dir / "controller.kubeconfig"), "--metrics-port", "0", "--log-level",
             self.log_level, "--kube-api-qps", str(qps), "--kube-api-burst", str(burst)],
            cwd=ROOT, stdout=log, stderr=log,
        )  # fmt: skip
        deadline = started + 300
        while True:
            with self.tracker.lock:
                ungated = self.tracker.ungated.get(probe)
            if ungated is not None:
                break
            if self.controller.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"our controller made no decision in 300 s (exit {self.controller.poll()})")
            time.sleep(0.02)
        if self.tracker.wait([probe], 120):
            raise SystemExit("the start-up probe pod was not bound in 120 s")
        self.delete([probe])
        return ungated - started

    def stop_controller(self) -> None:
        if self.controller is not None:
            self.controller.terminate()
            try:
                self.controller.wait(30)
            except subprocess.TimeoutExpired:
                self.controller.kill()
            self.controller = None

    def create(self, pods: list[tuple[str, Shape]], threads: int = 6, group: str | None = None) -> None:
        from concurrent.futures import ThreadPoolExecutor

        def one(entry: tuple[str, Shape]) -> None:
            name, shape = entry
            with self.tracker.lock:
                self.tracker.created[name] = time.monotonic()
            body = pod_body(name, shape, gated=self.gated, group=group)
            self.core.create_namespaced_pod(NAMESPACE, body, _preload_content=False)  # type: ignore[arg-type]

        if threads == 1:
            for entry in pods:
                one(entry)
            return
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, pods))

    def create_bodies(self, bodies: list[dict[str, Any]], threads: int = 6) -> None:
        """Create ready-made pod bodies, in their order as nearly as ``threads`` clients keep it."""
        from concurrent.futures import ThreadPoolExecutor

        def one(body: dict[str, Any]) -> None:
            with self.tracker.lock:
                self.tracker.created[body["metadata"]["name"]] = time.monotonic()
            self.core.create_namespaced_pod(NAMESPACE, body, _preload_content=False)  # type: ignore[arg-type]

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, bodies))

    def delete(self, names: list[str], *, forget: bool = True) -> None:
        """Delete the pods; ``forget``: drop what the tracker knows of them (a case that measures
        them after, as the churn its arrivals, keeps it)."""
        for name in names:
            try:
                self.core.delete_namespaced_pod(
                    name, NAMESPACE, grace_period_seconds=0, _preload_content=False
                )
            except client.ApiException as error:
                if error.status != 404:
                    raise
        if forget:
            self.tracker.forget(names)

    def clean(self) -> None:
        """Every pod, PodGroup and generated claim gone (our controller, when it runs, drops its
        finalizers). A deletion of thousands of pods can outlast kube-apiserver's 60 s request
        timeout (a 504 seen at 5,000 nodes with 4,700 pods): it goes on on the server, and is asked
        again while pods remain."""
        version = pod_group_version(self.api)
        deadline = time.monotonic() + 900
        asked = float("-inf")
        while True:
            pods = self.core.list_namespaced_pod(NAMESPACE, limit=1).items
            if pods and time.monotonic() - asked > 30:
                asked = time.monotonic()
                try:
                    self.core.delete_collection_namespaced_pod(
                        NAMESPACE, grace_period_seconds=0, _preload_content=False
                    )
                except client.ApiException as error:
                    if error.status not in (500, 504):
                        raise
                    print(f"clean: deleting the pods answered {error.status}; still going", flush=True)
            claims = self.resource.list_namespaced_resource_claim(NAMESPACE, limit=1).items
            if not pods and not claims:
                break
            if time.monotonic() > deadline:
                raise SystemExit("pods or claims still there 900 s after the pods were deleted")
            time.sleep(1.0)
        if version:
            self.custom.delete_collection_namespaced_custom_object(
                "scheduling.k8s.io", version, NAMESPACE, "podgroups"
            )
        with self.tracker.lock:
            self.tracker.created.clear()
            self.tracker.ungated.clear()
            self.tracker.bound.clear()

    def _pods(self) -> list[dict[str, Any]]:
        """The namespace's pods, as plain JSON (one read)."""
        return list(
            json.loads(self.core.list_namespaced_pod(NAMESPACE, _preload_content=False).data)["items"]
        )

    def report_stuck(self, left: list[str]) -> None:
        """Print why each of ``left`` is unbound (``stuck_report``), and its PodGroup's conditions."""
        pods = self._pods()
        claims = json.loads(
            self.resource.list_namespaced_resource_claim(NAMESPACE, _preload_content=False).data
        )["items"]
        for line in stuck_report(pods, claims, set(left)):
            print(line, flush=True)
        version = pod_group_version(self.api)
        groups = {str((p.get("spec") or {}).get("schedulingGroup", {}).get("podGroupName", ""))
                  for p in pods if p["metadata"]["name"] in left} - {""}  # fmt: skip
        for group in sorted(groups) if version else ():
            try:
                body = self.custom.get_namespaced_custom_object(
                    "scheduling.k8s.io", version, NAMESPACE, "podgroups", group
                )
            except client.ApiException as error:
                print(f"stuck PodGroup {group}: {error.status}", flush=True)
                continue
            conditions = (body.get("status") or {}).get("conditions") or []
            said = "; ".join(f"{c.get('type')}={c.get('status')}/{c.get('reason')}: {c.get('message')}"
                             for c in conditions)  # fmt: skip
            print(f"stuck PodGroup {group}: {said or 'no conditions'}", flush=True)

    def report_unbound(self, left: list[str]) -> None:
        """Print how many of ``left`` are still gated (ours to decide) and why kube-scheduler holds
        the others (``unbound_summary``)."""
        for count, what in unbound_summary(self._pods(), set(left)):
            print(f"unbound: {count} {what}", flush=True)

    def whole_gpus_free(self) -> dict[str, int]:
        """Fleet GPUs with no allocation at all, and nodes with all 8 free."""
        gpus: set[tuple[str, str]] = set()
        for resource_slice in self.resource.list_resource_slice().items:
            if resource_slice.spec.driver == DRIVER:
                gpus |= {(resource_slice.spec.pool.name, d.name) for d in resource_slice.spec.devices or ()
                         if d.name.startswith("gpu-")}  # fmt: skip
        touched: set[tuple[str, str]] = set()
        allocated = 0.0  # GPUs' worth allocated: a share counts its memory's fraction, a whole GPU 1
        for claim in self.resource.list_namespaced_resource_claim(NAMESPACE).items:
            allocation = claim.status.allocation if claim.status else None
            for result in (allocation.devices.results if allocation and allocation.devices else None) or ():
                touched.add((result.pool, result.device))
                memory = (result.consumed_capacity or {}).get("memory")
                allocated += parse_quantity(memory) / (GPU_MEMORY_GI * 2**30) if memory else 1.0
        free = gpus - touched
        per_node = Counter(pool for pool, _ in free)
        return {"gpus_free": len(free), "free_8gpu_nodes": sum(1 for n in per_node.values() if n >= 8),
                "gpus_allocated": round(allocated, 1),
                # of the capacity left, the share in whole GPUs (1: nothing stranded in partly used
                # GPUs): comparable between paths that bound different numbers of pods
                "whole_free_share": len(free) / max(len(gpus) - allocated, 1e-9)}  # fmt: skip


def pod_group_version(api: client.ApiClient) -> str:
    for group in client.ApisApi(api).get_api_versions().groups:
        if group.name == "scheduling.k8s.io":
            for version in ("v1beta1", "v1alpha2"):
                if any(v.version == version for v in group.versions):
                    return version
    return ""


# -------------------------------------------------------------------------------- the cases


def case_fill(run: Run, gpus: int, timeout: float) -> tuple[dict[str, Any], list[str]]:
    """The fill, until every pod is bound, ``timeout`` seconds from the first create, or 30 s
    without a bind; the pods left unbound then are deleted (no pod departs, so a pod that fits
    nowhere now never will; a path retrying it would only spend its client's requests on it)."""
    plan = fill_plan(gpus)
    names = [name for name, _ in plan]
    started = time.monotonic()
    run.create(plan)
    left = run.tracker.wait(names, max(0.0, timeout - (time.monotonic() - started)))
    counts = Counter(shape.name for _, shape in plan)
    row = rate_row(names, run.tracker, started, run.gated)
    row["pods_by_shape"] = ", ".join(
        f"{counts[s]} {s}" for s in (WHOLE8.name, WHOLE1.name, *(x.name for x in SHARES))
    )
    if left and time.monotonic() - started >= timeout:
        row["stopped_at_s"] = timeout
    run.delete(left)
    gone = set(left)
    live = [n for n in names if n not in gone]
    return row, live


def case_churn(
    run: Run, live: list[str], plan: dict[str, Shape], seconds: float, rate: float
) -> dict[str, Any]:
    rng = random.Random(7)
    arrivals: list[str] = []
    arrived: set[str] = set()
    live = sorted(live)
    started = time.monotonic()
    ticks = int(seconds * rate)
    for tick in range(ticks):
        due = started + tick / rate
        time.sleep(max(0.0, due - time.monotonic()))
        if not live:
            break
        gone = live.pop(rng.randrange(len(live)))
        shape = plan.pop(gone)
        # An arrival that bound and now departs keeps its bind time: forgetting it counted it as
        # unbound, the more so the faster a path binds (16 of ours at 1,000 nodes, 0-3 of
        # kube-scheduler's, while 91 nodes had all 8 GPUs free).
        run.delete([gone], forget=gone not in arrived)
        name = f"c{tick:05d}"
        plan[name] = shape
        run.create([(name, shape)], threads=1)
        arrivals.append(name)
        arrived.add(name)
        with run.tracker.lock:  # what is bound by now may leave later
            live += [n for n in arrivals[-50:] if n in run.tracker.bound and n not in live and n in plan]
    run.tracker.wait(arrivals, 300)
    row = rate_row(arrivals, run.tracker, started, run.gated)
    row.pop("pods_per_s_p10", None)
    row.update(run.whole_gpus_free())
    row["churn"] = f"{ticks} departures and arrivals, {rate:g}/s"
    return row


def case_steady(run: Run, gpus: int, count: int, interval: float) -> list[dict[str, Any]]:
    rows = []
    filled = 0
    for level in (0, 50, 99):
        whole = int(level / 100 * gpus / 8) - filled
        names = [f"w{filled + i:05d}" for i in range(whole)]
        run.create([(n, WHOLE8) for n in names])
        left = run.tracker.wait(names, 1800)
        filled += whole
        stream = [f"s{level:02d}-{i:04d}" for i in range(count)]
        started = time.monotonic()
        for name in stream:
            begun = time.monotonic()
            run.create([(name, STREAM)], threads=1)
            time.sleep(max(0.0, interval - (time.monotonic() - begun)))
        run.tracker.wait(stream, 300)
        row = rate_row(stream, run.tracker, started, run.gated)
        for key in ("pods_per_s", "pods_per_s_p10", "pods_per_s_p50", "pods_per_s_p90"):
            row.pop(key, None)
        rows.append({"level_pct": level, "fill_unbound": len(left), **row})
        run.delete(stream)
    return rows


def case_gangs(run: Run, gangs: int, size: int, label: str, patience: float = 60.0) -> dict[str, Any]:
    version = pod_group_version(run.api)
    if not version:
        return {"gangs": label, "note": "no scheduling.k8s.io PodGroup API served"}
    names: list[str] = []
    started = time.monotonic()
    for index in range(gangs):
        group = f"g{size}-{index:04d}"
        run.custom.create_namespaced_custom_object("scheduling.k8s.io", version, NAMESPACE, "podgroups", {
            "apiVersion": f"scheduling.k8s.io/{version}", "kind": "PodGroup",
            "metadata": {"name": group, "namespace": NAMESPACE},
            "spec": {"schedulingPolicy": {"gang": {"minCount": size}}}})  # fmt: skip
        members = [f"{group}-{i:04d}" for i in range(size)]
        run.create([(n, WHOLE1) for n in members], group=group)
        names += members
    # One client makes the gangs one after another: on a small machine its pace depends on how busy
    # kube-apiserver is with the path measured, so all_bound_s counts that pace too.
    created = time.monotonic() - started
    left = run.tracker.wait(names, 3600, stall=60)
    if left:
        run.report_stuck(left)
        if patience > 60:  # to see whether (and when) a stall ends
            left = run.tracker.wait(left, patience - 60, stall=patience - 60)
            print(f"gangs: {len(left)} still unbound after {patience:.0f} s without a bind", flush=True)
    times = run.tracker.bind_times(names)
    row = rate_row(names, run.tracker, started, run.gated)
    for key in ("pods_per_s_p10", "pods_per_s_p50", "pods_per_s_p90"):
        row.pop(key, None)
    row.update({"gangs": label, "created_s": created,
                "all_bound_s": (times[-1] - started) if times and not left else float("nan")})  # fmt: skip
    return row


# -------------------------------------------------------------------------------- the trace


def trace_fleet(cluster: Any, trace_dir: Path) -> tuple[list[Any], int]:
    """The production cluster of the trace as a kwok fleet: one Node per row of the node list (its
    CPU and memory allocatable, its GPU model labelled), its ResourceSlices from the agent's own
    publisher for the inventory bench/trace_ours.py maps a trace node to (``gpus`` devices of its
    model, 1,000 x 256 MiB each). Returns the nodes and their GPUs."""
    import gomodules
    from localcluster.cluster import Binaries
    from localcluster.fleet import create_nodes, fleet_node, kwok_argv, stage_files

    from bench.fgd_trace import load_nodes
    from bench.trace_ours import trace_inventory
    from driver.inventory.fake import load_profile, resolve_profile
    from driver.publisher import SlicePublisher

    nodes = load_nodes(trace_dir / "openb_node_list_gpu_node.csv")
    configuration = load_configuration(str(cluster.state_dir / "bench.kubeconfig"))
    bodies = []
    for node in nodes:
        body = fleet_node(
            node.name, "trace", cpu=f"{node.cpu_milli}m", memory=f"{node.memory_mib}Mi", pods="1001"
        )
        body["metadata"]["labels"]["gpu-model"] = node.model
        bodies.append(body)
    started = time.monotonic()
    with client.ApiClient(configuration) as api:
        create_nodes(client.CoreV1Api(api), bodies)
    template = load_profile(resolve_profile(PROFILE))

    def publish(node: Any) -> int:
        with SlicePublisher(configuration, node.name) as publisher:
            return int(
                publisher.publish(replace(trace_inventory(node, template), node_name=node.name)).slice_count
            )

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        slices = sum(pool.map(publish, nodes))
    cluster.processes.start(
        "kwok", kwok_argv(Binaries.kwok(), cluster.kubeconfig, stage_files(gomodules.kwok_dir()))
    )
    wait_ready(configuration, len(nodes))
    took = time.monotonic() - started
    print(f"trace fleet: {len(nodes)} nodes, {slices} ResourceSlices, ready in {took:.0f} s", flush=True)
    return nodes, sum(node.gpus for node in nodes)


def trace_templates(pods: list[Any]) -> dict[tuple[int, int, tuple[str, ...]], str]:
    """One ResourceClaimTemplate name per distinct GPU ask (count, milli, models) of the trace."""
    asks = sorted({(p.num_gpu, p.gpu_milli, p.gpu_spec) for p in pods if p.num_gpu})
    return {ask: f"trace-{index:03d}" for index, ask in enumerate(asks)}


def trace_pod_body(pod: Any, template: str | None, *, gated: bool) -> dict[str, Any]:
    from bench.trace_ours import _containers

    spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": 0,
        "tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}],
        "containers": _containers(pod, claim=template is not None),
    }
    if template is not None:
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": template}]
        if gated:  # the default install gates pods with claims only
            spec["schedulingGates"] = [{"name": GATE}]
    name = pod.name.lower().replace("_", "-")
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": spec,
    }


def case_trace(
    run: Run, trace_dir: Path, gpus: int, nodes: list[Any], seed: int, stall: float = 120.0
) -> dict[str, Any]:
    """The trace's pods (seed ``seed``: shuffled, copied until the arrived GPU demand is 130 % of
    the cluster) created in their order up to 100 % of the cluster's GPUs, then settled (every pod
    bound, or ``stall`` seconds without a bind: no pod departs, so one that did not fit then never
    will; the pods left are counted by what holds them), the share of GPU capacity allocated
    measured (the bound pods' GPU milli over the cluster's); then the rest up to 130 %, settled and
    measured again."""
    from bench.fgd_trace import GPU_MILLI, build_run, load_pods
    from bench.trace_ours import _claim_spec

    pods = load_pods(trace_dir / "openb_pod_list_default.csv")
    order = build_run(nodes, pods, seed, inflate=1.3).pods
    templates = trace_templates(order)
    for ask, name in templates.items():
        example = next(p for p in order if (p.num_gpu, p.gpu_milli, p.gpu_spec) == ask)
        try:
            body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                    "metadata": {"name": name, "namespace": NAMESPACE},
                    "spec": {"spec": _claim_spec(example)}}  # fmt: skip
            run.resource.create_namespaced_resource_claim_template(NAMESPACE, body)
        except client.ApiException as error:
            if error.status != 409:
                raise
    capacity = GPU_MILLI * gpus
    arrived, cut = 0, len(order)
    for index, pod in enumerate(order):
        arrived += pod.demand
        if arrived >= capacity:
            cut = index + 1
            break
    bodies = [
        trace_pod_body(p, templates.get((p.num_gpu, p.gpu_milli, p.gpu_spec)), gated=run.gated) for p in order
    ]
    demand = {body["metadata"]["name"]: pod.demand for body, pod in zip(bodies, order, strict=True)}
    row: dict[str, Any] = {"pods": len(order), "gpu_pods": sum(1 for p in order if p.num_gpu), "seed": seed}
    started = time.monotonic()
    for label, part in (("100", bodies[:cut]), ("130", bodies[cut:])):
        run.create_bodies(part)
        names = [b["metadata"]["name"] for b in part]
        left = run.tracker.wait(names, 3600, stall=stall)
        if left:
            run.report_unbound(left)
        with run.tracker.lock:
            allocated = sum(d for name, d in demand.items() if name in run.tracker.bound)
        row[f"allocated_pct_{label}"] = 100 * allocated / capacity
    names = list(demand)
    row.update({k: v for k, v in rate_row(names, run.tracker, started, run.gated).items() if k != "pods"})
    return row


# -------------------------------------------------------------------------------- the run


@dataclass
class Cost:
    """CPU of every component, requests per user, from a starting point."""

    cluster: Any
    run: Run
    offset: int = 0
    cpu: dict[str, float] = field(default_factory=dict)
    binds: int = 0

    def __post_init__(self) -> None:
        self.offset = audit_offset()
        self.cpu = self._cpu()
        with self.run.tracker.lock:
            self.binds = self.run.tracker.binds

    def _pids(self) -> dict[str, int]:
        pids = {
            name: self.cluster.processes.get(name).pid
            for name in COMPONENTS
            if self.cluster.processes.get(name)
        }
        if self.run.controller is not None:
            pids["controller"] = self.run.controller.pid
        return pids

    def _cpu(self) -> dict[str, float]:
        return {name: Usage(pid).cpu_seconds() for name, pid in self._pids().items()}

    def row(self) -> dict[str, Any]:
        with self.run.tracker.lock:
            bound = max(1, self.run.tracker.binds - self.binds)
        requests = audit_requests(self.offset)
        now = self._cpu()
        per_1000 = {name: 1000 * (now[name] - self.cpu.get(name, now[name])) / bound for name in now}
        row: dict[str, Any] = {
            "requests_per_pod": (requests[SCHEDULER_USER] + requests[CONTROLLER_USER]) / bound,
            "requests_per_pod_scheduler": requests[SCHEDULER_USER] / bound,
            "requests_per_pod_controller": requests[CONTROLLER_USER] / bound,
            # not in requests_per_pod: it makes the claims from templates alike on every path, and
            # releases kube-scheduler's allocations (ours release their own)
            "requests_per_pod_controller_manager": requests[MANAGER_USER] / bound,
            "cpu_s_per_1000": per_1000.get("kube-scheduler", 0.0) + per_1000.get("controller", 0.0),
            **{f"cpu_s_per_1000_{name}": value for name, value in per_1000.items()},
        }
        if self.run.controller is not None:
            row["rss_mib"] = Usage(self.run.controller.pid).memory_mib()
        return row


def run_path(
    cluster: Any, configuration: client.Configuration, tracker: Tracker, path: str, setting: str,
    gpus: int, args: argparse.Namespace, nodes: int, trace_nodes: list[Any],
) -> list[dict[str, Any]]:  # fmt: skip
    qps, burst = SETTINGS[setting]
    config = scheduler_config(STATE_DIR, cluster.state_dir / "scheduler.kubeconfig", qps, burst,
                              packing=path == "kube-scheduler-mostallocated")  # fmt: skip
    verbosity = [f"--v={args.scheduler_verbosity}"] if args.scheduler_verbosity else []
    cluster.extra_args["kube-scheduler"] = [f"--config={config}", *verbosity]
    cluster.restart_scheduler(binaries())
    run = Run(cluster, configuration, tracker, path, setting, log_level=args.controller_log_level)
    base = {"nodes": nodes, "setting": f"{setting} ({qps} qps, burst {burst})", "path": path}
    rows: list[dict[str, Any]] = []
    startup = run.start_controller()
    try:
        if path == "ours":
            rss = Usage(run.controller.pid).memory_mib() if run.controller else float("nan")
            rows.append({**base, "case": "startup", "startup_s": startup, "rss_mib": rss})
            print(json.dumps(rows[-1]), flush=True)

        def measured(case: str, result: dict[str, Any] | list[dict[str, Any]], cost: Cost) -> None:
            spent = cost.row()
            for row in result if isinstance(result, list) else [result]:
                rows.append({**base, "case": case, **row, **spent})
                print(json.dumps(rows[-1]), flush=True)

        if trace_nodes:  # the trace's cluster: the trace case alone
            cost = Cost(cluster, run)
            trace = case_trace(run, args.trace_dir, gpus, trace_nodes, args.seed, args.trace_stall)
            measured("trace", trace, cost)
            run.clean()
            return rows
        if "fill" in args.cases or "churn" in args.cases:
            cost = Cost(cluster, run)
            fill, live = case_fill(run, gpus, args.fill_timeout)
            measured("fill", fill, cost)
            if "churn" in args.cases:
                cost = Cost(cluster, run)
                plan = dict(fill_plan(gpus))
                measured("churn", case_churn(run, live, plan, args.churn_seconds, args.churn_rate), cost)
            run.clean()
        if "steady" in args.cases:
            cost = Cost(cluster, run)
            measured("steady", case_steady(run, gpus, args.steady_pods, args.steady_interval), cost)
            run.clean()
        if "gangs" in args.cases:
            for gangs, size in ((args.small_gangs, 3), (args.large_gangs, args.large_gang_size)):
                if gangs and size:
                    cost = Cost(cluster, run)
                    label = f"{gangs} x {size}"
                    measured("gangs", case_gangs(run, gangs, size, label, args.gang_patience), cost)
                    run.clean()
    finally:
        run.stop_controller()
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument(
        "--scheduler-verbosity",
        type=int,
        default=0,
        help="kube-scheduler's --v, to look into a case (it costs kube-scheduler CPU)",
    )
    parser.add_argument("--gang-patience", type=float, default=60.0,
                        help="seconds without a bind before the gangs case gives up (the stuck pods are "
                        "reported at 60 s)")  # fmt: skip
    parser.add_argument("--trace-stall", type=float, default=120.0,
                        help="seconds without a bind that end each part of the trace case")  # fmt: skip
    parser.add_argument("--controller-log-level", default="warning",
                        help="our controller's --log-level, to look into a case")  # fmt: skip
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--fill-timeout", type=float, default=300.0, help="seconds the fill may take at most")
    parser.add_argument("--churn-seconds", type=float, default=60.0)
    parser.add_argument("--churn-rate", type=float, default=5.0, help="departures (and arrivals) per second")
    parser.add_argument("--steady-pods", type=int, default=50)
    parser.add_argument("--steady-interval", type=float, default=0.2)
    parser.add_argument("--small-gangs", type=int, default=1000)
    parser.add_argument("--large-gangs", type=int, default=3)
    parser.add_argument("--large-gang-size", type=int, default=1000)
    parser.add_argument(
        "--trace-dir",
        type=Path,
        default=None,
        help="Alibaba's cluster-trace-gpu-v2023 CSVs: the trace case on its own 1,213-node cluster",
    )
    parser.add_argument(
        "--seed", type=int, default=42, help="the trace run's seed (bench/fgd_trace.py build_run)"
    )
    args = parser.parse_args(argv)
    args.cases = set(filter(None, args.cases.split(",")))
    settings = [s for s in args.settings.split(",") if s]
    paths = [p for p in args.paths.split(",") if p]
    for name, values, known in (("--settings", settings, SETTINGS), ("--paths", paths, PATHS),
                                ("--cases", args.cases, CASES)):  # fmt: skip
        unknown = set(values) - set(known)
        if unknown:
            parser.error(f"{name}: {', '.join(sorted(unknown))} not one of {', '.join(known)}")
    if os.geteuid() != 0:
        print("production_scale: the local cluster's harness needs root", file=sys.stderr)
        return 2
    cluster = start_cluster()
    rows: list[dict[str, Any]] = []
    try:
        trace_nodes, gpus = prepare(cluster, args.nodes, ours="ours" in paths, trace_dir=args.trace_dir)
        if trace_nodes:
            args.nodes = len(trace_nodes)
        configuration = load_configuration(str(cluster.state_dir / "bench.kubeconfig"))
        configuration.connection_pool_maxsize = 16
        tracker = Tracker(client.ApiClient(configuration))
        tracker.start()
        for index, setting in enumerate(settings):
            order = paths if index % 2 == 0 else list(reversed(paths))
            for path in order:
                print(f"== {args.nodes} nodes, {setting}: {path}", flush=True)
                rows += run_path(
                    cluster, configuration, tracker, path, setting, gpus, args, args.nodes, trace_nodes
                )
        tracker.stop.set()
    finally:
        kept = Path("/tmp") / f"{STATE_DIR.name}-logs"
        subprocess.run(["rm", "-rf", str(kept)], check=False)
        subprocess.run(["cp", "-r", str(STATE_DIR / "logs"), str(kept)], check=False)
        print(f"logs kept in {kept}", flush=True)
        cluster.down()
    stamp = {"commit": commit(), "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")}
    record([{**row, **stamp} for row in rows])
    return 0


def _row_key(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row.get("nodes"), row.get("setting"), row.get("path"), row.get("case"))


def record(rows: list[dict[str, Any]]) -> None:
    """Write ``rows`` into ``scale.json``: they replace the rows of the same size, setting, path and
    case, and every other row stays with its own commit and date (a run of one path or one case
    leaves the rest of the table as it was)."""
    previous = RESULTS_DIR / "scale.json"
    measured = {_row_key(r) for r in rows}
    kept_rows = []
    if previous.exists():
        kept_rows = [
            r for r in json.loads(previous.read_text(encoding="utf-8"))["rows"] if _row_key(r) not in measured
        ]
    all_rows = sorted(kept_rows + rows, key=lambda r: r["nodes"])
    notes = (
        (__doc__ or "").split("\nWrites ")[0].strip()
        + "\n\n"
        + ratios(all_rows)
        + f"\nMachine: {machine()}.\n"
    )
    write_result(
        "scale", all_rows, title="Production size on the real control plane (kwok fleet)", notes=notes
    )
    print(ratios(all_rows))


def ratios(rows: list[dict[str, Any]]) -> str:
    """Ours against kube-scheduler's better profile, per size, setting and case, from rows of one
    run only (the same date): rows of different runs are not compared."""
    lines = ["Ours against kube-scheduler's better profile in the same run (above 1: ours is better):"]
    keys = sorted({(r["nodes"], r["setting"]) for r in rows}, key=lambda k: (k[0], k[1]))
    for nodes, setting in keys:

        def pick(
            case: str, path: str, nodes: int = nodes, setting: str = setting, run: Any = None
        ) -> dict[str, Any]:
            wanted = (nodes, setting, path, case)
            return next(
                (r for r in rows if _row_key(r) == wanted and (run is None or r.get("date") == run)), {}
            )

        parts = []
        ours = pick("fill", "ours")
        theirs = [pick("fill", p, run=ours.get("date")) for p in PATHS[:2]]
        best = max((t for t in theirs if t.get("pods_per_s")), key=lambda t: t["pods_per_s"], default={})
        if ours.get("pods_per_s") and best:
            parts.append(f"fill throughput {ours['pods_per_s'] / best['pods_per_s']:.2f}x ({best['path']})")
        ours = pick("churn", "ours")
        theirs = [pick("churn", p, run=ours.get("date")) for p in PATHS[:2]]
        measure = "whole_free_share" if "whole_free_share" in ours else "gpus_free"  # older rows: raw
        best = max((t for t in theirs if measure in t), key=lambda t: t[measure], default={})
        if ours and best and best.get(measure):
            ratio = ours[measure] / best[measure]
            counts = f"{ours['gpus_free']} against {best['gpus_free']} GPUs, {best['path']}"
            parts.append(f"whole GPUs free after churn ({measure}) {ratio:.2f}x ({counts})")
        fastest = min((t for t in theirs if t.get("p99_s")), key=lambda t: t["p99_s"], default={})
        if ours.get("p99_s") and fastest:
            parts.append(f"churn p99 {ours['p99_s']:.2f} s against {fastest['p99_s']:.2f} s "
                         f"({ours['p99_s'] / fastest['p99_s']:.2f}x, below 1 is better)")  # fmt: skip
        if parts:
            lines.append(f"- {nodes:,} nodes, {setting}: " + "; ".join(parts))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
