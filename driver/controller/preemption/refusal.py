"""Pods whose share a node refused at prepare: replaced, so that their claims are allocated anew.

The node agent refuses a share that would take a GPU past its published capacity, or whose sharing
backend cannot join the GPU's shares (MPS mixes with nothing else), and records it on the claim: a
``status.devices`` entry of our driver with ``Ready=False``, reason ``ShareRefused`` (the agent's
``driver.plugin.status``). Our allocator never places such a share, but kube-scheduler (for pods
without our gate) can, and then the kubelet retries the prepare for ever: the pod sits in
ContainerCreating. A bound pod cannot move, so the way out is a new pod with a new allocation.

``decide_share_refused`` (pure) looks at the claim's reserving pods (``status.reservedFor``) that
are bound and not running yet, each once per pod UID:

- ``evict``: the pod has a controller (an ``ownerReferences`` entry with ``controller: true``:
  ReplicaSet, Job, StatefulSet, ...) and the claim is the pod's own (made from its template, owned
  by the pod): the pod is evicted through ``pods/eviction`` (budgets apply; the UID precondition
  the chart's admission policy requires), its controller re-creates it, the new pod's claim is new
  and the chart's admission policy gates it, so this controller allocates it;
- ``advise``: a Warning Event only, saying what was refused and what to do, when nobody would
  re-create the pod (no controller owner: delete it and create it again), when a replacement would
  get the same allocation (a claim named by ``resourceClaimName`` stays allocated while any pod
  reserves it: delete the pods that use it) or when the pod is in a system namespace (never evicted).

``RefusedShares`` wires it: ``decide`` runs on the decider (cache reads only), ``act`` is the
writer job: the eviction (fenced: a replica that lost its lease evicts nothing), then a Warning
Event ``ShareRefused`` on the pod through the job's ``EventRecorder`` (fenced too). An eviction a
budget refuses (429) or the server cannot serve is retried with backoff by the job's caller; a pod
already gone, or replaced under its name, is done; any other refusal turns into the advice.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from kubernetes import client

from driver import DRIVER_NAME
from driver.controller.model.decode import bounded
from driver.controller.model.objects import is_deleting, object_key
from driver.controller.view.cache import ClusterCache, Kind
from driver.controller.writes.events import REASON_SHARE_REFUSED
from driver.controller.writes.pipeline import Writers
from driver.controller.writes.writer import HaltWrites
from driver.errors import ConflictError, FractionalError, NotFoundError, TransientError
from driver.kube import REQUEST_TIMEOUT_SECONDS, api_errors, new_api_client

__all__ = [
    "SHARE_REFUSED_REASON",
    "RefusalAction",
    "RefusedPod",
    "RefusedShares",
    "ShareRefusal",
    "build_eviction",
    "decide_share_refused",
    "parse_share_refusals",
]

log = logging.getLogger(__name__)

SHARE_REFUSED_REASON = "ShareRefused"  # the node agent's condition reason (driver.plugin.status)
SYSTEM_NAMESPACES = frozenset({"kube-system", "kube-public", "kube-node-lease"})  # never evicted (chart)
MAX_PODS_REMEMBERED = 4096  # pod UIDs already replaced or advised
NOT_RUNNING_PHASES = frozenset({"", "Pending"})


class RefusalAction(StrEnum):
    EVICT = "evict"
    ADVISE = "advise"


@dataclass(frozen=True, slots=True)
class ShareRefusal:
    """One device of the claim a node refused: ``pool`` (the node) and ``device``, and its error."""

    pool: str
    device: str
    message: str


@dataclass(frozen=True, slots=True)
class RefusedPod:
    """What to do about one pod that reserves a refused claim: ``refused`` says what the node
    refused, ``advice`` what happens (or what to do); ``message`` is its Event's."""

    namespace: str
    name: str
    uid: str
    action: RefusalAction
    refused: str
    advice: str

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def message(self) -> str:
        return f"{self.refused}; {self.advice}"


def parse_share_refusals(claim: Mapping[str, Any], *, driver: str = DRIVER_NAME) -> tuple[ShareRefusal, ...]:
    """Pure: the claim's ``status.devices`` entries of ``driver`` whose ``Ready`` condition is
    ``False`` with reason ``ShareRefused``, one per device (several shares of one GPU say the same)."""
    found: dict[tuple[str, str], ShareRefusal] = {}
    for entry in (claim.get("status") or {}).get("devices") or ():
        if not isinstance(entry, Mapping) or entry.get("driver") != driver:
            continue
        for condition in entry.get("conditions") or ():
            if not isinstance(condition, Mapping) or condition.get("type") != "Ready":
                continue
            if condition.get("status") == "False" and condition.get("reason") == SHARE_REFUSED_REASON:
                key = (str(entry.get("pool") or ""), str(entry.get("device") or ""))
                found.setdefault(key, ShareRefusal(*key, message=str(condition.get("message") or "")))
    return tuple(found.values())


def _controller_owner(obj: Mapping[str, Any]) -> Mapping[str, Any] | None:
    for owner in (obj.get("metadata") or {}).get("ownerReferences") or ():
        if isinstance(owner, Mapping) and owner.get("controller") is True:
            return owner
    return None


def _describe(claim: Mapping[str, Any], refusals: Sequence[ShareRefusal]) -> str:
    nodes = ", ".join(sorted({r.pool for r in refusals}))
    errors = "; ".join(bounded(r.message, 400) for r in refusals)
    return f"node {nodes} refused to prepare ResourceClaim {object_key(dict(claim))}: {errors}"


def _choose(
    namespace: str, owner: Mapping[str, Any] | None, own_claim: bool, claim_key: str
) -> tuple[RefusalAction, str]:
    if namespace in SYSTEM_NAMESPACES:
        return RefusalAction.ADVISE, (
            f"pods in namespace {namespace} are not evicted: delete the pod so that it is created again "
            "and its claim allocated anew"
        )
    if owner is None:
        return RefusalAction.ADVISE, (
            "the pod has no controller to re-create it: delete it and create it again, so that its claim "
            "is allocated anew"
        )
    if not own_claim:
        return RefusalAction.ADVISE, (
            "the claim is not the pod's own (made from its template), so a new pod would get the same "
            f"allocation: delete the pods that use ResourceClaim {claim_key}; once none reserves it, it "
            "is allocated anew"
        )
    return RefusalAction.EVICT, (
        f"evicting the pod: its {owner.get('kind')} {owner.get('name')} re-creates it, and the new pod's "
        "claim is allocated anew"
    )


def decide_share_refused(
    claim: Mapping[str, Any], pods: Sequence[Mapping[str, Any]], *, done: Container[str] = ()
) -> tuple[RefusedPod, ...]:
    """Pure: what to do about each pod of ``pods`` that reserves ``claim`` (``status.reservedFor``,
    by UID) when the claim carries a share refusal: only pods bound to a node, not running yet, not
    being deleted and not in ``done`` (pod UIDs already dealt with). See the module doc."""
    refusals = parse_share_refusals(claim)
    status = claim.get("status") or {}
    if not refusals or not status.get("allocation"):
        return ()
    reserved = {
        str(entry.get("uid"))
        for entry in status.get("reservedFor") or ()
        if isinstance(entry, Mapping) and entry.get("resource") == "pods" and not entry.get("apiGroup")
    }
    claim_owner = _controller_owner(claim)  # a claim made from a pod's template is owned by that pod
    refused = _describe(claim, refusals)
    decided: list[RefusedPod] = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        uid = str(meta.get("uid") or "")
        if not uid or uid not in reserved or uid in done or is_deleting(dict(pod)):
            continue
        if not (pod.get("spec") or {}).get("nodeName"):
            continue  # not bound: nothing was prepared, the scheduler may still place it elsewhere
        if str((pod.get("status") or {}).get("phase") or "") not in NOT_RUNNING_PHASES:
            continue  # running (or done): its containers got their devices, whatever the status says
        namespace, name = str(meta.get("namespace") or ""), str(meta.get("name") or "")
        own_claim = claim_owner is not None and str(claim_owner.get("uid")) == uid
        action, advice = _choose(namespace, _controller_owner(pod), own_claim, str(object_key(dict(claim))))
        decided.append(RefusedPod(namespace, name, uid, action, refused, advice))
    return tuple(decided)


def build_eviction(namespace: str, name: str, uid: str, *, dry_run: bool = False) -> dict[str, Any]:
    """A policy/v1 Eviction of exactly that pod (the UID precondition; the chart's admission policy
    allows nothing else but ``dryRun``)."""
    body: dict[str, Any] = {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": name, "namespace": namespace},
        "deleteOptions": {"preconditions": {"uid": uid}},
    }
    if dry_run:
        body["deleteOptions"]["dryRun"] = ["All"]
    return body


@dataclass
class RefusedShares:
    """The decision on the decider, the effects on a writer thread (module doc). ``done`` holds the
    pod UIDs dealt with, least recent dropped first; it lives under its own lock."""

    cache: ClusterCache
    configuration: client.Configuration
    fence: threading.Event | None = None  # set once leadership is lost: nothing goes out
    evicted: int = 0
    advised: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._done: OrderedDict[str, None] = OrderedDict()

    def _is_done(self, uid: str) -> bool:
        with self._lock:
            return uid in self._done

    def _mark_done(self, uid: str) -> None:
        with self._lock:
            self._done[uid] = None
            while len(self._done) > MAX_PODS_REMEMBERED:
                self._done.popitem(last=False)

    # -- the decider (cache reads, no I/O) -------------------------------------------------------

    def decide(self, claim_key: str) -> tuple[RefusedPod, ...]:
        with self.cache.lock:
            claim = self.cache.get(Kind.CLAIM, claim_key)
            if claim is None:
                return ()
            namespace = claim["metadata"].get("namespace")
            pods = [
                pod
                for entry in (claim.get("status") or {}).get("reservedFor") or ()
                if isinstance(entry, Mapping)
                and (pod := self.cache.get(Kind.POD, f"{namespace}/{entry.get('name')}")) is not None
            ]
        with self._lock:
            done = frozenset(self._done)
        return decide_share_refused(claim, pods, done=done)

    # -- the job (a writer thread) ----------------------------------------------------------------

    def act(self, writers: Writers, decided: Sequence[RefusedPod]) -> None:
        """Evict or advise each pod; a ``TransientError`` of an eviction propagates (backoff)."""
        for pod in decided:
            if self._is_done(pod.uid):
                continue
            message = pod.message
            if pod.action is RefusalAction.EVICT:
                try:
                    self._evict(pod)
                except (NotFoundError, ConflictError):  # gone, or another pod under the name now
                    log.info("refused pod already gone", extra={"pod": pod.key})
                    self._mark_done(pod.uid)
                    continue
                except TransientError:
                    raise
                except FractionalError as error:  # refused by admission or validation: say so instead
                    message = (
                        f"{pod.refused}; the eviction was refused ({bounded(error)}): delete the pod so "
                        "that it is created again and its claim allocated anew"
                    )
                    log.warning("refused pod not evicted", extra={"pod": pod.key, "error": bounded(error)})
                else:
                    self.evicted += 1
                    log.info("pod evicted: its share was refused", extra={"pod": pod.key})
            else:
                self.advised += 1
                log.warning("pod's share refused, pod left in place", extra={"pod": pod.key})
            target = {"metadata": {"namespace": pod.namespace, "name": pod.name, "uid": pod.uid}}
            writers.recorder.object_warning(
                f"share-refused:{pod.uid}", target, kind="Pod", reason=REASON_SHARE_REFUSED, message=message
            )
            self._mark_done(pod.uid)

    def _evict(self, pod: RefusedPod) -> None:
        if self.fence is not None and self.fence.is_set():
            raise HaltWrites()
        body = build_eviction(pod.namespace, pod.name, pod.uid)
        with new_api_client(self.configuration) as api_client:
            core: Any = client.CoreV1Api(api_client)  # Any: raw JSON (_preload_content=False)
            with api_errors(f"evict Pod {pod.key}"):
                core.create_namespaced_pod_eviction(
                    pod.name, pod.namespace, body, _preload_content=False,
                    _request_timeout=REQUEST_TIMEOUT_SECONDS,
                )  # fmt: skip
