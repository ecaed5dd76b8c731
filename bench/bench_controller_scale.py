"""The controller process at 1,000 and 5,000 nodes x 8 GPUs (h100-8x) on the API emulator: its
start-up, its memory, and its CPU per decided pod as the cluster grows.

Per size, one emulator (``fractional apiserver``, its own process) holding N Nodes with the
ResourceSlices our slice code builds for the profile, then ``--pods`` gated single-pod claims
(12Gi / 15 % each, as bench_controller.py). Then ``fractional controller`` is started as a process of
its own, as a user runs it but with ``--kube-api-qps 0`` (what is measured is its CPU path, not its
client-side rate limit), and measured from outside:

- ``startup_s``: from the process's start to its first decision written (the first gate removed,
  seen on a watch of the pods): interpreter, imports, the initial LIST of every kind, the cache and
  allocator state built from them, the watches, one decision and its three writes;
- ``drain_s`` and ``pods_per_s``: from the first gate removed to the last of the backlog's;
- ``cpu_ms_per_pod``: the controller's CPU (user + system, ``/proc/<pid>/stat``) over the drain, per
  pod: the cost of one decision with its writes and watch events, which should not grow with the
  cluster;
- ``rss_mib``: the process's peak resident memory (``VmHWM``) at the end;
- ``apiserver_cpu_ms_per_pod``: the emulator's CPU over the same drain, for context.

The emulator is not kube-apiserver (the issue "Production size" runs the real control plane on kwok
nodes); what is measured here is our process alone, which the emulator only feeds.

``--backlog N`` measures instead a backlog of gated pods that do not fit, under churn, at each size:
every GPU holds one 70Gi / 85 % share (the fill, placed by the controller), then N whole-GPU pods
arrive (none fits), then for ``--churn-seconds`` ``--churn-rate`` departures a second (a live share
pod and its claim deleted, drawn at random) each followed by a new 70Gi share pod. Per row:
``arrival_cpu_s``, the controller's CPU while the backlog arrives and is decided (until it idles);
``churn_cores``, its CPU over the churn per second of it; ``backlog_placed`` and
``arrivals_placed``, the whole-GPU pods and the new shares ungated by 20 s after the churn (a
departure frees a GPU only when its pod was placed: ``freed``), and ``placed_during_churn`` the two
by the churn's end (a controller behind leaves freed GPUs idle); ``rss_mib`` at the end.
``--controller-tree PATH[,PATH]`` runs the controller from other checkouts, one row each (a worktree
at an earlier commit and this one: before and after in one run).

    .venv/bin/python bench/bench_controller_scale.py [--sizes 1000,5000] [--pods 1000]
    .venv/bin/python bench/bench_controller_scale.py --backlog 1000 --sizes 500 [--controller-tree DIR,.]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kubernetes import client, watch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import write_result
from bench.bench_controller import NAMESPACE, create_pods, pod, populate, start_apiserver

ROOT = Path(__file__).resolve().parent.parent


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_mib(pid: int) -> float:
    match = re.search(r"VmHWM:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    return int(match.group(1)) / 1024 if match else float("nan")


class _Gates:
    """When each pod of the namespace was first seen ungated (a watch on the emulator)."""

    def __init__(self, configuration: client.Configuration) -> None:
        self.ungated: dict[str, float] = {}
        self._api = client.ApiClient(configuration)
        core = client.CoreV1Api(self._api)
        listed = core.list_namespaced_pod(NAMESPACE, limit=1, _preload_content=False)
        version = json.loads(listed.data)["metadata"]["resourceVersion"]
        self._stream = watch.Watch()
        self._thread = threading.Thread(target=self._run, args=(core, version), daemon=True)
        self._thread.start()

    def _run(self, core: client.CoreV1Api, version: str) -> None:
        try:
            for event in self._stream.stream(
                core.list_namespaced_pod, NAMESPACE, resource_version=version, _request_timeout=7200
            ):
                obj = event["object"]
                if event["type"] == "MODIFIED" and not obj.spec.scheduling_gates:
                    self.ungated.setdefault(obj.metadata.name, time.monotonic())
        except Exception:  # the emulator went away at the end of the run
            return

    def count(self, names: list[str]) -> int:
        return sum(1 for n in names if n in self.ungated)

    def close(self) -> None:
        self._stream.stop()
        self._api.close()  # type: ignore[no-untyped-call]


class Ungates(_Gates):
    """Watches the backlog's pods (on the emulator, not the controller: a scrape of its /metrics at
    5,000 nodes costs it more than a decision) and notes when the first and the last gate went."""

    def __init__(self, configuration: client.Configuration, pods: int) -> None:
        self.pods = pods
        super().__init__(configuration)

    @property
    def first(self) -> float:
        return min(list(self.ungated.values()), default=0.0)

    @property
    def last(self) -> float:
        seen = list(self.ungated.values())
        return max(seen) if len(seen) >= self.pods else 0.0

    def wait(self, deadline: float, alive: Callable[[], bool], what: Callable[[], float]) -> float:
        while not what():
            if time.monotonic() > deadline or not alive():
                raise SystemExit("the controller stopped, or the backlog did not drain in time")
            time.sleep(0.02)
        return what()


def measure(nodes: int, pods: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as workdir:
        emulator, configuration = start_apiserver(Path(workdir), 0)
        try:
            began = time.monotonic()
            populate(configuration, nodes)
            create_pods(configuration, [f"b-{i:05d}" for i in range(pods)])
            setup = time.monotonic() - began
            ungates = Ungates(configuration, pods)
            started = time.monotonic()
            kubeconfig = str(Path(workdir) / "kubeconfig")
            controller = subprocess.Popen(
                [sys.executable, "-m", "driver", "controller", "--kubeconfig", kubeconfig,
                 "--policy", "best-fit", "--metrics-port", "0",
                 "--kube-api-qps", "0"],  # the CPU path, unthrottled, as before the flag existed
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            try:
                deadline, alive = started + 900, lambda: controller.poll() is None
                first = ungates.wait(deadline, alive, lambda: ungates.first)
                ours, theirs = cpu_seconds(controller.pid), cpu_seconds(emulator.pid)
                drained = ungates.wait(deadline, alive, lambda: ungates.last)
                ours, theirs = cpu_seconds(controller.pid) - ours, cpu_seconds(emulator.pid) - theirs
                rss = peak_rss_mib(controller.pid)
            finally:
                ungates.close()
                controller.terminate()
                controller.wait(timeout=30)
        finally:
            emulator.terminate()
            emulator.wait(timeout=30)
    return {
        "nodes": nodes, "gpus": nodes * 8, "pods": pods,
        "startup_s": round(first - started, 1),
        "drain_s": round(drained - first, 1),
        "pods_per_s": round(pods / (drained - first), 1),
        "cpu_ms_per_pod": round(ours / pods * 1000, 2),
        "rss_mib": round(rss),
        "apiserver_cpu_ms_per_pod": round(theirs / pods * 1000, 2),
        "setup_s": round(setup, 1),
    }  # fmt: skip


def _backlog_claim(name: str, whole: bool) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": "gpu.fractional.dev"}
    if not whole:
        exactly["capacity"] = {"requests": {"memory": "70Gi", "compute": "85"}}
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}}  # fmt: skip


def _until_idle(pid: int, *, quiet: float = 0.2, every: float = 2.0, limit: float = 900.0) -> None:
    """Wait until the process used less than ``quiet`` CPU-seconds in ``every`` seconds."""
    deadline, last = time.monotonic() + limit, cpu_seconds(pid)
    while time.monotonic() < deadline:
        time.sleep(every)
        now = cpu_seconds(pid)
        if now - last < quiet:
            return
        last = now
    raise SystemExit("the controller did not settle")


def measure_backlog(
    nodes: int, backlog: int, churn_seconds: float, churn_rate: float, tree: Path
) -> dict[str, Any]:
    rng = random.Random(1)
    with tempfile.TemporaryDirectory(prefix="bench-backlog-") as workdir:
        emulator, configuration = start_apiserver(Path(workdir), 0)
        api = client.ApiClient(configuration)
        core, resource = client.CoreV1Api(api), client.ResourceV1Api(api)

        def add(name: str, whole: bool) -> None:
            resource.create_namespaced_resource_claim(
                NAMESPACE, _backlog_claim(name, whole), _preload_content=False
            )
            body = pod(name)
            core.create_namespaced_pod(NAMESPACE, body, _preload_content=False)

        def remove(name: str) -> None:
            core.delete_namespaced_pod(name, NAMESPACE, grace_period_seconds=0, _preload_content=False)
            resource.delete_namespaced_resource_claim(name, NAMESPACE, _preload_content=False)

        controller: subprocess.Popen[bytes] | None = None
        gates: _Gates | None = None
        try:
            populate(configuration, nodes)
            fill = [f"f-{i:05d}" for i in range(nodes * 8)]
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(lambda n: add(n, False), fill))
            gates = _Gates(configuration)
            controller = subprocess.Popen(
                [sys.executable, "-m", "driver", "controller", "--kubeconfig", f"{workdir}/kubeconfig",
                 "--policy", "best-fit", "--metrics-port", "0", "--kube-api-qps", "0"],
                cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            deadline = time.monotonic() + 900
            while gates.count(fill) < len(fill):
                if time.monotonic() > deadline or controller.poll() is not None:
                    raise SystemExit("the fill was not placed")
                time.sleep(0.2)
            waiting = [f"w-{i:05d}" for i in range(backlog)]
            before = cpu_seconds(controller.pid)
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(lambda n: add(n, True), waiting))
            _until_idle(controller.pid)
            arrival_cpu = cpu_seconds(controller.pid) - before
            live, arrivals, freed = list(fill), [], 0
            ours, theirs = cpu_seconds(controller.pid), cpu_seconds(emulator.pid)
            started = time.monotonic()
            while (elapsed := time.monotonic() - started) < churn_seconds:
                if (pause := len(arrivals) / churn_rate - elapsed) > 0:
                    time.sleep(pause)
                gone = live.pop(rng.randrange(len(live)))
                freed += gone in gates.ungated
                remove(gone)
                name = f"a-{len(arrivals):05d}"
                add(name, False)
                arrivals.append(name)
                live.append(name)
            churn = time.monotonic() - started
            ours, theirs = cpu_seconds(controller.pid) - ours, cpu_seconds(emulator.pid) - theirs
            in_churn = gates.count(waiting) + gates.count(arrivals)
            time.sleep(20)
            return {
                "nodes": nodes, "gpus": nodes * 8, "backlog": backlog, "controller_commit": _commit_of(tree),
                "arrival_cpu_s": round(arrival_cpu, 1),
                "churn_departures": len(arrivals), "churn_s": round(churn, 1),
                "churn_cores": round(ours / churn, 2),
                "apiserver_churn_cores": round(theirs / churn, 2),
                "freed": freed, "placed_during_churn": in_churn,
                "backlog_placed": gates.count(waiting), "arrivals_placed": gates.count(arrivals),
                "rss_mib": round(peak_rss_mib(controller.pid)),
            }  # fmt: skip
        finally:
            if gates is not None:
                gates.close()
            if controller is not None:
                controller.terminate()
                controller.wait(timeout=30)
            api.close()  # type: ignore[no-untyped-call]
            emulator.terminate()
            emulator.wait(timeout=30)


def _commit_of(tree: Path) -> str:
    found = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                           capture_output=True, text=True, check=False)  # fmt: skip
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--", "driver"],
                           capture_output=True, text=True, check=False).stdout.strip()  # fmt: skip
    return found.stdout.strip() + ("-dirty" if dirty else "")


def main_backlog(args: argparse.Namespace) -> None:
    trees = [Path(t).resolve() for t in args.controller_tree.split(",") if t] or [ROOT]
    rows = []
    for nodes in (int(n) for n in args.sizes.split(",")):
        for tree in trees:
            rows.append(measure_backlog(nodes, args.backlog, args.churn_seconds, args.churn_rate, tree))
            print(rows[-1], flush=True)
    named = ",".join("." if t == ROOT else f"<worktree at {_commit_of(t)}>" for t in trees)
    command = f"python bench/bench_controller_scale.py --backlog {args.backlog} --sizes {args.sizes}" + (
        f" --churn-seconds {args.churn_seconds:g} --churn-rate {args.churn_rate:g} --controller-tree {named}"
    )
    path = write_result(
        "controller_backlog", rows, command=command,
        title="The controller with a backlog that does not fit, under churn (API emulator)",
        notes="`fractional controller` as its own process against the emulator holding N h100-8x Nodes, "
        "every GPU holding one 70Gi / 85 % share that the controller placed; then `backlog` gated "
        "whole-GPU pods (none fits), then churn: departures of random share pods, each followed by a new "
        "70Gi share. arrival_cpu_s: the controller's CPU while the backlog arrives and is decided; "
        "churn_cores: its CPU over the churn per second; freed: departures of placed pods (a GPU each); "
        "placed_during_churn: whole-GPU pods and new shares ungated by the churn's end; "
        "backlog_placed / arrivals_placed: ungated by 20 s after it; rss_mib: its peak. "
        "controller_commit: the code the controller ran (the rows of an earlier commit come from "
        "`--controller-tree`, a worktree of it, in the same run).",
    )  # fmt: skip
    print(f"written {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,5000", help="node counts, comma-separated")
    parser.add_argument("--pods", type=int, default=1000)
    parser.add_argument("--backlog", type=int, default=0, help="measure a backlog of this many unfit pods")
    parser.add_argument("--churn-seconds", type=float, default=60.0)
    parser.add_argument("--churn-rate", type=float, default=5.0, help="departures (and arrivals) per second")
    parser.add_argument("--controller-tree", default="", help="checkouts to run the controller from (a,b)")
    args = parser.parse_args()
    if args.backlog:
        main_backlog(args)
        return
    rows = []
    for nodes in (int(n) for n in args.sizes.split(",")):
        rows.append(measure(nodes, args.pods))
        print(rows[-1], flush=True)
    smallest, largest = rows[0], rows[-1]
    if len(rows) > 1:
        largest["cpu_per_pod_vs_smallest"] = round(largest["cpu_ms_per_pod"] / smallest["cpu_ms_per_pod"], 2)
    path = write_result(
        "controller_scale", rows, title="The controller process at 1,000 and 5,000 nodes (API emulator)",
        notes="`fractional controller` as its own process against the emulator holding N h100-8x Nodes and "
        "their ResourceSlices (built by our slice code) and a backlog of gated single-pod claims "
        "(12Gi / 15 % each). startup_s: process start to first decision (imports, the initial LIST, the "
        "cache, the watches). cpu_ms_per_pod: the controller's CPU over the drain per pod; "
        "cpu_per_pod_vs_smallest: its growth from the smallest size (the issue's goal: at most 2x from "
        "1,000 to 5,000 nodes). rss_mib: peak resident memory (goal: at most 1 GiB at 5,000 nodes). The "
        "real control plane on kwok nodes is the issue's own measure; this is our process alone.",
    )  # fmt: skip
    print(f"written {path}")


if __name__ == "__main__":
    main()
