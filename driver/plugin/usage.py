"""Which pod and container a GPU process belongs to: its cgroup, and the pods a claim is reserved for.

NVML reports the host PIDs of the processes running on a GPU. ``/proc/<pid>/cgroup`` names the
pod (its UID) and the container (the runtime's container ID) for cgroup v1 and v2 and for the
cgroupfs and systemd drivers::

    0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_with_underscores>.slice/cri-containerd-<id>.scope
    12:memory:/kubepods/besteffort/pod<uid>/<id>

A claim's ``status.reservedFor`` names the pods (name and UID) that use it; ``PodIndex`` keeps
them from every claim the agent reads (``RecordingClaimSource`` wraps the agent's claim reads), so
a process is mapped pod UID -> claim without another API call. The node agent reads ``/proc``
of the host: it needs the host's PID namespace (``hostPID``) or the host's ``/proc`` mounted and
``--proc-root`` pointing at it.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from driver.errors import FractionalError
from driver.plugin.checkpoint import PreparedClaim
from driver.plugin.claims import Claim, ClaimRef, ClaimUID
from driver.plugin.dra_service import ClaimSource

__all__ = [
    "ContainerIdentity",
    "PodIndex",
    "PodRef",
    "RecordingClaimSource",
    "learn_reserved_pods",
    "parse_cgroup",
    "parse_reserved_pods",
    "read_process_container",
]

log = logging.getLogger(__name__)

_POD_UID = re.compile(
    r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})(?:\.slice)?(?:/|$)"
)
_CONTAINER_PREFIXES = ("cri-containerd-", "crio-conmon-", "crio-", "docker-", "containerd-", "libpod-")


@dataclass(frozen=True, slots=True)
class ContainerIdentity:
    pod_uid: str
    container_id: str  # "" when the process sits in the pod's cgroup itself


@dataclass(frozen=True, slots=True)
class PodRef:
    namespace: str
    name: str
    uid: str


def parse_cgroup(text: str) -> ContainerIdentity | None:
    """The pod UID and container ID in a ``/proc/<pid>/cgroup`` file; None for a process outside
    any pod (the agent itself, a host process)."""
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        match = _POD_UID.search(path)
        if match is None:
            continue
        pod_uid = match.group(1).replace("_", "-")
        rest = path[match.end() :].strip("/")
        leaf = rest.split("/")[0] if rest else ""
        for prefix in _CONTAINER_PREFIXES:
            if leaf.startswith(prefix):
                leaf = leaf[len(prefix) :]
                break
        leaf = leaf.removesuffix(".scope")
        return ContainerIdentity(pod_uid=pod_uid, container_id=leaf)
    return None


def read_process_container(proc_root: str | Path, pid: int) -> ContainerIdentity | None:
    """``parse_cgroup`` of ``<proc_root>/<pid>/cgroup``; None when the process is gone or unreadable."""
    try:
        text = (Path(proc_root) / str(pid) / "cgroup").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    return parse_cgroup(text)


def parse_reserved_pods(claim_body: Mapping[str, Any]) -> tuple[PodRef, ...]:
    """The pods of ``status.reservedFor`` (core pods only), in API order."""
    namespace = str((claim_body.get("metadata") or {}).get("namespace") or "")
    pods = []
    for consumer in (claim_body.get("status") or {}).get("reservedFor") or ():
        if consumer.get("resource") == "pods" and not consumer.get("apiGroup"):
            pods.append(PodRef(namespace=namespace, name=str(consumer["name"]), uid=str(consumer["uid"])))
    return tuple(pods)


class PodIndex:
    """Claim UID -> the pods it is reserved for, as last read. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pods: dict[str, tuple[PodRef, ...]] = {}

    def remember(self, claim_uid: str, pods: Iterable[PodRef]) -> None:
        pods = tuple(pods)
        with self._lock:
            if pods:
                self._pods[claim_uid] = pods

    def forget_except(self, claim_uids: Iterable[str]) -> None:
        keep = set(claim_uids)
        with self._lock:
            for uid in [uid for uid in self._pods if uid not in keep]:
                del self._pods[uid]

    def pods_of(self, claim_uid: str) -> tuple[PodRef, ...]:
        with self._lock:
            return self._pods.get(claim_uid, ())


class RecordingClaimSource:
    """A ``ClaimSource`` that notes, for every claim read, the pods it is reserved for."""

    def __init__(self, inner: ClaimSource, index: PodIndex) -> None:
        self._inner = inner
        self._index = index

    def read(self, ref: ClaimRef) -> Claim:
        claim = self._inner.read(ref)
        self._index.remember(claim.uid, parse_reserved_pods(claim.body))
        return claim


def learn_reserved_pods(
    source: ClaimSource, prepared: Mapping[str, PreparedClaim], stop: threading.Event
) -> int:
    """After an agent restart the kubelet does not prepare running pods' claims again: read the
    claims the checkpoint holds through ``source`` (a ``RecordingClaimSource``) so that their
    shares' series name their pods again. A claim that cannot be read is skipped (logged)."""
    learned = 0
    for uid, entry in sorted(prepared.items()):
        if stop.is_set():
            break
        try:
            source.read(ClaimRef(namespace=entry.namespace, name=entry.name, uid=ClaimUID(uid)))
        except FractionalError as error:
            log.info("pods of a prepared claim not learned", extra={"claim_uid": uid, "reason": str(error)})
            continue
        learned += 1
    return learned
