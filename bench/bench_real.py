"""Our controller against kube-scheduler itself, on real components.

Setup (once): etcd, kube-apiserver, kube-controller-manager and kube-scheduler of the local cluster's
harness (``hack/localcluster``, release ``K8S_VERSION``, default 1.37.2), no kubelet. ``--nodes``
Node objects (default 100) with our agent's real ResourceSlices for ``h100-8x`` (8 GPUs of 79Gi
each). No pod runs: every measure here ends when a pod is bound (``spec.nodeName``), and pods are
deleted without grace. kube-controller-manager runs without its node-lifecycle controller (no
kubelet ever reports, so it would taint every Node unreachable after a minute); the bench lifts the
not-ready taint that admission puts on a new Node itself. Its client limits are raised
(``--kube-api-qps``), so that the claims it makes from templates, which both paths need alike, are not
what is measured. kube-scheduler keeps its defaults, and our controller has the same client limits
(``--kube-api-qps 50 --kube-api-burst 100``; both raised together in the raised case).

Two paths on the same cluster, one after the other for each case, in alternating order:
- **kube-scheduler**: ungated pods; it allocates (consumable capacity) and binds;
- **ours**: pods with our scheduling gate; our controller (``fractional controller``, its own process,
  started for the case and stopped after it) allocates and ungates, then kube-scheduler binds.

Cases:
- **backlog**: ``--backlog`` pods of one 12Gi/15 % share, created as fast as 6 client threads can;
  pods per second from the first create to the last bind, and create-to-bound per pod;
- **stream**: ``--stream`` pods created one at a time, ``--interval`` apart; create-to-bound per pod;
- **packing**, on the first ``--packing-nodes`` Nodes (50, chosen by a nodeSelector: the shape on
  which bench_allocator.py modelled kube-scheduler): seeded shares (memory 5 to 40Gi and compute 0 to
  20 %, drawn independently) until 30 % of their memory is asked, measured; then up to 65 % and five
  rounds of churn (a fifth of the pods deleted, as much memory arrives), measured: GPUs touched, whole
  GPUs free, and how many 8-GPU pods still fit (Nodes with all 8 free). The same trace (names, sizes,
  departures) for both paths, and for ours once more under ``--policy best-fit`` (``ours-best-fit``;
  ``ours`` is the controller's default policy, fragmentation);
- **backlog, kube-scheduler at 500 qps**: the backlog again, kube-scheduler restarted with its
  client limits raised from its defaults (50 requests per second, bursts of 100), and our
  controller's with them: which of the two limits the path;
- **allocation guard**: the backlog and the stream of ungated pods once more, kube-scheduler alone
  and kube-scheduler with our controller serving the allocation guard (the chart's webhook
  configuration, pointed at the controller by URL): what the guard costs kube-scheduler's own path;
- **gang**: a PodGroup of 64 pods (``minCount`` 64), one 40Gi/50 % share each: ours gated, against
  kube-scheduler's own gang scheduling (GenericWorkload) with the pods ungated; first create to all
  bound. One sample takes about 4 s and varies by a second from run to run on a shared 2-core
  machine, so it is repeated ``--gang-repeats`` times (5), the two paths alternating which goes
  first; the median of each path is compared, and each pair of samples too.

Cost, per case: API requests per bound pod, by user, from kube-apiserver's audit log (every request
of kube-scheduler and of our controller's own client certificate; watches count once); our
controller's CPU seconds and peak RSS, and kube-scheduler's CPU seconds over the same window.

Writes bench/results/real_scheduler.json (real_scheduler_<N>.json for ``--nodes N`` other than 100,
a section of its own). Needs root and the upstream binaries (built as for
``make cluster-up`` when missing); no other local cluster may be up. Run:
    .venv/bin/python bench/bench_real.py [--nodes 100] [--backlog 1000] [--stream 200]
        [--interval 0.1] [--gang 64] [--gang-repeats 5] [--skip packing,...] [--result NAME]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "hack"))

from kubernetes import client, watch

from bench._common import summary, write_result
from driver.inventory.fake import load_profile, resolve_profile
from driver.kube import load_configuration
from driver.slices import build_device_classes, build_resource_slices

ROOT = Path(__file__).resolve().parent.parent
VERSION = os.environ.get("K8S_VERSION", "1.37.2").lstrip("v")
STATE_DIR = Path(os.environ.get("FRACTIONAL_BENCH_STATE_DIR", "/tmp/fractional-bench-real"))
NAMESPACE = "bench"
GATE = "fractional.dev/allocation"
DRIVER = "fractional.dev"
PROFILE = "h100-8x"
GPU_MEMORY_GI = 79
SCHEDULER_USER = "system:kube-scheduler"
CONTROLLER_USER = "fractional-controller"
PATHS = ("kube-scheduler", "ours")
# The packing case also runs our controller under best-fit (``--policy best-fit``): "ours" runs its
# default policy (fragmentation), and the synthetic churn must not get worse under it.
PACKING_PATHS = (*PATHS, "ours-best-fit")
RAISED_QPS = 500
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [{"level": "Metadata", "users": [SCHEDULER_USER, CONTROLLER_USER]}, {"level": "None"}],
}


# -------------------------------------------------------------------------------- the cluster


def start_cluster() -> Any:
    from localcluster.cluster import LocalCluster

    STATE_DIR.mkdir(parents=True, exist_ok=True)
    policy = STATE_DIR.parent / f"{STATE_DIR.name}-audit-policy.json"
    policy.write_text(json.dumps(AUDIT_POLICY), encoding="utf-8")
    cluster = LocalCluster(
        state_dir=STATE_DIR, version=VERSION, nodes=(),
        clients={"bench": "/CN=fractional-bench/O=system:masters",
                 "controller": f"/CN={CONTROLLER_USER}/O=system:masters"},
        extra_args={
            "kube-apiserver": [f"--audit-policy-file={policy}", f"--audit-log-path={audit_log()}",
                               "--audit-log-maxsize=0", "--audit-log-mode=blocking"],
            "kube-controller-manager": [
                "--controllers=*,-node-lifecycle-controller,-taint-eviction-controller",
                "--kube-api-qps=500", "--kube-api-burst=1000",
            ],
        },
    )  # fmt: skip
    if cluster.processes.get("kube-apiserver") is not None:
        cluster.down()
        return start_cluster()
    cluster.up_control_plane(binaries())
    return cluster


GUARD_PORT = 9443
GUARD_WEBHOOK = "fractional-bench-allocation-guard"


def guard_certificate(cluster: Any) -> Path:
    """tls.crt and tls.key for the guard on 127.0.0.1, signed by the cluster's CA."""
    from localcluster.pki import serving_cert

    directory = cluster.pki_dir / "allocation-guard"
    if not (directory / "tls.crt").exists():
        cert = serving_cert(cluster.pki_dir, "allocation-guard", ["IP:127.0.0.1"])
        directory.mkdir(exist_ok=True)
        shutil.copy(cert.cert, directory / "tls.crt")
        shutil.copy(cert.key, directory / "tls.key")
    return directory


def register_guard(api: Api, cluster: Any) -> None:
    """The chart's ValidatingWebhookConfiguration for the guard, as the chart renders it, pointed at
    the controller process by URL (no Service here) and with our controller's user left out."""
    import base64

    import helm_python as helm
    import yaml

    chart = helm.Chart.load(str(ROOT / "charts" / "fractional-dra"))
    manifests = chart.render({}, name="fractional-dra", namespace="fractional-system", is_install=True)
    (webhook_configuration,) = [
        doc for name, text in manifests.items() if name.endswith("allocation-guard.yaml")
        for doc in yaml.safe_load_all(text) if doc and doc["kind"] == "ValidatingWebhookConfiguration"
    ]  # fmt: skip
    webhook_configuration["metadata"] = {"name": GUARD_WEBHOOK}
    ca = base64.b64encode((cluster.pki_dir / "ca.crt").read_bytes()).decode()
    for webhook in webhook_configuration["webhooks"]:
        webhook["clientConfig"] = {
            "url": f"https://127.0.0.1:{GUARD_PORT}/validate-allocation",
            "caBundle": ca,
        }
        for condition in webhook["matchConditions"]:
            if condition["name"] == "not-this-controller":
                condition["expression"] = f"request.userInfo.username != '{CONTROLLER_USER}'"
    registrations = client.AdmissionregistrationV1Api(api.api)
    unregister_guard(api)
    registrations.create_validating_webhook_configuration(webhook_configuration)
    time.sleep(2.0)  # the apiserver's informer picks it up


def unregister_guard(api: Api) -> None:
    try:
        client.AdmissionregistrationV1Api(api.api).delete_validating_webhook_configuration(GUARD_WEBHOOK)
    except client.ApiException as error:
        if error.status != 404:
            raise


def binaries() -> Any:
    """The control plane's binaries of ``VERSION``: cached, else built from the Go modules."""
    from localcluster.cluster import Binaries

    return Binaries.build(VERSION, "control-plane")


def audit_log() -> Path:
    return STATE_DIR.parent / f"{STATE_DIR.name}-audit.log"


@dataclass
class Api:
    api: client.ApiClient

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api)

    @property
    def resource(self) -> client.ResourceV1Api:
        return client.ResourceV1Api(self.api)

    @property
    def custom(self) -> client.CustomObjectsApi:
        return client.CustomObjectsApi(self.api)


def bench_api(cluster: Any) -> Api:
    configuration = load_configuration(str(cluster.state_dir / "bench.kubeconfig"))
    configuration.connection_pool_maxsize = 16
    return Api(client.ApiClient(configuration))


def add_nodes(api: Api, count: int, packing: int) -> int:
    """``count`` Nodes, ready and untainted, with our slices, the first ``packing`` of them labelled
    for the packing case; the DeviceClasses. Returns the GPUs."""
    for device_class in build_device_classes():
        api.resource.create_device_class(device_class)

    def one(index: int) -> int:
        name = f"node-{index:03d}"
        inventory = load_profile(resolve_profile(PROFILE), node_name=name)
        labels = {"kubernetes.io/hostname": name, **dict(inventory.labels)}
        if index < packing:
            labels[PACKING_LABEL] = "true"
        api.core.create_node(
            {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}}
        )
        allocatable = {"cpu": "128", "memory": "1Ti", "pods": "250"}
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        ready = {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "bench",
                 "lastHeartbeatTime": now, "lastTransitionTime": now}  # fmt: skip
        api.core.patch_node_status(
            name, {"status": {"allocatable": allocatable, "capacity": allocatable, "conditions": [ready]}}
        )
        api.core.patch_node(
            name, {"spec": {"taints": None}}
        )  # admission's not-ready taint: no kubelet lifts it
        made = 0
        for resource_slice in build_resource_slices(inventory):
            api.resource.create_resource_slice(resource_slice)
            made += sum(1 for d in resource_slice["spec"].get("devices", []) if d["name"].startswith("gpu-"))
        return made

    with ThreadPoolExecutor(6) as pool:
        gpus = sum(pool.map(one, range(count)))
    api.core.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    deadline = time.monotonic() + 60
    while True:  # pods in a namespace need its default service account
        try:
            api.core.read_namespaced_service_account("default", NAMESPACE)
            break
        except client.ApiException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    return gpus


# -------------------------------------------------------------------------------- objects


def share_template(memory_gi: int, compute: int) -> tuple[str, dict[str, Any]]:
    name = f"share-{memory_gi}gi-{compute}"
    requests = {"memory": f"{memory_gi}Gi", "compute": str(compute)}
    body = {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "gpu.fractional.dev", "capacity": {"requests": requests}}}]}}},
    }  # fmt: skip
    return name, body


def pod_body(
    name: str,
    template: str,
    *,
    gated: bool,
    group: str | None = None,
    node_selector: dict[str, str] | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": 0,
        "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
        "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
                        "resources": {"claims": [{"name": "gpu"}]}}],
    }  # fmt: skip
    if gated:
        spec["schedulingGates"] = [{"name": GATE}]
    if group:
        spec["schedulingGroup"] = {"podGroupName": group}
    if node_selector:
        spec["nodeSelector"] = dict(node_selector)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": spec,
    }


# -------------------------------------------------------------------------------- observing


@dataclass
class Binds:
    """Pod name -> when it was created (before the request) and when it was first seen bound."""

    created: dict[str, float] = field(default_factory=dict)
    bound: dict[str, float] = field(default_factory=dict)
    placed: int = 0  # binds seen in all, the pods deleted since included
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)

    def watch(self, api: Api) -> None:
        while not self.stop.is_set():
            try:
                listing = api.core.list_namespaced_pod(NAMESPACE)
                self._see(listing.items)
                version = listing.metadata.resource_version
                stream = watch.Watch().stream(
                    api.core.list_namespaced_pod, NAMESPACE, resource_version=version, timeout_seconds=30,
                    allow_watch_bookmarks=True,
                )  # fmt: skip
                for event in stream:
                    if self.stop.is_set():
                        return
                    if event["type"] in ("ADDED", "MODIFIED"):
                        self._see([event["object"]])
            except Exception:  # a 410 or a dropped stream: list again
                time.sleep(0.2)

    def _see(self, pods: list[Any]) -> None:
        now = time.monotonic()
        with self.lock:
            for pod in pods:
                if pod.spec.node_name and pod.metadata.name not in self.bound:
                    self.bound[pod.metadata.name] = now
                    self.placed += 1

    def forget(self, names: list[str]) -> None:
        with self.lock:
            for name in names:
                self.bound.pop(name, None)
                self.created.pop(name, None)

    def wait(self, names: list[str], timeout: float, stall: float = 60.0) -> list[str]:
        """The names not bound when all are, after ``timeout`` seconds, or once ``stall`` seconds
        passed with none of them bound (what is left waits: fragmentation or a stuck path)."""
        deadline = time.monotonic() + timeout
        progress, left_before = time.monotonic(), len(names) + 1
        while True:
            with self.lock:
                left = [n for n in names if n not in self.bound]
            now = time.monotonic()
            if len(left) < left_before:
                progress, left_before = now, len(left)
            if not left or now > deadline or now - progress > stall:
                return left
            time.sleep(0.05)

    def last_bound(self, names: list[str]) -> float:
        """When the last of ``names`` that were bound was (NaN: none was)."""
        with self.lock:
            return max((self.bound[n] for n in names if n in self.bound), default=float("nan"))

    def latencies(self, names: list[str]) -> list[float]:
        with self.lock:
            return [self.bound[n] - self.created[n] for n in names if n in self.bound]


@dataclass
class Usage:
    """CPU seconds and RSS of a process, from /proc."""

    pid: int

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text(encoding="utf-8").rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def memory_mib(self, key: str = "VmHWM") -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text(encoding="utf-8").splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
        return float("nan")


def audit_offset() -> int:
    try:
        return audit_log().stat().st_size
    except FileNotFoundError:
        return 0


def audit_requests(start: int, end: int) -> Counter[str]:
    """Requests per user between two offsets of the audit log (one per audit ID)."""
    seen: dict[str, str] = {}
    with audit_log().open("rb") as handle:
        handle.seek(start)
        for line in handle.read(end - start).splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            seen[event["auditID"]] = event["user"]["username"]
    return Counter(seen.values())


# -------------------------------------------------------------------------------- one path


@dataclass
class Run:
    """Everything one case of one path needs: the API, the bind watcher, our controller if used."""

    cluster: Any
    api: Api
    binds: Binds
    path: str
    guard: bool = False  # our controller serves the allocation guard; kube-scheduler's writes go through it
    qps: int = 50  # our controller's client limits (burst twice that): kube-scheduler's in the same case
    controller: subprocess.Popen[bytes] | None = None
    serial: Iterator[int] = field(default_factory=lambda: iter(range(10**9)))

    @property
    def gated(self) -> bool:
        return self.path.startswith("ours")

    @property
    def policy_args(self) -> list[str]:
        return ["--policy", "best-fit"] if self.path == "ours-best-fit" else []

    def start_controller(self) -> None:
        """Our controller for our path (and for the guarded one); then one pod through the path."""
        if self.gated or self.guard:
            log = (STATE_DIR / "logs" / "fractional-controller.log").open("ab")
            kubeconfig = str(self.cluster.state_dir / "controller.kubeconfig")
            guard = []
            if self.guard:
                guard = ["--allocation-guard-port", str(GUARD_PORT), "--metrics-host", "127.0.0.1",
                         "--allocation-guard-cert-dir", str(guard_certificate(self.cluster))]  # fmt: skip
            self.controller = subprocess.Popen(
                [sys.executable, "-m", "driver", "controller", "--kubeconfig", kubeconfig, "--metrics-port",
                 "0", "--log-level", "warning", "--kube-api-qps", str(self.qps), "--kube-api-burst",
                 str(2 * self.qps), *guard, *self.policy_args],
                cwd=ROOT, stdout=log, stderr=log,
            )  # fmt: skip
        if self.guard:
            register_guard(self.api, self.cluster)
        self.warm_up()

    def warm_up(self) -> None:
        """One pod through the whole path: the allocators' caches are filled before anything is measured."""
        name = f"warm-{self.path}-{next(self.serial)}"
        template, body = share_template(1, 1)
        self.ensure_template(template, body)
        self.create([(name, template, None)])
        if self.binds.wait([name], 120):
            raise SystemExit(f"{self.path}: the warm-up pod was not bound in 120 s")
        self.delete([name])

    def stop_controller(self) -> None:
        if self.guard:
            unregister_guard(self.api)
        if self.controller is not None:
            self.controller.terminate()
            try:
                self.controller.wait(30)
            except subprocess.TimeoutExpired:
                self.controller.kill()
            self.controller = None

    def ensure_template(self, name: str, body: dict[str, Any]) -> None:
        try:
            self.api.resource.create_namespaced_resource_claim_template(NAMESPACE, body)
        except client.ApiException as error:
            if error.status != 409:
                raise

    def create(
        self,
        pods: list[tuple[str, str, str | None]],
        threads: int = 6,
        node_selector: dict[str, str] | None = None,
    ) -> None:
        """Create ``(name, template, pod group)`` pods as fast as ``threads`` clients can."""

        def one(entry: tuple[str, str, str | None]) -> None:
            name, template, group = entry
            with self.binds.lock:
                self.binds.created[name] = time.monotonic()
            body = pod_body(name, template, gated=self.gated, group=group, node_selector=node_selector)
            self.api.core.create_namespaced_pod(NAMESPACE, body, _preload_content=False)

        if threads == 1:
            for entry in pods:
                one(entry)
            return
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, pods))

    def delete(self, names: list[str]) -> None:
        body = client.V1DeleteOptions(grace_period_seconds=0)

        def one(name: str) -> None:
            try:
                self.api.core.delete_namespaced_pod(name, NAMESPACE, body=body)
            except client.ApiException as error:
                if error.status != 404:
                    raise

        with ThreadPoolExecutor(6) as pool:
            list(pool.map(one, names))
        self.binds.forget(names)

    def clean(self) -> None:
        """Every pod and PodGroup gone, and every claim made for them (the controller, when it
        runs, drops its finalizers)."""
        names = [p.metadata.name for p in self.api.core.list_namespaced_pod(NAMESPACE).items]
        self.delete(names)
        for group in self.pod_groups():
            self.api.custom.delete_namespaced_custom_object(
                "scheduling.k8s.io", pod_group_version(self.api), NAMESPACE, "podgroups", group
            )
        deadline = time.monotonic() + 300
        while self.api.resource.list_namespaced_resource_claim(NAMESPACE).items:
            if time.monotonic() > deadline:
                raise SystemExit("claims still there 300 s after their pods were deleted")
            time.sleep(0.5)
        while self.api.core.list_namespaced_pod(NAMESPACE).items:
            if time.monotonic() > deadline:
                raise SystemExit("pods still there 300 s after they were deleted")
            time.sleep(0.5)

    def pod_groups(self) -> list[str]:
        version = pod_group_version(self.api)
        if not version:
            return []
        listing = self.api.custom.list_namespaced_custom_object(
            "scheduling.k8s.io", version, NAMESPACE, "podgroups"
        )
        return [item["metadata"]["name"] for item in listing.get("items", [])]


def pod_group_version(api: Api) -> str:
    groups = client.ApisApi(api.api).get_api_versions().groups
    for group in groups:
        if group.name == "scheduling.k8s.io":
            for version in ("v1beta1", "v1alpha2"):
                if any(v.version == version for v in group.versions):
                    return version
    return ""


# -------------------------------------------------------------------------------- the cases


def case_backlog(run: Run, count: int) -> dict[str, Any]:
    template, body = share_template(12, 15)
    run.ensure_template(template, body)
    names = [f"b{i:04d}" for i in range(count)]
    started = time.monotonic()
    run.create([(n, template, None) for n in names])
    left = run.binds.wait(names, 900)
    last = run.binds.last_bound(names)
    latency = summary(run.binds.latencies(names))
    return {"pods": count, "unbound": len(left), "pods_per_s": (count - len(left)) / (last - started),
            "p50_s": latency["median"], "p99_s": latency["p99"]}  # fmt: skip


def case_stream(run: Run, count: int, interval: float) -> dict[str, Any]:
    template, body = share_template(12, 15)
    run.ensure_template(template, body)
    names = [f"s{i:04d}" for i in range(count)]
    for name in names:
        begun = time.monotonic()
        run.create([(name, template, None)], threads=1)
        time.sleep(max(0.0, interval - (time.monotonic() - begun)))
    left = run.binds.wait(names, 300)
    latency = summary(run.binds.latencies(names))
    return {"pods": count, "unbound": len(left), "p50_s": latency["median"], "p99_s": latency["p99"]}


# The allocator bench's model of kube-scheduler used these shares (memory and compute drawn
# independently), on 50 nodes x 8 GPUs: the real figure is taken on the same shape.
MEMORY_GI = (5, 10, 12, 20, 40)
COMPUTE = (0, 5, 10, 20)
PACKING_LABEL = "bench.fractional.dev/packing"
CHURN_ROUNDS = 5


def packing_trace(gpus: int, seed: int = 42) -> list[tuple[str, list[tuple[str, int, int]], list[str]]]:
    """Phases of (label, arrivals (name, memory Gi, compute), departures): the same for both paths."""
    rng = random.Random(seed)
    capacity = gpus * GPU_MEMORY_GI
    live: dict[str, int] = {}
    serial = iter(range(10**6))
    phases: list[tuple[str, list[tuple[str, int, int]], list[str]]] = []

    def fill(to: float) -> list[tuple[str, int, int]]:
        arrivals = []
        while sum(live.values()) < to * capacity:
            memory, compute = rng.choice(MEMORY_GI), rng.choice(COMPUTE)
            name = f"p{next(serial):05d}"
            live[name] = memory
            arrivals.append((name, memory, compute))
        return arrivals

    phases.append(("fill to 30 %", fill(0.30), []))
    phases.append(("fill to 65 %", fill(0.65), []))
    for round_ in range(CHURN_ROUNDS):
        departures = rng.sample(sorted(live), len(live) // 5)
        for name in departures:
            del live[name]
        phases.append((f"churn {round_ + 1} at 65 %", fill(0.65), departures))
    return phases


def occupancy(api: Api, pools: set[str]) -> dict[str, int]:
    """On the Nodes ``pools``: GPUs touched, whole GPUs free, and Nodes with all 8 GPUs free
    (8-GPU pods that still fit)."""
    gpus: set[tuple[str, str]] = set()
    for resource_slice in api.resource.list_resource_slice().items:
        if resource_slice.spec.driver == DRIVER and resource_slice.spec.pool.name in pools:
            gpus |= {(resource_slice.spec.pool.name, d.name) for d in resource_slice.spec.devices or ()
                     if d.name.startswith("gpu-")}  # fmt: skip
    touched: set[tuple[str, str]] = set()
    for claim in api.resource.list_namespaced_resource_claim(NAMESPACE).items:
        allocation = claim.status.allocation if claim.status else None
        for result in (allocation.devices.results if allocation and allocation.devices else None) or ():
            touched.add((result.pool, result.device))
    touched &= gpus
    nodes: dict[str, int] = Counter(pool for pool, _ in gpus - touched)
    return {"gpus_touched": len(touched), "gpus_free": len(gpus - touched),
            "free_8gpu_nodes": sum(1 for free in nodes.values() if free >= 8)}  # fmt: skip


def case_packing(run: Run, nodes: list[str]) -> list[dict[str, Any]]:
    for memory in MEMORY_GI:
        for compute in COMPUTE:
            run.ensure_template(*share_template(memory, compute))
    rows = []
    waiting: list[str] = []
    for label, arrivals, departures in packing_trace(8 * len(nodes)):
        run.delete(departures)
        gone = set(departures)
        waiting = [n for n in waiting if n not in gone]
        run.create([(name, share_template(memory, compute)[0], None) for name, memory, compute in arrivals],
                   node_selector={PACKING_LABEL: "true"})  # fmt: skip
        waiting = run.binds.wait(waiting + [name for name, _, _ in arrivals], 900, stall=30)
        if label.startswith("fill to 65") or (
            label.startswith("churn") and not label.startswith(f"churn {CHURN_ROUNDS}")
        ):
            continue
        rows.append({"phase": label, **occupancy(run.api, set(nodes)), "pods_waiting": len(waiting)})
    return rows


def case_gang(run: Run, size: int) -> dict[str, Any]:
    version = pod_group_version(run.api)
    if not version:
        return {"pods": size, "note": "no scheduling.k8s.io PodGroup API served"}
    template, body = share_template(40, 50)
    run.ensure_template(template, body)
    group = f"gang-{next(run.serial)}"
    pod_group = {"apiVersion": f"scheduling.k8s.io/{version}", "kind": "PodGroup",
                 "metadata": {"name": group, "namespace": NAMESPACE},
                 "spec": {"schedulingPolicy": {"gang": {"minCount": size}}}}  # fmt: skip
    run.api.custom.create_namespaced_custom_object(
        "scheduling.k8s.io", version, NAMESPACE, "podgroups", pod_group
    )
    names = [f"{group}-{i:02d}" for i in range(size)]
    started = time.monotonic()
    run.create([(n, template, group) for n in names])
    left = run.binds.wait(names, 600)
    last = run.binds.last_bound(names)
    return {"pods": size, "unbound": len(left), "all_bound_s": last - started if not left else float("nan")}


# -------------------------------------------------------------------------------- the profile

# The controller's stages, reported inclusive whatever their share: deciding, writing, watching.
PROFILE_STAGES = (
    "driver/controller/loop/reconcile.py:Reconciler.reconcile_gangs",
    "driver/controller/loop/reconcile.py:Reconciler._commit",
    "driver/kube/transport.py:JsonSender.send_json",
    "driver/controller/view/watch.py:Watcher._watch",
    "driver/controller/model/decode.py:decode_json",
)
FRAME = re.compile(r"^(?P<function>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")


def profiled_backlog(cluster: Any, api: Api, binds: Binds, count: int) -> tuple[int, list[dict[str, Any]]]:
    """Our path's backlog once more, with py-spy sampling the controller's stacks (not timed: the
    sampling takes CPU of its own). Returns the samples and the functions that took most of them."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        return 0, [{"function": "py-spy is not installed (the dev extra has it)"}]
    run = Run(cluster, api, binds, "ours")
    run.start_controller()
    assert run.controller is not None
    out = STATE_DIR / "logs" / "controller-profile.txt"
    sampler = subprocess.Popen(
        [spy, "record", "--pid", str(run.controller.pid), "--format", "raw", "--output", str(out),
         "--rate", "100", "--nonblocking"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        time.sleep(1.0)  # attached before the first pod
        case_backlog(run, count)
    finally:
        sampler.send_signal(signal.SIGINT)
        sampler.wait(120)
        run.clean()
        run.stop_controller()
    return summarize_profile(out.read_text(encoding="utf-8") if out.exists() else "")


def summarize_profile(raw: str, top: int = 12) -> tuple[int, list[dict[str, Any]]]:
    """py-spy's collapsed stacks -> the total samples; the ``top`` functions (file:function) by
    the share of samples they were on top of the stack (self), then the stages of our path, each
    with its share on the stack at all (inclusive)."""
    inclusive: Counter[str] = Counter()
    itself: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        names = []
        for frame in stack.split(";"):
            match = FRAME.match(frame)
            if match:
                path = match["file"].split("site-packages/")[-1].split("/work/main/")[-1]
                names.append(f"{path}:{match['function']}")
        for name in set(names):
            inclusive[name] += count
        if names:
            itself[names[-1]] += count
    rows = []
    for name, count in itself.most_common(top):  # where the CPU went
        rows.append({"function": name, "self_pct": 100 * count / max(total, 1),
                     "inclusive_pct": 100 * inclusive[name] / max(total, 1)})  # fmt: skip
    for name in PROFILE_STAGES:  # the stages of our path, inclusive
        rows.append({"function": name, "self_pct": 100 * itself[name] / max(total, 1),
                     "inclusive_pct": 100 * inclusive[name] / max(total, 1)})  # fmt: skip
    return total, rows


# -------------------------------------------------------------------------------- the run


def measured(run: Run, case: Callable[[], Any], scheduler: Usage) -> tuple[Any, dict[str, Any]]:
    """The case's own result and its cost: requests per user, CPU seconds, the controller's RSS."""
    offset, scheduler_cpu = audit_offset(), scheduler.cpu_seconds()
    controller = Usage(run.controller.pid) if run.controller else None
    controller_cpu = controller.cpu_seconds() if controller else 0.0
    with run.binds.lock:
        placed_before = run.binds.placed
    result = case()
    with run.binds.lock:
        bound = run.binds.placed - placed_before
    requests = audit_requests(offset, audit_offset())
    cost = {
        "scheduler_requests_per_pod": requests[SCHEDULER_USER] / max(bound, 1),
        "controller_requests_per_pod": requests[CONTROLLER_USER] / max(bound, 1) if controller else 0.0,
        "scheduler_cpu_s": scheduler.cpu_seconds() - scheduler_cpu,
        "controller_cpu_s": controller.cpu_seconds() - controller_cpu if controller else 0.0,
        "controller_rss_mib": controller.memory_mib() if controller else 0.0,
    }
    return result, cost


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--backlog", type=int, default=1000)
    parser.add_argument("--stream", type=int, default=200)
    parser.add_argument("--interval", type=float, default=0.1)
    parser.add_argument("--gang", type=int, default=64)
    parser.add_argument("--gang-repeats", type=int, default=5, help="gang samples per path")
    parser.add_argument("--packing-nodes", type=int, default=50, help="the Nodes the packing case uses")
    parser.add_argument(
        "--skip",
        default="",
        help="comma list of cases left out: backlog,stream,packing,gang,guard,raised,profile",
    )
    parser.add_argument("--result", help="the result's own name (real_scheduler_NAME): a run of some cases")
    args = parser.parse_args(argv)
    skipped = set(filter(None, args.skip.split(",")))
    # Where the real components cannot run, `make bench` goes on without this section (the stored
    # result, with its own date and commit, stays in BENCHMARKS.md).
    if os.geteuid() != 0:
        print("bench_real: skipped: the local cluster's harness needs root", file=sys.stderr)
        return 0
    from localcluster.cluster import ClusterError

    try:
        binaries()
    except ClusterError as error:
        print(f"bench_real: skipped: no upstream binaries: {error}", file=sys.stderr)
        return 0
    cluster = start_cluster()
    rows: list[dict[str, Any]] = []
    profile_rows: list[dict[str, Any]] = []
    try:
        api = bench_api(cluster)
        gpus = add_nodes(api, args.nodes, args.packing_nodes)
        packing_nodes = [f"node-{i:03d}" for i in range(min(args.packing_nodes, args.nodes))]
        scheduler = Usage(cluster.processes.get("kube-scheduler").pid)
        binds = Binds()
        watcher = threading.Thread(target=binds.watch, args=(api,), daemon=True)
        watcher.start()
        cases: list[tuple[str, Callable[[Run], Any]]] = [
            ("backlog", lambda run: case_backlog(run, args.backlog)),
            ("stream", lambda run: case_stream(run, args.stream, args.interval)),
            ("packing", lambda run: case_packing(run, packing_nodes)),
            ("gang", lambda run: case_gang(run, args.gang)),
        ]
        for index, (name, case) in enumerate(cases):
            if name in skipped:
                continue
            repeats = max(1, args.gang_repeats) if name == "gang" else 1
            for repeat in range(repeats):
                # Interleaved: who goes first alternates, from case to case and from repeat to repeat.
                paths = PACKING_PATHS if name == "packing" else PATHS
                order = paths if (index + repeat) % 2 == 0 else tuple(reversed(paths))
                for path in order:
                    run = Run(cluster, api, binds, path)
                    run.start_controller()
                    print(f"== {name}: {path}" + (f" ({repeat + 1} of {repeats})" if repeats > 1 else ""),
                          flush=True)  # fmt: skip
                    try:
                        result, cost = measured(run, lambda run=run, case=case: case(run), scheduler)
                        run.clean()
                    finally:
                        run.stop_controller()
                    for row in result if isinstance(result, list) else [result]:
                        extra = {"repeat": repeat + 1} if repeats > 1 else {}
                        rows.append({"case": name, "path": path, **extra, **row, **cost})
                        print(json.dumps(rows[-1]), flush=True)
        if "guard" not in skipped:
            # The allocation guard's cost to kube-scheduler's own path: the same backlog and stream of
            # ungated pods, without and with our controller's guard on every allocation it writes.
            guarded_cases: list[tuple[str, Callable[[Run], Any]]] = [
                ("backlog", lambda run: case_backlog(run, args.backlog)),
                ("stream", lambda run: case_stream(run, args.stream, args.interval)),
            ]
            for name, case in guarded_cases:
                for guarded in (False, True) if name == "backlog" else (True, False):
                    run = Run(cluster, api, binds, "kube-scheduler", guard=guarded)
                    run.start_controller()
                    label = "kube-scheduler, guarded" if guarded else "kube-scheduler"
                    print(f"== {name} through the allocation guard: {label}", flush=True)
                    try:
                        result, cost = measured(run, lambda run=run, case=case: case(run), scheduler)
                        run.clean()
                    finally:
                        run.stop_controller()
                    rows.append({"case": f"{name}, allocation guard", "path": label, **result, **cost})
                    print(json.dumps(rows[-1]), flush=True)
        if "raised" not in skipped:
            # The same backlog with kube-scheduler's client limits raised (its defaults: 50 requests
            # per second, bursts of 100): is it, or our controller, what limits the path?
            cluster.extra_args["kube-scheduler"] = [
                f"--kube-api-qps={RAISED_QPS}",
                f"--kube-api-burst={2 * RAISED_QPS}",
            ]
            cluster.restart_scheduler(binaries())
            scheduler = Usage(cluster.processes.get("kube-scheduler").pid)
            for path in PATHS:
                run = Run(cluster, api, binds, path, qps=RAISED_QPS)
                run.start_controller()
                print(f"== backlog, kube-scheduler at {RAISED_QPS} qps: {path}", flush=True)
                try:
                    result, cost = measured(run, lambda run=run: case_backlog(run, args.backlog), scheduler)
                    run.clean()
                finally:
                    run.stop_controller()
                rows.append(
                    {"case": f"backlog, kube-scheduler at {RAISED_QPS} qps", "path": path, **result, **cost}
                )
                print(json.dumps(rows[-1]), flush=True)
        if "profile" not in skipped:
            print("== profile: ours, backlog", flush=True)
            samples, top = profiled_backlog(cluster, api, binds, args.backlog)
            profile_rows = [{"case": "profile", "path": "ours", "samples": samples, **row} for row in top]
        binds.stop.set()
    finally:
        kept = STATE_DIR.parent / f"{STATE_DIR.name}-logs"  # the components' and the controller's logs
        shutil.rmtree(kept, ignore_errors=True)
        shutil.copytree(STATE_DIR / "logs", kept, dirs_exist_ok=True)
        print(f"logs kept in {kept}", flush=True)
        cluster.down()
    method = (__doc__ or "").split("\nWrites bench/results")[0].strip()
    notes = f"{method}\n\n{ratios(rows)}\n{args.nodes} nodes x 8 GPUs ({PROFILE}), {gpus} GPUs in all.\n"
    title = "The controller against kube-scheduler itself (real components)"
    area = "real_scheduler"
    if args.nodes != 100:  # another size is a section of its own, beside the 100-node one
        area, title = f"real_scheduler_{args.nodes}", f"{title}, {args.nodes:,} nodes"
    if args.result:  # a run of some cases only, beside the full one
        area, title = f"real_scheduler_{args.result}", f"{title}: {args.result}"
    write_result(area, rows + profile_rows, title=title, notes=notes)
    print(notes)
    return 0


def ratios(rows: list[dict[str, Any]]) -> str:
    """Ours against kube-scheduler in the same run, per case."""

    def pick(case: str, path: str, phase: str | None = None) -> dict[str, Any]:
        for row in rows:
            if row["case"] == case and row["path"] == path and (phase is None or row.get("phase") == phase):
                return row
        return {}

    lines = ["Ours against kube-scheduler, same run (above 1: ours is better, except where said):"]
    ours, theirs = pick("backlog", "ours"), pick("backlog", "kube-scheduler")
    if ours and theirs:
        lines.append(f"- backlog throughput: {ours['pods_per_s'] / theirs['pods_per_s']:.2f}x")
    ours, theirs = (
        pick(f"backlog, kube-scheduler at {RAISED_QPS} qps", "ours"),
        pick(f"backlog, kube-scheduler at {RAISED_QPS} qps", "kube-scheduler"),
    )
    if ours and theirs:
        ratio = ours["pods_per_s"] / theirs["pods_per_s"]
        lines.append(f"- backlog throughput, kube-scheduler's client limits raised: {ratio:.2f}x")
    ours, theirs = pick("stream", "ours"), pick("stream", "kube-scheduler")
    if ours and theirs:
        lines.append(f"- stream latency, median: {ours['p50_s'] / theirs['p50_s']:.2f}x "
                     f"(below 1 is better), p99: {ours['p99_s'] / theirs['p99_s']:.2f}x")  # fmt: skip
    for phase in ("fill to 30 %", f"churn {CHURN_ROUNDS} at 65 %"):
        ours, theirs = pick("packing", "ours", phase), pick("packing", "kube-scheduler", phase)
        if ours and theirs and theirs["gpus_free"]:
            lines.append(f"- whole GPUs free after {phase}: {ours['gpus_free'] / theirs['gpus_free']:.2f}x "
                         f"({ours['gpus_free']} against {theirs['gpus_free']}); 8-GPU pods that fit: "
                         f"{ours['free_8gpu_nodes']} against {theirs['free_8gpu_nodes']}")  # fmt: skip
        best_fit = pick("packing", "ours-best-fit", phase)
        if ours and best_fit:
            lines.append(f"- our default policy (fragmentation) against ours under best-fit, after {phase}: "
                         f"{ours['gpus_free']} whole GPUs free against {best_fit['gpus_free']}, "
                         f"{ours['gpus_touched']} touched against {best_fit['gpus_touched']}")  # fmt: skip
    for case, key, word in (("backlog, allocation guard", "pods_per_s", "throughput"),
                            ("stream, allocation guard", "p50_s", "median latency")):  # fmt: skip
        plain, guarded = pick(case, "kube-scheduler"), pick(case, "kube-scheduler, guarded")
        if plain and guarded:
            lines.append(f"- kube-scheduler's own {case.split(',')[0]} {word} through the allocation guard: "
                         f"{guarded[key] / plain[key]:.2f}x its own without it")  # fmt: skip
    gang = {path: [r for r in rows if r["case"] == "gang" and r["path"] == path] for path in PATHS}
    times = {path: [float(r.get("all_bound_s") or "nan") for r in found] for path, found in gang.items()}
    if all(times.values()) and not any(math.isnan(t) for found in times.values() for t in found):
        ours_s, theirs_s = times["ours"], times["kube-scheduler"]
        faster = sum(1 for a, b in zip(ours_s, theirs_s, strict=False) if a <= b)
        lines.append(
            f"- {gang['ours'][0]['pods']}-pod gang, time to all bound, median of {len(ours_s)}: "
            f"{statistics.median(ours_s):.2f} s against {statistics.median(theirs_s):.2f} s, "
            f"{statistics.median(ours_s) / statistics.median(theirs_s):.2f}x (below 1 is better; ours "
            f"{min(ours_s):.2f}-{max(ours_s):.2f} s, kube-scheduler's "
            f"{min(theirs_s):.2f}-{max(theirs_s):.2f} s; "
            f"ours no slower in {faster} of {min(len(ours_s), len(theirs_s))} pairs)"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
