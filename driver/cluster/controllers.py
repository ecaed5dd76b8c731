"""Stand-ins for the kube-controller-manager controllers the demo cluster needs (a TEST DOUBLE, like
the API emulator beside it; the product never imports this):

- namespace: a Terminating namespace loses its content, then its ``kubernetes`` finalizer;
- garbage collector: an object whose owners (``ownerReferences``, by UID) are all gone is deleted
  (background propagation, the kubectl default);
- resourceclaim: a pod's ``resourceClaimTemplateName`` becomes a ResourceClaim owned by the pod
  (``generateName: <pod>-<claim>-``, annotated ``resource.kubernetes.io/pod-claim-name``), named
  in ``pod.status.resourceClaimStatuses``;
- deployment and replicaset: Deployment -> ReplicaSet (``pod-template-hash``) -> Pods; a new
  template scales the old ReplicaSets to zero (Recreate-like: no surge arithmetic);
- job: Job -> Pods up to ``parallelism``, ``completions``, ``completionMode: Indexed`` (index
  annotation, label, hostname, ``JOB_COMPLETION_INDEX``), ``Complete``/``Failed`` conditions.

They are API clients, as the real ones are: one named thread reconciles every resource each
``interval_seconds`` from fresh lists (level-triggered, no informers), writing through the same
HTTP API kubectl uses. Rules follow upstream's ``pkg/controller/...``, cut to what a demo shows.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

from kubernetes import client

from driver.cluster.apiserver.store import ResourceType, new_timestamp
from driver.cluster.apiserver.strategy import RESOURCE_TYPES

__all__ = ["ControllerManager"]

log = logging.getLogger(__name__)

Obj = dict[str, Any]
_REQUEST_TIMEOUT_SECONDS = 10.0
_HASH_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
_POD_CLAIM_NAME = "resource.kubernetes.io/pod-claim-name"
_COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
_CLEANUP_EVERY = 5


class _ApiError(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"{status}: {body}")
        self.status = status


def _path(rtype: ResourceType, namespace: str | None = None, name: str | None = None) -> str:
    base = f"/apis/{rtype.group}/{rtype.version}" if rtype.group else f"/api/{rtype.version}"
    if namespace is not None and rtype.namespaced:
        base += f"/namespaces/{namespace}"
    base += f"/{rtype.plural}"
    return f"{base}/{name}" if name is not None else base


def _type(group: str, plural: str) -> ResourceType:
    return next(rtype for rtype in RESOURCE_TYPES if rtype.group == group and rtype.plural == plural)


_PODS, _NAMESPACES = _type("", "pods"), _type("", "namespaces")
_CLAIMS, _TEMPLATES = (
    _type("resource.k8s.io", "resourceclaims"),
    _type("resource.k8s.io", "resourceclaimtemplates"),
)
_DEPLOYMENTS, _REPLICA_SETS = _type("apps", "deployments"), _type("apps", "replicasets")
_JOBS = _type("batch", "jobs")
_POD_TEMPLATES = _type("", "podtemplates")
_PROVISIONING_REQUESTS = _type("autoscaling.x-k8s.io", "provisioningrequests")
# What the demo's owners own, and what the controller's ProvisioningRequests and their PodTemplates
# are owned by (a gang's pods: kube-controller-manager's garbage collector removes them with it).
_OWNED_KINDS = (_PODS, _CLAIMS, _REPLICA_SETS, _POD_TEMPLATES, _PROVISIONING_REQUESTS)


class _Api:
    """JSON in, JSON out, through the ``kubernetes`` client's transport (one explicit Configuration)."""

    def __init__(self, configuration: client.Configuration) -> None:
        self._client = client.ApiClient(configuration)

    def call(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Obj:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        method, url, headers, serialized, _post = self._client.param_serialize(
            method, path, header_params=headers, body=body, auth_settings=["BearerToken"]
        )
        response = self._client.call_api(
            method, url, header_params=headers, body=serialized, _request_timeout=_REQUEST_TIMEOUT_SECONDS
        )
        response.read()  # type: ignore[no-untyped-call]
        data = response.data or b""
        if not 200 <= response.status < 300:
            raise _ApiError(response.status, data.decode("utf-8", "replace"))
        decoded: Obj = json.loads(data) if data else {}
        return decoded

    def items(self, rtype: ResourceType, namespace: str | None = None) -> list[Obj]:
        return list(self.call("GET", _path(rtype, namespace)).get("items") or [])

    def delete(self, rtype: ResourceType, obj: Obj) -> None:
        metadata = obj["metadata"]
        try:
            self.call(
                "DELETE",
                _path(rtype, metadata.get("namespace"), metadata["name"]),
                {"kind": "DeleteOptions", "apiVersion": "v1", "preconditions": {"uid": metadata["uid"]}},
            )
        except _ApiError as error:
            if error.status not in (404, 409):  # gone already, or a new object under the same name
                raise

    def close(self) -> None:
        self._client.close()  # type: ignore[no-untyped-call]  # the client ships no hints


def _owner_reference(kind: str, api_version: str, owner: Obj) -> Obj:
    return {
        "apiVersion": api_version,
        "kind": kind,
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _controlled_by(obj: Obj, owner: Obj) -> bool:
    return any(
        ref.get("uid") == owner["metadata"]["uid"] and ref.get("controller")
        for ref in obj["metadata"].get("ownerReferences") or []
    )


def _active(pod: Obj) -> bool:
    return not pod["metadata"].get("deletionTimestamp") and (pod.get("status") or {}).get("phase") not in (
        "Succeeded",
        "Failed",
    )


def _ready(pod: Obj) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _template_hash(template: Obj) -> str:
    """A stable ``pod-template-hash`` label value (upstream hashes the template too; the spelling
    differs but only equality matters)."""
    digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).digest()
    return "".join(_HASH_ALPHABET[byte % len(_HASH_ALPHABET)] for byte in digest[:10])


def _index_ranges(indexes: list[int]) -> str:
    """``status.completedIndexes``: ``"0-2,4"``."""
    ranges: list[str] = []
    for index in sorted(set(indexes)):
        if ranges and ranges[-1].split("-")[-1] == str(index - 1):
            ranges[-1] = f"{ranges[-1].split('-')[0]}-{index}"
        else:
            ranges.append(str(index))
    return ",".join(ranges)


class ControllerManager:
    """The controller-manager stand-ins of the demo cluster: ``start()``, ``stop()``."""

    def __init__(self, configuration: client.Configuration, *, interval_seconds: float = 0.2) -> None:
        self._configuration = configuration
        self._interval_seconds = interval_seconds
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="controller-manager", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10.0)
            self._thread = None

    def __enter__(self) -> ControllerManager:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        api = _Api(self._configuration)
        try:
            tick = 0
            while not self._stop.wait(self._interval_seconds):
                tick += 1
                try:
                    # the cleanups (namespaces, garbage) every fifth round: they list every kind
                    self.sync_once(api, cleanup=tick % _CLEANUP_EVERY == 0)
                except Exception:  # one commented catch-all per loop: a stand-in logs and retries
                    log.warning("controller-manager sync failed", exc_info=True)
        finally:
            api.close()

    def sync_once(self, api: _Api, *, cleanup: bool = True) -> None:
        pods = api.items(_PODS)
        self._resource_claims(api, pods)
        self._deployments(api)
        self._replica_sets(api, pods)
        self._jobs(api, pods)
        if cleanup:
            self._namespaces(api)
            self._garbage_collect(api)

    # namespace -----------------------------------------------------------------------------------

    def _namespaces(self, api: _Api) -> None:
        for namespace in api.items(_NAMESPACES):
            if not namespace["metadata"].get("deletionTimestamp"):
                continue
            name = namespace["metadata"]["name"]
            remaining = 0
            for rtype in RESOURCE_TYPES:
                if not rtype.namespaced:
                    continue
                for obj in api.items(rtype, name):
                    remaining += 1
                    if not obj["metadata"].get("deletionTimestamp"):
                        api.delete(rtype, obj)
            finalizers = (namespace.get("spec") or {}).get("finalizers") or []
            if remaining == 0 and "kubernetes" in finalizers:
                spec = {
                    **(namespace.get("spec") or {}),
                    "finalizers": [f for f in finalizers if f != "kubernetes"],
                }
                api.call("PUT", _path(_NAMESPACES, None, name) + "/finalize", {**namespace, "spec": spec})

    # garbage collector ---------------------------------------------------------------------------

    def _garbage_collect(self, api: _Api) -> None:
        live = {
            obj["metadata"]["uid"]
            for rtype in (_PODS, _CLAIMS, _REPLICA_SETS, _DEPLOYMENTS, _JOBS)
            for obj in api.items(rtype)
            if not obj["metadata"].get("deletionTimestamp")
        }
        for rtype in _OWNED_KINDS:
            for obj in api.items(rtype):
                owners = obj["metadata"].get("ownerReferences") or []
                if (
                    owners
                    and not obj["metadata"].get("deletionTimestamp")
                    and not any(ref.get("uid") in live for ref in owners)
                ):
                    api.delete(rtype, obj)

    # resourceclaim -------------------------------------------------------------------------------

    def _resource_claims(self, api: _Api, pods: list[Obj]) -> None:
        for pod in pods:
            if pod["metadata"].get("deletionTimestamp"):
                continue
            statuses = {s.get("name") for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []}
            wanted = [
                ref
                for ref in (pod.get("spec") or {}).get("resourceClaims") or []
                if ref.get("resourceClaimTemplateName") and ref["name"] not in statuses
            ]
            if wanted:
                self._claims_for(api, pod, wanted)

    def _claims_for(self, api: _Api, pod: Obj, refs: list[Obj]) -> None:
        namespace, pod_name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        owned = {
            claim["metadata"].get("annotations", {}).get(_POD_CLAIM_NAME): claim["metadata"]["name"]
            for claim in api.items(_CLAIMS, namespace)
            if _controlled_by(claim, pod)
        }
        statuses = list((pod.get("status") or {}).get("resourceClaimStatuses") or [])
        for ref in refs:
            claim_name = owned.get(ref["name"])
            if claim_name is None:
                try:
                    template = api.call("GET", _path(_TEMPLATES, namespace, ref["resourceClaimTemplateName"]))
                except _ApiError as error:
                    if error.status == 404:
                        continue  # the real controller retries until the template exists
                    raise
                template_metadata = (template.get("spec") or {}).get("metadata") or {}
                claim = {
                    "apiVersion": "resource.k8s.io/v1",
                    "kind": "ResourceClaim",
                    "metadata": {
                        "generateName": f"{pod_name}-{ref['name']}-"[:57],
                        "labels": template_metadata.get("labels") or {},
                        "annotations": {
                            **(template_metadata.get("annotations") or {}),
                            _POD_CLAIM_NAME: ref["name"],
                        },
                        "ownerReferences": [_owner_reference("Pod", "v1", pod)],
                    },
                    "spec": (template.get("spec") or {}).get("spec") or {},
                }
                claim_name = api.call("POST", _path(_CLAIMS, namespace), claim)["metadata"]["name"]
            statuses.append({"name": ref["name"], "resourceClaimName": claim_name})
        if statuses != list((pod.get("status") or {}).get("resourceClaimStatuses") or []):
            api.call(
                "PATCH",
                _path(_PODS, namespace, pod_name) + "/status",
                {"status": {"resourceClaimStatuses": statuses}},
                "application/strategic-merge-patch+json",
            )

    # deployment and replicaset -------------------------------------------------------------------

    def _deployments(self, api: _Api) -> None:
        replica_sets = api.items(_REPLICA_SETS)
        for deployment in api.items(_DEPLOYMENTS):
            if deployment["metadata"].get("deletionTimestamp"):
                continue
            spec = deployment.get("spec") or {}
            namespace = deployment["metadata"]["namespace"]
            template = spec.get("template") or {}
            pod_hash = _template_hash(template)
            owned = [rs for rs in replica_sets if _controlled_by(rs, deployment)]
            current = next(
                (
                    rs
                    for rs in owned
                    if (rs["metadata"].get("labels") or {}).get("pod-template-hash") == pod_hash
                ),
                None,
            )
            replicas = int(spec.get("replicas", 1))
            if current is None:
                labels = {
                    **((template.get("metadata") or {}).get("labels") or {}),
                    "pod-template-hash": pod_hash,
                }
                selector = dict(spec.get("selector") or {})
                selector["matchLabels"] = {
                    **(selector.get("matchLabels") or {}),
                    "pod-template-hash": pod_hash,
                }
                rs: Obj = {
                    "apiVersion": "apps/v1",
                    "kind": "ReplicaSet",
                    "metadata": {
                        "name": f"{deployment['metadata']['name']}-{pod_hash}",
                        "labels": labels,
                        "ownerReferences": [_owner_reference("Deployment", "apps/v1", deployment)],
                    },
                    "spec": {
                        "replicas": replicas,
                        "selector": selector,
                        "template": {
                            **template,
                            "metadata": {**(template.get("metadata") or {}), "labels": labels},
                        },
                    },
                }
                current = api.call("POST", _path(_REPLICA_SETS, namespace), rs)
                owned.append(current)
            for rs in owned:
                want = replicas if rs is current else 0
                if int((rs.get("spec") or {}).get("replicas", 1)) != want:
                    api.call(
                        "PATCH",
                        _path(_REPLICA_SETS, namespace, rs["metadata"]["name"]),
                        {"spec": {"replicas": want}},
                        "application/merge-patch+json",
                    )
            counts = [rs.get("status") or {} for rs in owned]
            ready = sum(int(s.get("readyReplicas") or 0) for s in counts)
            status = {
                "observedGeneration": deployment["metadata"].get("generation", 1),
                "replicas": sum(int(s.get("replicas") or 0) for s in counts),
                "updatedReplicas": int((current.get("status") or {}).get("replicas") or 0),
                "readyReplicas": ready,
                "availableReplicas": ready,
                "unavailableReplicas": max(0, replicas - ready),
            }
            status = {key: value for key, value in status.items() if value or key == "observedGeneration"}
            available = "True" if ready >= replicas else "False"
            previous = deployment.get("status") or {}
            conditions = previous.get("conditions") or []
            if not conditions or conditions[0].get("status") != available:
                now = new_timestamp()
                conditions = [
                    {
                        "type": "Available",
                        "status": available,
                        "lastUpdateTime": now,
                        "lastTransitionTime": now,
                        "reason": "MinimumReplicasAvailable"
                        if available == "True"
                        else "MinimumReplicasUnavailable",
                        "message": "Deployment has minimum availability."
                        if available == "True"
                        else "Deployment does not have minimum availability.",
                    }
                ]
            status["conditions"] = conditions
            if status != previous:
                api.call(
                    "PUT",
                    _path(_DEPLOYMENTS, namespace, deployment["metadata"]["name"]) + "/status",
                    {**deployment, "status": status},
                )

    def _replica_sets(self, api: _Api, pods: list[Obj]) -> None:
        for rs in api.items(_REPLICA_SETS):
            if rs["metadata"].get("deletionTimestamp"):
                continue
            namespace, spec = rs["metadata"]["namespace"], rs.get("spec") or {}
            owned = [pod for pod in pods if _controlled_by(pod, rs) and _active(pod)]
            want = int(spec.get("replicas", 1))
            for _ in range(want - len(owned)):
                owned.append(
                    api.call("POST", _path(_PODS, namespace), self._pod_from(rs, "ReplicaSet", "apps/v1"))
                )
            for pod in sorted(owned, key=lambda p: p["metadata"].get("creationTimestamp", ""))[want:]:
                api.delete(_PODS, pod)
            ready = sum(1 for pod in owned[:want] if _ready(pod))
            status = {
                "replicas": min(len(owned), want),
                "fullyLabeledReplicas": min(len(owned), want),
                "readyReplicas": ready,
                "availableReplicas": ready,
                "observedGeneration": rs["metadata"].get("generation", 1),
            }
            status = {key: value for key, value in status.items() if value}
            if status != (rs.get("status") or {}):
                api.call(
                    "PUT",
                    _path(_REPLICA_SETS, namespace, rs["metadata"]["name"]) + "/status",
                    {**rs, "status": status},
                )

    @staticmethod
    def _pod_from(owner: Obj, kind: str, api_version: str, index: int | None = None) -> Obj:
        template = (owner.get("spec") or {}).get("template") or {}
        metadata = dict(template.get("metadata") or {})
        metadata.pop("name", None)
        name = owner["metadata"]["name"]
        metadata["generateName"] = f"{name}-" if index is None else f"{name}-{index}-"
        metadata["ownerReferences"] = [_owner_reference(kind, api_version, owner)]
        spec = dict(template.get("spec") or {})
        if index is not None:
            metadata["annotations"] = {**(metadata.get("annotations") or {}), _COMPLETION_INDEX: str(index)}
            metadata["labels"] = {**(metadata.get("labels") or {}), _COMPLETION_INDEX: str(index)}
            spec.setdefault("hostname", f"{name}-{index}")
            spec["containers"] = [
                {
                    **container,
                    "env": [
                        *(container.get("env") or []),
                        {
                            "name": "JOB_COMPLETION_INDEX",
                            "valueFrom": {
                                "fieldRef": {"fieldPath": f"metadata.annotations['{_COMPLETION_INDEX}']"}
                            },
                        },
                    ],
                }
                for container in spec.get("containers") or []
            ]
        return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}

    # job -----------------------------------------------------------------------------------------

    def _jobs(self, api: _Api, pods: list[Obj]) -> None:
        for job in api.items(_JOBS):
            if job["metadata"].get("deletionTimestamp"):
                continue
            self._sync_job(api, job, [pod for pod in pods if _controlled_by(pod, job)])

    def _sync_job(self, api: _Api, job: Obj, pods: list[Obj]) -> None:
        spec, previous = job.get("spec") or {}, job.get("status") or {}
        namespace = job["metadata"]["namespace"]
        conditions = previous.get("conditions") or []
        if any(c.get("type") in ("Complete", "Failed") and c.get("status") == "True" for c in conditions):
            return
        completions = spec.get("completions")
        parallelism = int(spec.get("parallelism", 1))
        indexed = spec.get("completionMode") == "Indexed"
        phases = [(pod.get("status") or {}).get("phase") for pod in pods]
        succeeded, failed = phases.count("Succeeded"), phases.count("Failed")
        active = [pod for pod in pods if _active(pod)]
        now = new_timestamp()
        status: Obj = {"startTime": previous.get("startTime") or now}

        def index_of(pod: Obj) -> int:
            return int((pod["metadata"].get("annotations") or {}).get(_COMPLETION_INDEX, "-1"))

        done_indexes = [index_of(p) for p in pods if (p.get("status") or {}).get("phase") == "Succeeded"]
        finished = succeeded >= completions if completions is not None else succeeded > 0 and not active
        if indexed and completions is not None:
            finished = len(set(done_indexes)) >= completions
            status["completedIndexes"] = _index_ranges(done_indexes)
        if failed > int(spec.get("backoffLimit", 6)):
            status["conditions"] = [
                *conditions,
                {
                    "type": "FailureTarget",
                    "status": "True",
                    "reason": "BackoffLimitExceeded",
                    "message": "Job has reached the specified backoff limit",
                    "lastProbeTime": now,
                    "lastTransitionTime": now,
                },
                {
                    "type": "Failed",
                    "status": "True",
                    "reason": "BackoffLimitExceeded",
                    "message": "Job has reached the specified backoff limit",
                    "lastProbeTime": now,
                    "lastTransitionTime": now,
                },
            ]
            for pod in active:
                api.delete(_PODS, pod)
            active = []
        elif finished:
            status["completionTime"] = now
            status["conditions"] = [
                *conditions,
                {
                    "type": "SuccessCriteriaMet",
                    "status": "True",
                    "reason": "CompletionsReached",
                    "message": "Reached expected number of succeeded pods",
                    "lastProbeTime": now,
                    "lastTransitionTime": now,
                },
                {
                    "type": "Complete",
                    "status": "True",
                    "reason": "CompletionsReached",
                    "message": "Reached expected number of succeeded pods",
                    "lastProbeTime": now,
                    "lastTransitionTime": now,
                },
            ]
        elif not spec.get("suspend"):
            remaining = (completions - succeeded) if completions is not None else parallelism
            for index in self._indexes_to_start(
                indexed, completions, pods, min(parallelism, remaining) - len(active)
            ):
                active.append(
                    api.call("POST", _path(_PODS, namespace), self._pod_from(job, "Job", "batch/v1", index))
                )
        status.update(
            {
                "active": len(active),
                "succeeded": succeeded,
                "failed": failed,
                "ready": sum(1 for pod in active if _ready(pod)),
            }
        )
        status = {key: value for key, value in status.items() if value not in (0, "", None) or key == "ready"}
        if status != previous:
            api.call(
                "PUT", _path(_JOBS, namespace, job["metadata"]["name"]) + "/status", {**job, "status": status}
            )

    @staticmethod
    def _indexes_to_start(
        indexed: bool, completions: int | None, pods: list[Obj], count: int
    ) -> Iterator[int | None]:
        if count <= 0:
            return
        if not indexed or completions is None:
            yield from (None for _ in range(count))
            return
        taken = {
            int((pod["metadata"].get("annotations") or {}).get(_COMPLETION_INDEX, "-1"))
            for pod in pods
            if _active(pod) or (pod.get("status") or {}).get("phase") == "Succeeded"
        }
        free = [index for index in range(completions) if index not in taken]
        yield from free[:count]
