"""The FGD paper's BestFit and FGD policies (Weng et al., ATC '23), for the trace replay of
bench/fgd_trace.py, following the FGD paper's method (§3, §5.5, §5.6).

Shared rules (§3). Only the feasible nodes are scored; the highest integer score wins and a tie goes
to the node with the smallest priority in ``run.node_order``. A pod that fits exactly one node goes
there unscored (FGD still chooses its GPU there by its score, as the simulator's Reserve step does).
Whole-GPU pods (m = 1000) take the lowest-indexed fully free GPUs. No trace has multi-GPU pods of less
than 1000 milli each; both policies would give them the k GPUs with the least free milli >= m.

BestFit (§5.5). With c the node's free CPU, g its total free GPU milli, and the pod's CPU r_c and GPU
demand r_g: s = (c - r_c) / 128000 x 0.5 + (g - r_g) / 8000 x 0.5 and score = trunc(100 (1 - s)),
computed with the simulator's float operations in its order so that the truncation matches. The
scheduler then rescales the scores min-max over the feasible nodes; on integers 0..100 that map is
strictly increasing, so the winner and its ties are unchanged and the rescale is skipped here. A
fractional pod takes the "best" GPU: the one with the least free milli still >= m (lowest index on
a tie).

FGD (§5.6). The node fragment F = sum over typical pods t of p_t x (free GPU milli that t could not
use on this node: all of it if t is CPU-only, if the node's model is not allowed to t, or if t does
not fit the node's CPU and GPUs; else only the GPUs with less than m_t free). A node scores
trunc(100 sigmoid((F before - F after) / 1000)). A fractional pod is tried on every GPU with free >= m
(its CPU taken too); the node scores the best of them and the pod takes the first GPU reaching that
best. Other pods: the after-state takes the CPU and, for GPU pods, m from the k GPUs with the least
free >= m. One departure, on purpose: F is summed exactly, as integers scaled by the typical pods'
total count (p_t = count_t / kept), where the simulator sums floats into per-kind buckets; the two
differ only when F before and after are equal in exact arithmetic, where the simulator's last-bit
noise can truncate a 50 to 49.

Speed: the per-node typical-pod terms (GPUs with free >= m_t, milli on GPUs with less, F) are cached
and recomputed only for the node a placement changed; a decision evaluates every candidate after-state
at once with numpy, and a node's GPUs of equal free milli are tried once (they score alike, and the
first of them is the one a tie would choose).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from bench.fgd_trace import (
    GPU_MILLI,
    Cluster,
    GpuAssignment,
    Placement,
    Policy,
    Run,
    TraceNode,
    TracePod,
    TypicalPod,
    typical_pods,
)

__all__ = ["POLICY_NAMES", "BestFitPolicy", "FGDPolicy", "best_gpus", "make_policy"]

POLICY_NAMES = ("best-fit", "fgd")

MAX_SPEC_CPU_MILLI = 128_000.0
"""BestFit's CPU normaliser: the largest node's CPU (128 cores)."""
MAX_SPEC_GPU_MILLI = 8_000.0
"""BestFit's GPU normaliser: the largest node's GPUs (8)."""

BoolArray = npt.NDArray[np.bool_]
IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


def make_policy(name: str, nodes: Sequence[TraceNode], run: Run) -> Policy:
    """A fresh policy for one replay of ``run``. It keeps its own ``Cluster`` of ``nodes``, which
    ``placed`` updates, so it never reads the harness's."""
    if name == "best-fit":
        return BestFitPolicy(nodes, run)
    if name == "fgd":
        return FGDPolicy(nodes, run)
    raise ValueError(f"policy {name!r}: not one of {', '.join(POLICY_NAMES)}")


def best_gpus(cluster: Cluster, pod: TracePod, node: int) -> GpuAssignment:
    """The "best" GPUs of ``node`` for ``pod`` (§3): the k GPUs with the least free milli still >= m,
    lowest index first on a tie; for a whole-GPU pod, the lowest-indexed fully free ones."""
    if pod.num_gpu == 0:
        return ()
    free = cluster.gpu_free[node, : cluster.gpu_count[node]].tolist()
    roomy = sorted((milli, gpu) for gpu, milli in enumerate(free) if milli >= pod.gpu_milli)
    if len(roomy) < pod.num_gpu:
        raise ValueError(f"pod {pod.name}: node {cluster.nodes[node].name} has {len(roomy)} GPUs it fits")
    return tuple(sorted((gpu, pod.gpu_milli) for _, gpu in roomy[: pod.num_gpu]))


def _priorities(run: Run, nodes: int) -> IntArray:
    priority = np.asarray(run.node_order, dtype=np.int64)
    if priority.shape != (nodes,):
        raise ValueError(f"run.node_order has {priority.size} entries for {nodes} nodes")
    return priority


def _first_by_priority(candidates: IntArray, scores: npt.NDArray[np.generic], priority: IntArray) -> int:
    """The candidate with the highest score, the smallest priority among those tied."""
    tied = candidates[scores == scores.max()]
    return int(tied[np.argmin(priority[tied])])


class BestFitPolicy:
    """BestFit (§5.5) with the "best" GPU choice."""

    name = "best-fit"

    def __init__(self, nodes: Sequence[TraceNode], run: Run) -> None:
        self._cluster = Cluster(nodes)
        self._priority = _priorities(run, len(nodes))

    def place(self, pod: TracePod) -> Placement | None:
        cluster = self._cluster
        feasible = np.flatnonzero(cluster.feasible(pod))
        if feasible.size == 0:
            return None
        if feasible.size == 1:
            node = int(feasible[0])
        else:
            # the simulator's float operations, in its order: 0 + cpu term + gpu term, then (1 - s) x 100
            cpu_left = (cluster.cpu_free[feasible] - pod.cpu_milli) / MAX_SPEC_CPU_MILLI * 0.5
            gpu_left = (cluster.gpu_free_total[feasible] - pod.demand) / MAX_SPEC_GPU_MILLI * 0.5
            scores = np.trunc((1.0 - (cpu_left + gpu_left)) * 100.0)
            node = _first_by_priority(feasible, scores, self._priority)
        return node, best_gpus(cluster, pod, node)

    def placed(self, pod: TracePod, node: int, gpus: GpuAssignment) -> None:
        self._cluster.apply(pod, node, gpus)


class FGDPolicy:
    """FGD (§5.6): the node whose fragment grows least, over the typical pods of the run's trace."""

    name = "fgd"

    def __init__(
        self, nodes: Sequence[TraceNode], run: Run, typical: Sequence[TypicalPod] | None = None
    ) -> None:
        self._cluster = cluster = Cluster(nodes)
        self._priority = _priorities(run, len(nodes))
        shapes = typical_pods(run.originals) if typical is None else list(typical)
        if not shapes:
            raise ValueError("FGD needs at least one typical pod")
        self.typical = tuple(shapes)
        self._shape_cpu = np.array([shape.cpu_milli for shape in shapes], dtype=np.int64)
        self._shape_milli = np.array([shape.gpu_milli for shape in shapes], dtype=np.int64)
        self._shape_gpus = np.array([shape.num_gpu for shape in shapes], dtype=np.int64)
        self._shape_count = np.array([shape.count for shape in shapes], dtype=np.int64)
        self._kept = int(self._shape_count.sum())
        # shapes that can be "satisfied" on a node: GPU shapes whose model the node has
        self._eligible: BoolArray = np.stack(
            [cluster.model_mask(shape.gpu_spec) & (shape.gpu_milli > 0) for shape in shapes], axis=1
        )
        # per node x shape: GPUs with free >= m_t, and milli on the GPUs with free < m_t
        self._roomy, self._small = self._gpu_terms(cluster.gpu_free, cluster.gpu_valid)
        # per node: F x kept (exact)
        self._fragment = self._fragments(
            cluster.cpu_free, cluster.gpu_free_total, self._roomy, self._small, self._eligible
        )
        # per node x GPU: the first GPU of the node with its free milli
        self._distinct = _first_of_value(cluster.gpu_free, cluster.gpu_valid)

    def fragment_milli(self) -> float:
        """The cluster's fragment (§4.3): the sum of F over the nodes, in GPU milli."""
        return float(self._fragment.sum()) / self._kept

    def place(self, pod: TracePod) -> Placement | None:
        cluster = self._cluster
        feasible = cluster.feasible(pod)
        if not feasible.any():
            return None
        if pod.fractional:
            node, gpu = self._place_fractional(pod, feasible)
            return node, ((gpu, pod.gpu_milli),)
        candidates = np.flatnonzero(feasible)
        if candidates.size == 1:
            node = int(candidates[0])
        else:
            node = _first_by_priority(candidates, self._whole_scores(pod, candidates), self._priority)
        return node, best_gpus(cluster, pod, node)

    def placed(self, pod: TracePod, node: int, gpus: GpuAssignment) -> None:
        cluster = self._cluster
        cluster.apply(pod, node, gpus)
        row = slice(node, node + 1)
        roomy, small = self._gpu_terms(cluster.gpu_free[row], cluster.gpu_valid[row])
        self._roomy[node], self._small[node] = roomy[0], small[0]
        self._fragment[node] = self._fragments(
            cluster.cpu_free[row], cluster.gpu_free_total[row], roomy, small, self._eligible[row]
        )[0]
        self._distinct[node] = _first_of_value(cluster.gpu_free[row], cluster.gpu_valid[row])[0]

    def _place_fractional(self, pod: TracePod, feasible: BoolArray) -> tuple[int, int]:
        """Every (node, GPU) after-state at once; the best node, then its first GPU reaching the best."""
        cluster, milli = self._cluster, pod.gpu_milli
        free = cluster.gpu_free
        node_of, gpu_of = np.nonzero(self._distinct & (free >= milli) & feasible[:, None])
        before = free[node_of, gpu_of][:, None]
        after = before - milli
        shape_milli = self._shape_milli
        roomy = self._roomy[node_of] - (before >= shape_milli) + (after >= shape_milli)
        small = (
            self._small[node_of]
            - np.where(before < shape_milli, before, 0)
            + np.where(after < shape_milli, after, 0)
        )
        scores = self._scores(
            node_of,
            cluster.cpu_free[node_of] - pod.cpu_milli,
            cluster.gpu_free_total[node_of] - milli,
            roomy,
            small,
        )
        by_gpu = np.full(free.shape, -1, dtype=scores.dtype)  # scores are >= 0; -1 marks no candidate
        by_gpu[node_of, gpu_of] = scores
        node_scores = by_gpu.max(axis=1)
        node = _first_by_priority(
            np.flatnonzero(node_scores >= 0), node_scores[node_scores >= 0], self._priority
        )
        return node, int(np.argmax(by_gpu[node]))

    def _whole_scores(self, pod: TracePod, candidates: IntArray) -> IntArray:
        """Scores of CPU-only and whole- or multi-GPU pods on ``candidates``: one after-state a node."""
        cluster = self._cluster
        cpu_after = cluster.cpu_free[candidates] - pod.cpu_milli
        roomy, small = self._roomy[candidates], self._small[candidates]
        total_after = cluster.gpu_free_total[candidates] - pod.demand
        if pod.num_gpu:
            milli, shape_milli = pod.gpu_milli, self._shape_milli
            free = cluster.gpu_free[candidates]
            order_key = np.where(cluster.gpu_valid[candidates] & (free >= milli), free, GPU_MILLI + 1)
            chosen = np.argsort(order_key, axis=1, kind="stable")[:, : pod.num_gpu]
            before = np.take_along_axis(free, chosen, axis=1)[:, :, None]
            after = before - milli
            roomy = roomy - (before >= shape_milli).sum(axis=1) + (after >= shape_milli).sum(axis=1)
            small = (
                small
                - np.where(before < shape_milli, before, 0).sum(axis=1)
                + np.where(after < shape_milli, after, 0).sum(axis=1)
            )
        return self._scores(candidates, cpu_after, total_after, roomy, small)

    def _scores(
        self, nodes: IntArray, cpu_after: IntArray, total_after: IntArray, roomy: IntArray, small: IntArray
    ) -> IntArray:
        """trunc(100 sigmoid(delta / 1000)) per after-state, delta = F before - F after in GPU milli."""
        after = self._fragments(cpu_after, total_after, roomy, small, self._eligible[nodes])
        delta = (self._fragment[nodes] - after) / self._kept
        return np.trunc(1.0 / (1.0 + np.exp(-delta / 1000.0)) * 100.0).astype(np.int64)

    def _gpu_terms(self, free: IntArray, valid: BoolArray) -> tuple[IntArray, IntArray]:
        """Per row x shape: GPUs with free >= m_t, and the milli on GPUs with free < m_t."""
        cube = free[:, :, None]
        roomy = ((cube >= self._shape_milli) & valid[:, :, None]).sum(axis=1)
        small = np.where(cube < self._shape_milli, cube, 0).sum(axis=1)  # padding slots hold 0
        return roomy.astype(np.int64), small.astype(np.int64)

    def _fragments(
        self, cpu: IntArray, total: IntArray, roomy: IntArray, small: IntArray, eligible: BoolArray
    ) -> IntArray:
        """F x kept per row: a satisfied shape leaves only its too-small GPUs, any other all free GPU."""
        satisfied = eligible & (roomy >= self._shape_gpus) & (cpu[:, None] >= self._shape_cpu)
        return np.where(satisfied, small, total[:, None]) @ self._shape_count


def _first_of_value(free: IntArray, valid: BoolArray) -> BoolArray:
    """Per row x GPU: valid, and no lower-indexed valid GPU of the row has the same free milli."""
    width = free.shape[1]
    same = free[:, :, None] == free[:, None, :]
    earlier = np.tri(width, width, -1, dtype=bool)  # [j, i]: i < j
    repeated: BoolArray = (same & earlier[None, :, :] & valid[:, None, :]).any(axis=2)
    return valid & ~repeated
