"""The trace simulation of the FGD paper (Weng et al., ATC '23), re-implemented to compare placement
policies on the Alibaba GPU trace (cluster-trace-gpu-v2023) with the published figures.

This is the FGD paper's method as its simulator (hkust-adsl/kubernetes-scheduler-simulator) runs it;
the section marks (§) below are those of the FGD paper's method.

- Inputs (§1, §2.1). Nodes: name, CPU milli, memory MiB, GPU count and model; every GPU has 1000 milli
  and GPU memory is not modelled. Pods: CPU and memory requests, ``num_gpu`` GPUs of ``gpu_milli`` each
  (clamped to 0..1000), ``gpu_spec`` the allowed models split on "|" (empty: any). A pod with
  ``num_gpu == 0`` is CPU-only whatever its other GPU columns say; it is kept with ``gpu_milli`` 0 and
  no ``gpu_spec``. Its GPU demand is ``num_gpu * gpu_milli``.
- One run (§2.4, ``build_run``): sort the pods by name, shuffle them, then "tune" the GPU demand D to the
  target T = ``inflate`` x cluster GPU milli. Below T, draw pods uniformly with replacement from the
  name-sorted list and stop at the first draw whose *per-GPU* milli m would take D past T (D + m > T);
  every other draw, CPU-only ones included, is appended as a copy after the shuffled pods. Above T,
  remove uniformly random pods until D <= T. Last, a random permutation of the nodes (taken in name
  order) gives each node its tie-break priority: a score tie goes to the smallest.
  Python's ``random.Random(seed)`` takes the draws in the simulator's order (one thrown-away draw, the
  shuffle, the tuning draws, the node permutation), but it cannot reproduce Go's ``math/rand`` stream:
  per-seed figures differ from the published ones, so compare means over seeds.
- Placement (§3, ``Cluster``, ``replay``): pods are submitted one at a time, never retried, never
  removed. A node is feasible when the pod's CPU and memory fit what is left, and, for a GPU pod, the
  node's model is allowed and k GPUs each have at least m free (k = 1: one such GPU). The pod limit of
  the scheduler (1,001 pods a node) never binds on these traces and is not modelled.
- Metrics (§4.1, §4.2, ``bin_allocation``): after every pod, placed or failed, the arrived GPU milli A
  (failed pods included) and the allocated GPU milli U. Events are binned by round(A / 10N) (N GPUs,
  Python rounding); bin x holds round(mean of round(U / 10N, 2), 2) over its events, else over those
  within one bin of x, else nothing. Columns 100 and 130 are the figures the paper reports.
- FGD's typical pods (§5.6, ``typical_pods``): the trace's pods grouped by (CPU, m, k, ``gpu_spec``),
  most frequent first, the shortest prefix covering 95% of the pods, weighted by count.

Policies plug in through ``Policy``; BestFit and FGD are in bench/fgd_policies.py. The harness keeps
its own ``Cluster``: it checks every placement a policy returns (``Cluster.apply`` refuses one past a
GPU's capacity, CPU, memory or model, or with the wrong GPUs) before it counts it, then tells the policy
with ``Policy.placed``. A policy that reads cluster state keeps its own ``Cluster`` and applies the
placement to it there (the harness never shares its copy, so a policy cannot corrupt the referee).
"""

from __future__ import annotations

import csv
import os
import random
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import IO, Protocol

import numpy as np
import numpy.typing as npt

__all__ = [
    "BINS",
    "COPY_MARK",
    "GPU_MILLI",
    "PLACEMENT_COLUMNS",
    "Cluster",
    "GpuAssignment",
    "Placement",
    "PlacementError",
    "Policy",
    "Replay",
    "Run",
    "TraceNode",
    "TracePod",
    "TypicalPod",
    "bin_allocation",
    "build_run",
    "columns",
    "figures_from_placements",
    "load_nodes",
    "load_pods",
    "replay",
    "typical_pods",
    "write_placements",
]

GPU_MILLI = 1000
"""Capacity of one GPU, in milli-GPU."""

COPY_MARK = "-tuned-"
"""A tuning copy of pod ``p`` is named ``p-tuned-<i>``."""

BINS = range(131)
"""The arrived-demand bins, in % of cluster GPU capacity, of the published allocation files."""

PLACEMENT_COLUMNS = ("seed", "index", "name", "node", "gpus")

GpuAssignment = tuple[tuple[int, int], ...]
"""(GPU index on the node, milli taken) per GPU a pod takes; empty for a CPU-only pod."""

Placement = tuple[int, GpuAssignment]
"""(index of the node in the node list, its GPUs)."""

PathLike = str | os.PathLike[str]
BoolArray = npt.NDArray[np.bool_]
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class TraceNode:
    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str


@dataclass(frozen=True, slots=True)
class TracePod:
    """One pod of the trace: ``num_gpu`` GPUs of ``gpu_milli`` each (0..1000), on a node whose model is
    in ``gpu_spec`` (empty: any). CPU-only pods (``num_gpu == 0``) have ``gpu_milli`` 0 and no spec."""

    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    gpu_spec: tuple[str, ...]

    @property
    def demand(self) -> int:
        """GPU demand in milli: num_gpu x gpu_milli."""
        return self.num_gpu * self.gpu_milli

    @property
    def fractional(self) -> bool:
        """One GPU, less than all of it: the pods whose GPU each policy chooses its own way (§3)."""
        return self.num_gpu == 1 and self.gpu_milli < GPU_MILLI


@dataclass(frozen=True, slots=True)
class Run:
    """One seeded run of a trace (§2.4).

    ``pods`` is the submission order: the trace's pods shuffled (less those tuned away), then the tuning
    copies from index ``first_copy`` on. A copy is named ``<name>-tuned-<i>``, i counting the copies from
    0 in the order they were appended, so names stay unique when a pod is drawn twice.
    ``node_order[i]`` is the tie-break priority of node ``i`` of the node list: a permutation of
    0..len(nodes)-1, and ties go to the smallest. ``originals`` is the trace's pod list sorted by name,
    before shuffling and tuning (FGD's typical pods come from it).
    """

    seed: int
    pods: list[TracePod]
    node_order: list[int]
    originals: tuple[TracePod, ...]
    first_copy: int

    def trace_name(self, index: int) -> str:
        """The trace's name of submitted pod ``index``: a copy answers with its original's name."""
        name = self.pods[index].name
        return name[: name.rindex(COPY_MARK)] if index >= self.first_copy else name


class PlacementError(ValueError):
    """A policy's placement that the cluster cannot take."""

    def __init__(self, *, pod: str, node: str, problem: str) -> None:
        super().__init__(f"pod {pod} on node {node}: {problem}")
        self.pod, self.node, self.problem = pod, node, problem


# --- reading the trace -----------------------------------------------------------------------------------


def _rows(
    path: PathLike, required: Sequence[str], optional: Sequence[str]
) -> Iterator[tuple[int, dict[str, str]]]:
    """(line number, {column: text}) per data row of a CSV file; blank lines are skipped."""
    with open(path, newline="", encoding="utf-8") as handle:
        reader = csv.reader(handle)
        header = next(reader, None)
        if header is None:
            raise ValueError(f"{path}: line 1: empty file, expected a header with {', '.join(required)}")
        for column in required:
            if column not in header:
                raise ValueError(f"{path}: line 1: column {column!r}: missing from the header")
        positions = {column: header.index(column) for column in (*required, *optional) if column in header}
        for row in reader:
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            for column, position in positions.items():
                if position >= len(row):
                    raise ValueError(
                        f"{path}: line {reader.line_num}: column {column!r}: missing "
                        f"(the row has {len(row)} fields, the header {len(header)})"
                    )
            yield reader.line_num, {column: row[position] for column, position in positions.items()}


def _integer(path: PathLike, line: int, column: str, text: str, *, minimum: int | None = 0) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{path}: line {line}: column {column!r}: {text!r} is not an integer") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{path}: line {line}: column {column!r}: {value} is below {minimum}")
    return value


def _name(path: PathLike, line: int, column: str, text: str, seen: set[str]) -> str:
    if not text:
        raise ValueError(f"{path}: line {line}: column {column!r}: empty name")
    if text in seen:
        raise ValueError(f"{path}: line {line}: column {column!r}: {text!r} appears twice")
    seen.add(text)
    return text


def load_nodes(path: PathLike) -> list[TraceNode]:
    """The nodes of a node-list CSV (columns ``sn,cpu_milli,memory_mib,gpu,model``), in file order."""
    nodes: list[TraceNode] = []
    seen: set[str] = set()
    for line, row in _rows(path, ("sn", "cpu_milli", "memory_mib", "gpu", "model"), ()):
        nodes.append(
            TraceNode(
                name=_name(path, line, "sn", row["sn"], seen),
                cpu_milli=_integer(path, line, "cpu_milli", row["cpu_milli"]),
                memory_mib=_integer(path, line, "memory_mib", row["memory_mib"]),
                gpus=_integer(path, line, "gpu", row["gpu"]),
                model=row["model"],
            )
        )
    return nodes


def load_pods(path: PathLike) -> list[TracePod]:
    """The pods of a pod-list CSV, in file order (§2.1). ``gpu_spec`` may be absent (the multigpu
    variants); the time, QoS and phase columns are not read."""
    pods: list[TracePod] = []
    seen: set[str] = set()
    required = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")
    for line, row in _rows(path, required, ("gpu_spec",)):
        name = _name(path, line, "name", row["name"], seen)
        cpu_milli = _integer(path, line, "cpu_milli", row["cpu_milli"])
        memory_mib = _integer(path, line, "memory_mib", row["memory_mib"])
        num_gpu = _integer(path, line, "num_gpu", row["num_gpu"])
        raw_milli = _integer(path, line, "gpu_milli", row["gpu_milli"], minimum=None)
        gpu_spec: tuple[str, ...] = ()
        if num_gpu == 0:
            gpu_milli = 0
        else:
            gpu_milli = min(max(raw_milli, 0), GPU_MILLI)
            gpu_spec = tuple(model for model in row.get("gpu_spec", "").split("|") if model)
        pods.append(TracePod(name, cpu_milli, memory_mib, num_gpu, gpu_milli, gpu_spec))
    return pods


# --- one run's workload --------------------------------------------------------------------------------


def build_run(nodes: Sequence[TraceNode], pods: Sequence[TracePod], seed: int, inflate: float = 1.3) -> Run:
    """The submission order and node priorities of one seeded run (§2.4, steps 1-7).

    Python's ``random.Random(seed)`` cannot reproduce Go's ``math/rand`` stream, so no run here is the
    simulator's run of the same seed: compare means over seeds, never single runs.
    """
    if not inflate > 0:
        raise ValueError(f"inflate: {inflate} is not a positive ratio")
    rng = random.Random(seed)
    rng.getrandbits(63)  # step 1: the simulator draws one number first and throws it away
    originals = tuple(sorted(pods, key=lambda pod: pod.name))
    order = list(originals)
    rng.shuffle(order)  # step 2
    target = inflate * GPU_MILLI * sum(node.gpus for node in nodes)  # step 3
    demand = sum(pod.demand for pod in originals)
    copies: list[TracePod] = []
    if demand < target:  # step 4: tune up
        if not any(pod.demand > 0 for pod in originals):
            raise ValueError(f"cannot tune the demand up to {target:.0f} milli: no pod asks for GPU milli")
        while True:
            drawn = originals[rng.randrange(len(originals))]
            if demand + drawn.gpu_milli > target:  # the per-GPU milli, not the pod's demand
                break
            copies.append(replace(drawn, name=f"{drawn.name}{COPY_MARK}{len(copies)}"))
            demand += drawn.demand
    else:  # step 5: tune down, keeping the order of the rest (never after a tune-up's last copy overshoots)
        while demand > target:
            demand -= order.pop(rng.randrange(len(order))).demand
    by_name = sorted(range(len(nodes)), key=lambda index: nodes[index].name)
    permutation = list(range(len(nodes)))
    rng.shuffle(permutation)  # step 7
    node_order = [0] * len(nodes)
    for rank, index in enumerate(by_name):
        node_order[index] = permutation[rank]
    return Run(
        seed=seed, pods=order + copies, node_order=node_order, originals=originals, first_copy=len(order)
    )


# --- cluster state ---------------------------------------------------------------------------------------


class Cluster:
    """Free CPU, memory and per-GPU milli of every node (§3), as numpy arrays a policy may read.

    ``gpu_free`` is nodes x (most GPUs on a node); slots past a node's GPU count hold 0 and are False
    in ``gpu_valid``. ``gpu_free_total`` is the per-node sum of ``gpu_free``.
    """

    def __init__(self, nodes: Sequence[TraceNode]) -> None:
        self.nodes = tuple(nodes)
        width = max((node.gpus for node in self.nodes), default=0)
        self.cpu_free: IntArray = np.array([node.cpu_milli for node in self.nodes], dtype=np.int64)
        self.memory_free: IntArray = np.array([node.memory_mib for node in self.nodes], dtype=np.int64)
        self.gpu_count: IntArray = np.array([node.gpus for node in self.nodes], dtype=np.int64)
        self.gpu_valid: BoolArray = np.arange(width)[None, :] < self.gpu_count[:, None]
        self.gpu_free: IntArray = np.where(self.gpu_valid, GPU_MILLI, 0).astype(np.int64)
        self.gpu_free_total: IntArray = self.gpu_count * GPU_MILLI
        self._model_masks: dict[tuple[str, ...], BoolArray] = {}

    def model_mask(self, gpu_spec: tuple[str, ...]) -> BoolArray:
        """Nodes whose model is allowed by ``gpu_spec`` (every node for an empty spec)."""
        mask = self._model_masks.get(gpu_spec)
        if mask is None:
            allowed = set(gpu_spec)
            mask = np.array([not gpu_spec or node.model in allowed for node in self.nodes], dtype=bool)
            self._model_masks[gpu_spec] = mask
        return mask

    def feasible(self, pod: TracePod) -> BoolArray:
        """Per node, whether ``pod`` fits there now (``fits`` for every node at once)."""
        ok = (self.cpu_free >= pod.cpu_milli) & (self.memory_free >= pod.memory_mib)
        if pod.num_gpu:
            ok &= self.model_mask(pod.gpu_spec)
            ok &= ((self.gpu_free >= pod.gpu_milli) & self.gpu_valid).sum(axis=1) >= pod.num_gpu
        return ok

    def fits(self, pod: TracePod, node: int) -> bool:
        """Whether ``pod`` fits on node ``node`` now: CPU, memory, and for a GPU pod the model and k GPUs
        with at least m free each."""
        if self.cpu_free[node] < pod.cpu_milli or self.memory_free[node] < pod.memory_mib:
            return False
        if pod.num_gpu == 0:
            return True
        if pod.gpu_spec and self.nodes[node].model not in pod.gpu_spec:
            return False
        roomy = sum(1 for free in self._gpus(node) if free >= pod.gpu_milli)
        return roomy >= pod.num_gpu

    def apply(self, pod: TracePod, node: int, gpus: GpuAssignment) -> None:
        """Place ``pod`` on node ``node`` taking ``gpus``; raise ``PlacementError`` (a ``ValueError``),
        changing nothing, when that placement is not valid now."""
        problem = self._problem(pod, node, gpus)
        if problem is not None:
            name = self.nodes[node].name if 0 <= node < len(self.nodes) else f"#{node}"
            raise PlacementError(pod=pod.name, node=name, problem=problem)
        self.cpu_free[node] -= pod.cpu_milli
        self.memory_free[node] -= pod.memory_mib
        for gpu, milli in gpus:
            self.gpu_free[node, gpu] -= milli
            self.gpu_free_total[node] -= milli

    def _gpus(self, node: int) -> list[int]:
        return [int(free) for free in self.gpu_free[node, : self.gpu_count[node]]]

    def _problem(self, pod: TracePod, node: int, gpus: GpuAssignment) -> str | None:
        if not 0 <= node < len(self.nodes):
            return f"no such node (the cluster has {len(self.nodes)})"
        if pod.cpu_milli > self.cpu_free[node]:
            return f"CPU {pod.cpu_milli}m asked, {self.cpu_free[node]}m free"
        if pod.memory_mib > self.memory_free[node]:
            return f"memory {pod.memory_mib} MiB asked, {self.memory_free[node]} MiB free"
        if pod.num_gpu == 0:
            return None if not gpus else f"a CPU-only pod given GPUs {gpus}"
        model = self.nodes[node].model
        if pod.gpu_spec and model not in pod.gpu_spec:
            return f"model {model} is not one of {'|'.join(pod.gpu_spec)}"
        if len(gpus) != pod.num_gpu:
            return f"{pod.num_gpu} GPUs asked, {len(gpus)} given"
        indices = [gpu for gpu, _ in gpus]
        if len(set(indices)) != len(indices):
            return f"a GPU given twice in {gpus}"
        free = self._gpus(node)
        for gpu, milli in gpus:
            if not 0 <= gpu < len(free):
                return f"GPU {gpu}: no such GPU (the node has {len(free)})"
            if milli != pod.gpu_milli:
                return f"GPU {gpu}: {milli} milli given, the pod takes {pod.gpu_milli} per GPU"
            if milli > free[gpu]:
                return f"GPU {gpu}: {milli} milli asked, {free[gpu]} free"
        return None


# --- policies and the replay -----------------------------------------------------------------------------


class Policy(Protocol):
    """A placement policy, asked about one pod at a time.

    ``place`` answers (node index, GPUs) or None (the pod fails: it is not retried). After the harness
    has checked and applied a placement on its own cluster, it calls ``placed`` with it, so that a
    policy keeping its own state can follow (bench/fgd_policies.py's keep a ``Cluster`` of their own).
    """

    name: str

    def place(self, pod: TracePod) -> Placement | None: ...

    def placed(self, pod: TracePod, node: int, gpus: GpuAssignment) -> None: ...


@dataclass(frozen=True, slots=True)
class Replay:
    """One policy's replay of one run (§4.1). Entry i of each list belongs to submitted pod i.

    ``events``: (arrived GPU milli A, allocated GPU milli U) after pod i, placed or failed; A counts
    failed pods' demand too. ``placements``: (node index or None, GPUs taken). ``place_seconds``: wall
    time of the policy's ``place`` call (time.perf_counter).
    """

    policy: str
    total_gpus: int
    events: list[tuple[int, int]]
    placements: list[tuple[int | None, GpuAssignment]]
    place_seconds: list[float]

    @property
    def failed(self) -> int:
        return sum(1 for node, _ in self.placements if node is None)


def replay(nodes: Sequence[TraceNode], run: Run, policy: Policy) -> Replay:
    """Submit ``run.pods`` one at a time to ``policy`` (§3, §4.1), checking each placement on the
    harness's own cluster; a ``PlacementError`` from a policy's invalid placement propagates."""
    cluster = Cluster(nodes)
    events: list[tuple[int, int]] = []
    placements: list[tuple[int | None, GpuAssignment]] = []
    seconds: list[float] = []
    arrived = allocated = 0
    for pod in run.pods:
        arrived += pod.demand
        start = time.perf_counter()
        choice = policy.place(pod)
        seconds.append(time.perf_counter() - start)
        if choice is None:
            placements.append((None, ()))
        else:
            node, gpus = int(choice[0]), tuple((int(gpu), int(milli)) for gpu, milli in choice[1])
            cluster.apply(pod, node, gpus)
            allocated += sum(milli for _, milli in gpus)
            policy.placed(pod, node, gpus)
            placements.append((node, gpus))
        events.append((arrived, allocated))
    total_gpus = sum(node.gpus for node in nodes)
    return Replay(policy.name, total_gpus, events, placements, seconds)


# --- metrics ------------------------------------------------------------------------------------------------


def bin_allocation(events: Iterable[tuple[int, int]], total_gpus: int) -> dict[int, float | None]:
    """The published allocation columns 0..130 from (arrived, allocated) milli events (§4.2).

    arrive% = round(A / 10N), alloc% = round(U / 10N, 2) (Python ``round``). Bin x is round(mean, 2)
    of the alloc% of the events with arrive% == x; if none, of those with |arrive% - x| <= 1 (in event
    order); if still none, None (a blank cell).
    """
    if total_gpus <= 0:
        raise ValueError(f"total_gpus: {total_gpus}, expected a positive GPU count")
    scale = 10 * total_gpus
    by_bin: dict[int, list[float]] = {}
    for arrived, allocated in events:
        by_bin.setdefault(round(arrived / scale), []).append(round(allocated / scale, 2))
    values: dict[int, float | None] = {}
    for x in BINS:
        chosen = by_bin.get(x) or [value for near in (x - 1, x, x + 1) for value in by_bin.get(near, ())]
        values[x] = round(sum(chosen) / len(chosen), 2) if chosen else None
    return values


def columns(events: Iterable[tuple[int, int]], total_gpus: int) -> tuple[float | None, float | None]:
    """The two figures the paper reports: the allocation bins at 100% and 130% arrived demand."""
    bins = bin_allocation(events, total_gpus)
    return bins[100], bins[130]


# --- the placements file ---------------------------------------------------------------------------------


def write_placements(
    target: PathLike | IO[str],
    seed: int,
    run: Run,
    result: Replay,
    nodes: Sequence[TraceNode],
    *,
    header: bool = True,
) -> None:
    """One CSV row ``seed,index,name,node,gpus`` per submitted pod, in submission order.

    ``name`` is the trace's name (a copy's is its original's; ``index`` tells them apart), ``node`` the
    node's name (empty: failed), ``gpus`` ``gpu:milli`` items joined by ";" (empty: CPU-only or failed).
    A path is written anew; to put several seeds in one open file, pass ``header=False`` after the first.
    """
    if len(result.placements) != len(run.pods):
        raise ValueError(f"the replay has {len(result.placements)} placements, the run {len(run.pods)} pods")

    def write(handle: IO[str]) -> None:
        writer = csv.writer(handle, lineterminator="\n")
        if header:
            writer.writerow(PLACEMENT_COLUMNS)
        for index, (node, gpus) in enumerate(result.placements):
            node_name = "" if node is None else nodes[node].name
            taken = ";".join(f"{gpu}:{milli}" for gpu, milli in gpus)
            writer.writerow((seed, index, run.trace_name(index), node_name, taken))

    if isinstance(target, str | os.PathLike):
        with open(target, "w", newline="", encoding="utf-8") as handle:
            write(handle)
    else:
        write(target)


def _parse_gpus(path: PathLike, line: int, text: str) -> GpuAssignment:
    gpus: list[tuple[int, int]] = []
    for item in text.split(";") if text else ():
        gpu, separator, milli = item.partition(":")
        if not separator:
            raise ValueError(f"{path}: line {line}: column 'gpus': {item!r} is not gpu:milli")
        gpus.append((_integer(path, line, "gpus", gpu), _integer(path, line, "gpus", milli)))
    return tuple(gpus)


def figures_from_placements(
    placements_csv: PathLike, nodes_csv: PathLike, pods_csv: PathLike
) -> dict[int, tuple[float | None, float | None]]:
    """Columns 100 and 130 per seed, from a placements file and the trace's two CSVs alone.

    Each seed's rows are replayed in index order on a fresh cluster: every placement is checked
    (``Cluster.apply``), arrived demand comes from the pod CSV by name, allocated from the GPUs taken.
    """
    nodes = load_nodes(nodes_csv)
    pods = {pod.name: pod for pod in load_pods(pods_csv)}
    node_index = {node.name: index for index, node in enumerate(nodes)}
    runs: dict[int, list[tuple[int, int, TracePod, int | None, GpuAssignment]]] = {}
    for line, row in _rows(placements_csv, PLACEMENT_COLUMNS, ()):
        if row["seed"] == "seed":
            continue  # the header of a file appended to another
        seed = _integer(placements_csv, line, "seed", row["seed"], minimum=None)
        index = _integer(placements_csv, line, "index", row["index"])
        pod = pods.get(row["name"])
        if pod is None:
            raise ValueError(
                f"{placements_csv}: line {line}: column 'name': {row['name']!r} is not in {pods_csv}"
            )
        node: int | None = None
        if row["node"]:
            if row["node"] not in node_index:
                raise ValueError(
                    f"{placements_csv}: line {line}: column 'node': {row['node']!r} is not in {nodes_csv}"
                )
            node = node_index[row["node"]]
        runs.setdefault(seed, []).append(
            (index, line, pod, node, _parse_gpus(placements_csv, line, row["gpus"]))
        )
    total_gpus = sum(node.gpus for node in nodes)
    figures: dict[int, tuple[float | None, float | None]] = {}
    for seed, rows in runs.items():
        rows.sort(key=lambda row: row[0])
        cluster = Cluster(nodes)
        events: list[tuple[int, int]] = []
        arrived = allocated = 0
        for position, (index, line, pod, node, gpus) in enumerate(rows):
            if index != position:
                raise ValueError(
                    f"{placements_csv}: line {line}: column 'index': seed {seed} has no row {position}"
                )
            arrived += pod.demand
            if node is not None:
                try:
                    cluster.apply(pod, node, gpus)
                except PlacementError as error:
                    raise ValueError(f"{placements_csv}: line {line}: {error}") from error
                allocated += sum(milli for _, milli in gpus)
            events.append((arrived, allocated))
        figures[seed] = columns(events, total_gpus)
    return figures


# --- FGD's typical pods ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TypicalPod:
    """One pod shape of the typical set (§5.6): ``count`` pods of the trace have it; ``weight`` is
    count / (pods of all kept shapes)."""

    cpu_milli: int
    num_gpu: int
    gpu_milli: int
    gpu_spec: tuple[str, ...]
    count: int
    weight: float


def typical_pods(pods: Sequence[TracePod], threshold: float = 0.95) -> list[TypicalPod]:
    """FGD's typical pods (§5.6): the pods grouped by (CPU, m, k, ``gpu_spec``), CPU-only ones included,
    most frequent first (ties: larger CPU, then m, k, spec), cut at the shortest prefix that covers at
    least ``threshold`` of the pods. Pass the trace's original pods, before shuffling and tuning."""
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold: {threshold} is not in (0, 1]")
    counts = Counter((pod.cpu_milli, pod.gpu_milli, pod.num_gpu, pod.gpu_spec) for pod in pods)
    ranked = sorted(
        counts.items(),
        key=lambda item: (item[1], item[0][0], item[0][1], item[0][2], "|".join(item[0][3])),
        reverse=True,
    )
    needed = Fraction(threshold).limit_denominator(1_000_000) * len(pods)  # 0.95 as exactly 19/20
    kept: list[tuple[tuple[int, int, int, tuple[str, ...]], int]] = []
    covered = 0
    for key, count in ranked:
        if covered >= needed:
            break
        kept.append((key, count))
        covered += count
    return [
        TypicalPod(cpu_milli=cpu, num_gpu=k, gpu_milli=m, gpu_spec=spec, count=count, weight=count / covered)
        for (cpu, m, k, spec), count in kept
    ]
