"""Table responses of the embedded API emulator (a test double): what kube-apiserver answers to
``Accept: application/json;as=Table;v=v1;g=meta.k8s.io`` (``kubectl get``), with the columns and
cells of upstream's printers (``pkg/printers/internalversion/printers.go``, rewritten here for the
kinds served). Like the server, every column is sent (``-o wide`` ones carry ``priority: 1``) and
kubectl picks. Kinds without a printer get the server's default columns (Name, Created At).

Column descriptions come from the same official schemas the OpenAPI documents use.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable
from typing import Any

from driver.cluster.apiserver.schema import schema_document
from driver.cluster.apiserver.store import ResourceType

__all__ = ["human_duration", "table_version", "to_table"]

Obj = dict[str, Any]
Column = tuple[str, str, int, str]  # name, type, priority, description
Printer = Callable[[Obj, datetime.datetime], list[Any]]

_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"


@functools.cache
def _definitions() -> dict[str, Obj]:
    definitions: dict[str, Obj] = schema_document("_definitions.json", strict=False)["$defs"]
    return definitions


def _doc(definition: str, field: str) -> str:
    properties = _definitions().get(definition, {}).get("properties", {})
    return str(properties.get(field, {}).get("description", ""))


def _name_column() -> Column:
    return ("Name", "string", 0, _doc(_META, "name"))


def _age_column() -> Column:
    return ("Age", "string", 0, _doc(_META, "creationTimestamp"))


def table_version(accept: str) -> str | None:
    """The ``meta.k8s.io`` version of the Table the client accepts, or None when it wants objects."""
    for part in accept.split(","):
        params = {
            key.strip(): value.strip()
            for key, _, value in (item.partition("=") for item in part.split(";")[1:])
        }
        if params.get("as") == "Table" and params.get("g", "meta.k8s.io") == "meta.k8s.io":
            return params.get("v", "v1")
    return None


def _parse_time(value: Any) -> datetime.datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def human_duration(seconds_total: float) -> str:
    """k8s.io/apimachinery's ``duration.HumanDuration``."""
    seconds = int(seconds_total)
    if seconds < -1:
        return "<invalid>"
    if seconds < 0:
        return "0s"
    if seconds < 60 * 2:
        return f"{seconds}s"
    minutes = seconds // 60
    if minutes < 10:
        rest = seconds % 60
        return f"{minutes}m" if rest == 0 else f"{minutes}m{rest}s"
    if minutes < 60 * 3:
        return f"{minutes}m"
    hours = seconds // 3600
    if hours < 8:
        rest = minutes % 60
        return f"{hours}h" if rest == 0 else f"{hours}h{rest}m"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        rest = hours % 24
        return f"{hours // 24}d" if rest == 0 else f"{hours // 24}d{rest}h"
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    if hours < 24 * 365 * 8:
        days = (hours // 24) % 365
        return f"{hours // 24 // 365}y" if days == 0 else f"{hours // 24 // 365}y{days}d"
    return f"{hours // 24 // 365}y"


def _since(value: Any, now: datetime.datetime) -> str:
    moment = _parse_time(value)
    if moment is None:
        return "<unknown>"
    return human_duration((now - moment).total_seconds())


def _age(obj: Obj, now: datetime.datetime) -> str:
    return _since(obj["metadata"].get("creationTimestamp"), now)


def _labels(selector: Any) -> str:
    if not isinstance(selector, dict) or not selector:
        return "<none>"
    return ",".join(f"{key}={value}" for key, value in sorted(selector.items()))


def _label_selector(selector: Any) -> str:
    """``metav1.FormatLabelSelector``: match labels, then expressions; ``<none>`` when empty."""
    if not isinstance(selector, dict):
        return "<none>"
    parts = [f"{key}={value}" for key, value in sorted((selector.get("matchLabels") or {}).items())]
    for expression in selector.get("matchExpressions") or []:
        operator = expression.get("operator", "")
        values = ",".join(expression.get("values") or [])
        key = expression.get("key", "")
        if operator == "In":
            parts.append(f"{key} in ({values})")
        elif operator == "NotIn":
            parts.append(f"{key} notin ({values})")
        elif operator == "Exists":
            parts.append(key)
        elif operator == "DoesNotExist":
            parts.append(f"!{key}")
    return ",".join(parts) or "<none>"


def _containers(template_spec: Any) -> tuple[str, str]:
    containers = (template_spec or {}).get("containers") or []
    return (
        ",".join(str(c.get("name", "")) for c in containers),
        ",".join(str(c.get("image", "")) for c in containers),
    )


# pods -------------------------------------------------------------------------------------------


def _pod_cells(pod: Obj, now: datetime.datetime) -> list[Any]:
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    phase = status.get("phase", "")
    reason = status.get("reason") or phase
    conditions = status.get("conditions") or []
    if any(c.get("type") == "PodScheduled" and c.get("reason") == "SchedulingGated" for c in conditions):
        reason = "SchedulingGated"
    total = len(spec.get("containers") or [])
    restartable = {
        c.get("name") for c in spec.get("initContainers") or [] if c.get("restartPolicy") == "Always"
    }
    total += len(restartable)
    ready = restarts = 0
    initializing = False
    for index, container in enumerate(status.get("initContainerStatuses") or []):
        restarts += int(container.get("restartCount") or 0)
        state = container.get("state") or {}
        terminated, waiting = state.get("terminated"), state.get("waiting")
        if terminated is not None and terminated.get("exitCode") == 0:
            continue
        if container.get("name") in restartable and container.get("started"):
            ready += 1 if container.get("ready") else 0
            continue
        if terminated is not None:
            reason = "Init:" + (terminated.get("reason") or f"ExitCode:{terminated.get('exitCode', 0)}")
        elif waiting is not None and waiting.get("reason") and waiting.get("reason") != "PodInitializing":
            reason = "Init:" + waiting["reason"]
        else:
            reason = f"Init:{index}/{len(spec.get('initContainers') or [])}"
        initializing = True
        break
    initialized = any(c.get("type") == "Initialized" and c.get("status") == "True" for c in conditions)
    if not initializing or initialized:
        restarts = 0
        has_running = False
        for container in reversed(status.get("containerStatuses") or []):
            restarts += int(container.get("restartCount") or 0)
            state = container.get("state") or {}
            waiting, terminated = state.get("waiting"), state.get("terminated")
            if waiting is not None and waiting.get("reason"):
                reason = waiting["reason"]
            elif terminated is not None and terminated.get("reason"):
                reason = terminated["reason"]
            elif terminated is not None:
                signal = terminated.get("signal")
                reason = f"Signal:{signal}" if signal else f"ExitCode:{terminated.get('exitCode', 0)}"
            elif container.get("ready") and state.get("running") is not None:
                has_running = True
                ready += 1
        if reason == "Completed" and has_running:
            pod_ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
            reason = "Running" if pod_ready else "NotReady"
    if pod["metadata"].get("deletionTimestamp") and phase not in ("Succeeded", "Failed"):
        reason = "Terminating"
    pod_ips = status.get("podIPs") or []
    gates = spec.get("readinessGates") or []
    readiness = "<none>"
    if gates:
        true_conditions = sum(
            1
            for gate in gates
            if any(
                c.get("type") == gate.get("conditionType") and c.get("status") == "True" for c in conditions
            )
        )
        readiness = f"{true_conditions}/{len(gates)}"
    return [
        pod["metadata"]["name"],
        f"{ready}/{total}",
        reason,
        str(restarts),
        _age(pod, now),
        (pod_ips[0].get("ip") if pod_ips else "") or "<none>",
        spec.get("nodeName") or "<none>",
        status.get("nominatedNodeName") or "<none>",
        readiness,
    ]


def _pod_conditions(pod: Obj) -> list[Obj] | None:
    phase = (pod.get("status") or {}).get("phase")
    if phase == "Succeeded":
        return [
            {
                "type": "Completed",
                "status": "True",
                "reason": "Succeeded",
                "message": "The pod has completed successfully.",
            }
        ]
    if phase == "Failed":
        return [{"type": "Completed", "status": "True", "reason": "Failed", "message": "The pod failed."}]
    return None


# other kinds ------------------------------------------------------------------------------------


def _node_cells(node: Obj, now: datetime.datetime) -> list[Any]:
    status = node.get("status") or {}
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    states = ["Unknown"] if ready is None else ["Ready" if ready.get("status") == "True" else "NotReady"]
    if (node.get("spec") or {}).get("unschedulable"):
        states.append("SchedulingDisabled")
    labels = node["metadata"].get("labels") or {}
    roles = sorted(
        {
            key.removeprefix("node-role.kubernetes.io/")
            for key in labels
            if key.startswith("node-role.kubernetes.io/")
        }
        | ({labels["kubernetes.io/role"]} if labels.get("kubernetes.io/role") else set())
    )
    roles = [role for role in roles if role]
    info = status.get("nodeInfo") or {}
    addresses = status.get("addresses") or []

    def address(kind: str) -> str:
        return next((a.get("address") for a in addresses if a.get("type") == kind), None) or "<none>"

    return [
        node["metadata"]["name"],
        ",".join(states),
        ",".join(roles) or "<none>",
        _age(node, now),
        info.get("kubeletVersion", ""),
        address("InternalIP"),
        address("ExternalIP"),
        info.get("osImage") or "<unknown>",
        info.get("kernelVersion") or "<unknown>",
        info.get("containerRuntimeVersion") or "<unknown>",
    ]


def _event_cells(event: Obj, now: datetime.datetime) -> list[Any]:
    involved = event.get("involvedObject") or {}
    first = event.get("firstTimestamp") or event.get("eventTime")
    last = event.get("lastTimestamp") or first
    series = event.get("series")
    if series is not None:  # a series counts and dates its own occurrences
        last = (series or {}).get("lastObservedTime")
        count = (series or {}).get("count") or 0
    else:
        count = event.get("count") or 0
    source = event.get("source") or {}
    component = source.get("component") or event.get("reportingComponent") or ""
    host = source.get("host") or event.get("reportingInstance") or ""
    origin = f"{component}, {host}" if host else component
    kind = str(involved.get("kind", "")).lower()
    return [
        _since(last, now),
        event.get("type", ""),
        event.get("reason", ""),
        f"{kind}/{involved['name']}" if involved.get("name") else kind,
        involved.get("fieldPath", ""),
        origin,
        str(event.get("message", "")).strip(),
        _since(first, now),
        int(count),
        event["metadata"]["name"],
    ]


def _job_status(job: Obj) -> str:
    status = job.get("status") or {}
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
    for kind, label in (
        ("Complete", "Complete"),
        ("Failed", "Failed"),
        ("FailureTarget", "FailureTarget"),
        ("SuccessCriteriaMet", "SuccessCriteriaMet"),
        ("Suspended", "Suspended"),
    ):
        if conditions.get(kind) == "True":
            return label
    if (job.get("metadata") or {}).get("deletionTimestamp"):
        return "Terminating"
    return "Running"


def _job_cells(job: Obj, now: datetime.datetime) -> list[Any]:
    spec, status = job.get("spec") or {}, job.get("status") or {}
    completions = spec.get("completions")
    parallelism = spec.get("parallelism", 1)
    succeeded = int(status.get("succeeded") or 0)
    if completions is not None:
        shown = f"{succeeded}/{completions}"
    elif parallelism is not None and parallelism > 1:
        shown = f"{succeeded}/1 of {parallelism}"
    else:
        shown = f"{succeeded}/1"
    start, end = _parse_time(status.get("startTime")), _parse_time(status.get("completionTime"))
    duration = "" if start is None else human_duration(((end or now) - start).total_seconds())
    names, images = _containers((spec.get("template") or {}).get("spec"))
    return [
        job["metadata"]["name"],
        _job_status(job),
        shown,
        duration,
        _age(job, now),
        names,
        images,
        _label_selector(spec.get("selector")),
    ]


def _deployment_cells(obj: Obj, now: datetime.datetime) -> list[Any]:
    spec, status = obj.get("spec") or {}, obj.get("status") or {}
    names, images = _containers((spec.get("template") or {}).get("spec"))
    return [
        obj["metadata"]["name"],
        f"{int(status.get('readyReplicas') or 0)}/{int(spec.get('replicas', 1))}",
        int(status.get("updatedReplicas") or 0),
        int(status.get("availableReplicas") or 0),
        _age(obj, now),
        names,
        images,
        _label_selector(spec.get("selector")),
    ]


def _replica_set_cells(obj: Obj, now: datetime.datetime) -> list[Any]:
    spec, status = obj.get("spec") or {}, obj.get("status") or {}
    names, images = _containers((spec.get("template") or {}).get("spec"))
    return [
        obj["metadata"]["name"],
        int(spec.get("replicas", 1)),
        int(status.get("replicas") or 0),
        int(status.get("readyReplicas") or 0),
        _age(obj, now),
        names,
        images,
        _label_selector(spec.get("selector")),
    ]


def _claim_state(claim: Obj) -> str:
    states = []
    deleting = bool(claim["metadata"].get("deletionTimestamp"))
    status = claim.get("status") or {}
    if deleting:
        states.append("deleted")
    if status.get("allocation") is None:
        if not deleting:
            states.append("pending")
    else:
        states.append("allocated")
        if status.get("reservedFor"):
            states.append("reserved")
    return ",".join(states)


def _simple(*fields: Callable[[Obj], Any]) -> Printer:
    def cells(obj: Obj, now: datetime.datetime) -> list[Any]:
        return [obj["metadata"]["name"], *(field(obj) for field in fields), _age(obj, now)]

    return cells


def _pod_template_cells(obj: Obj, now: datetime.datetime) -> list[Any]:
    template = obj.get("template") or {}
    names, images = _containers(template.get("spec"))
    return [obj["metadata"]["name"], names, images, _labels((template.get("metadata") or {}).get("labels"))]


def _columns() -> dict[str, tuple[list[Column], Printer]]:
    pod_spec, pod_status = "io.k8s.api.core.v1.PodSpec", "io.k8s.api.core.v1.PodStatus"
    event, node_info = "io.k8s.api.core.v1.Event", "io.k8s.api.core.v1.NodeSystemInfo"
    template = [
        ("Containers", "string", 1, "Names of each container in the template."),
        ("Images", "string", 1, "Images referenced by each container in the template."),
    ]
    return {
        "pods": (
            [
                _name_column(),
                ("Ready", "string", 0, "The aggregate readiness state of this pod for accepting traffic."),
                ("Status", "string", 0, "The aggregate status of the containers in this pod."),
                (
                    "Restarts",
                    "string",
                    0,
                    "The number of times the containers in this pod have been restarted and "
                    "when the last container in this pod has restarted.",
                ),
                _age_column(),
                ("IP", "string", 1, _doc(pod_status, "podIP")),
                ("Node", "string", 1, _doc(pod_spec, "nodeName")),
                ("Nominated Node", "string", 1, _doc(pod_status, "nominatedNodeName")),
                ("Readiness Gates", "string", 1, _doc(pod_spec, "readinessGates")),
            ],
            _pod_cells,
        ),
        "nodes": (
            [
                _name_column(),
                ("Status", "string", 0, "The status of the node"),
                ("Roles", "string", 0, "The roles of the node"),
                _age_column(),
                ("Version", "string", 0, _doc(node_info, "kubeletVersion")),
                ("Internal-IP", "string", 1, _doc("io.k8s.api.core.v1.NodeStatus", "addresses")),
                ("External-IP", "string", 1, _doc("io.k8s.api.core.v1.NodeStatus", "addresses")),
                ("OS-Image", "string", 1, _doc(node_info, "osImage")),
                ("Kernel-Version", "string", 1, _doc(node_info, "kernelVersion")),
                ("Container-Runtime", "string", 1, _doc(node_info, "containerRuntimeVersion")),
            ],
            _node_cells,
        ),
        "events": (
            [
                ("Last Seen", "string", 0, _doc(event, "lastTimestamp")),
                ("Type", "string", 0, _doc(event, "type")),
                ("Reason", "string", 0, _doc(event, "reason")),
                ("Object", "string", 0, _doc(event, "involvedObject")),
                ("Subobject", "string", 1, _doc("io.k8s.api.core.v1.ObjectReference", "fieldPath")),
                ("Source", "string", 1, _doc(event, "source")),
                ("Message", "string", 0, _doc(event, "message")),
                ("First Seen", "string", 1, _doc(event, "firstTimestamp")),
                ("Count", "string", 1, _doc(event, "count")),
                ("Name", "string", 1, _doc(_META, "name")),
            ],
            _event_cells,
        ),
        "namespaces": (
            [_name_column(), ("Status", "string", 0, "The status of the namespace"), _age_column()],
            _simple(lambda obj: (obj.get("status") or {}).get("phase", "")),
        ),
        "configmaps": (
            [
                _name_column(),
                ("Data", "string", 0, _doc("io.k8s.api.core.v1.ConfigMap", "data")),
                _age_column(),
            ],
            _simple(lambda obj: len(obj.get("data") or {}) + len(obj.get("binaryData") or {})),
        ),
        "podtemplates": (
            [
                _name_column(),
                ("Containers", "string", 0, template[0][3]),
                ("Images", "string", 0, template[1][3]),
                ("Pod Labels", "string", 0, "The labels for the pod template."),
            ],
            _pod_template_cells,
        ),
        "leases": (
            [
                _name_column(),
                ("Holder", "string", 0, _doc("io.k8s.api.coordination.v1.LeaseSpec", "holderIdentity")),
                _age_column(),
            ],
            _simple(lambda obj: (obj.get("spec") or {}).get("holderIdentity", "")),
        ),
        "deployments": (
            [
                _name_column(),
                ("Ready", "string", 0, "Number of the pod with ready state"),
                ("Up-to-date", "string", 0, _doc("io.k8s.api.apps.v1.DeploymentStatus", "updatedReplicas")),
                ("Available", "string", 0, _doc("io.k8s.api.apps.v1.DeploymentStatus", "availableReplicas")),
                _age_column(),
                *template,
                ("Selector", "string", 1, _doc("io.k8s.api.apps.v1.DeploymentSpec", "selector")),
            ],
            _deployment_cells,
        ),
        "replicasets": (
            [
                _name_column(),
                ("Desired", "integer", 0, _doc("io.k8s.api.apps.v1.ReplicaSetSpec", "replicas")),
                ("Current", "integer", 0, _doc("io.k8s.api.apps.v1.ReplicaSetStatus", "replicas")),
                ("Ready", "integer", 0, _doc("io.k8s.api.apps.v1.ReplicaSetStatus", "readyReplicas")),
                _age_column(),
                *template,
                ("Selector", "string", 1, _doc("io.k8s.api.apps.v1.ReplicaSetSpec", "selector")),
            ],
            _replica_set_cells,
        ),
        "jobs": (
            [
                _name_column(),
                ("Status", "string", 0, "Status of the job."),
                ("Completions", "string", 0, _doc("io.k8s.api.batch.v1.JobStatus", "succeeded")),
                ("Duration", "string", 0, "Time required to complete the job."),
                _age_column(),
                *template,
                ("Selector", "string", 1, _doc("io.k8s.api.batch.v1.JobSpec", "selector")),
            ],
            _job_cells,
        ),
        "validatingwebhookconfigurations": (
            [
                _name_column(),
                (
                    "Webhooks",
                    "integer",
                    0,
                    "Webhooks indicates the number of webhooks registered in this configuration",
                ),
                _age_column(),
            ],
            _simple(lambda obj: len(obj.get("webhooks") or [])),
        ),
        "deviceclasses": ([_name_column(), _age_column()], _simple()),
        "resourceclaimtemplates": ([_name_column(), _age_column()], _simple()),
        "resourceclaims": (
            [
                _name_column(),
                (
                    "State",
                    "string",
                    0,
                    "A summary of the current state (allocated, pending, reserved, etc.).",
                ),
                _age_column(),
            ],
            _simple(_claim_state),
        ),
        "resourceslices": (
            [
                _name_column(),
                ("Node", "string", 0, _doc("io.k8s.api.resource.v1.ResourceSliceSpec", "nodeName")),
                ("Driver", "string", 0, _doc("io.k8s.api.resource.v1.ResourceSliceSpec", "driver")),
                ("Pool", "string", 0, _doc("io.k8s.api.resource.v1.ResourcePool", "name")),
                _age_column(),
            ],
            _simple(
                lambda obj: (obj.get("spec") or {}).get("nodeName", ""),
                lambda obj: (obj.get("spec") or {}).get("driver", ""),
                lambda obj: ((obj.get("spec") or {}).get("pool") or {}).get("name", ""),
            ),
        ),
    }


_PRINTERS: dict[str, tuple[list[Column], Printer]] = {}


def _printer(rtype: ResourceType) -> tuple[list[Column], Printer]:
    if not _PRINTERS:
        _PRINTERS.update(_columns())
    custom = getattr(rtype, "table_printer", None)  # a kind a CustomResourceDefinition serves
    if custom is not None:
        printer: tuple[list[Column], Printer] = custom()
        return printer
    if (
        rtype.group
        in ("", "resource.k8s.io", "coordination.k8s.io", "apps", "batch", "admissionregistration.k8s.io")
        and rtype.plural in _PRINTERS
    ):
        return _PRINTERS[rtype.plural]
    if rtype.group == "events.k8s.io":
        return _PRINTERS["events"]
    if rtype.group.endswith(".x-k8s.io"):  # a custom resource: its CRD's default columns
        return [_name_column(), _age_column()], _simple()

    def default(obj: Obj, now: datetime.datetime) -> list[Any]:
        return [obj["metadata"]["name"], obj["metadata"].get("creationTimestamp", "")]

    return [_name_column(), ("Created At", "date", 0, _doc(_META, "creationTimestamp"))], default


def _events_v1_as_core(event: Obj) -> Obj:
    """An events.k8s.io/v1 Event in the core fields the event printer reads."""
    series = event.get("series") or {}
    return {
        **event,
        "involvedObject": event.get("regarding") or {},
        "message": event.get("note", ""),
        "source": {
            "component": event.get("reportingController", ""),
            "host": event.get("reportingInstance", ""),
        },
        "firstTimestamp": event.get("deprecatedFirstTimestamp") or event.get("eventTime"),
        "lastTimestamp": event.get("deprecatedLastTimestamp") or series.get("lastObservedTime"),
        "count": event.get("deprecatedCount") or series.get("count"),
    }


def to_table(
    rtype: ResourceType,
    objects: list[Obj],
    resource_version: str,
    *,
    version: str,
    include_object: str,
    now: datetime.datetime | None = None,
) -> Obj:
    """The Table of ``objects``; ``include_object`` is the request's ``includeObject`` (``None``,
    ``Metadata``, the default, or ``Object``)."""
    now = now or datetime.datetime.now(datetime.UTC)
    columns, cells = _printer(rtype)
    rows = []
    for obj in objects:
        printed = _events_v1_as_core(obj) if rtype.group == "events.k8s.io" else obj
        row: Obj = {"cells": cells(printed, now)}
        if rtype.plural == "pods" and (conditions := _pod_conditions(obj)):
            row["conditions"] = conditions
        if include_object == "Object":
            row["object"] = obj
        elif include_object != "None":
            row["object"] = {
                "kind": "PartialObjectMetadata",
                "apiVersion": f"meta.k8s.io/{version}",
                "metadata": obj["metadata"],
            }
        rows.append(row)
    return {
        "kind": "Table",
        "apiVersion": f"meta.k8s.io/{version}",
        "metadata": {"resourceVersion": resource_version},
        "columnDefinitions": [
            {
                "name": name,
                "type": kind,
                "format": "name" if name == "Name" else "",
                "description": description,
                "priority": priority,
            }
            for name, kind, priority, description in columns
        ],
        "rows": rows,
    }
