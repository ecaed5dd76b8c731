"""Defaulting of the embedded API emulator (a test double): the fields kube-apiserver fills in when
it decodes a written object (``pkg/apis/*/v1/defaults.go`` and the admission plugins that run by
default), so that what the emulator stores and answers is what the real server would."""

from __future__ import annotations

import copy
import re
import secrets
from typing import Any

from driver.allocator.quantity import Number, parse_quantity
from driver.cluster.apiserver.rules import default_claim
from driver.cluster.apiserver.store import ResourceType, new_timestamp
from driver.cluster.apiserver.webhook_rules import default_webhook_configuration

__all__ = ["apply_defaults", "default_pod_spec", "initial_pod_status", "pod_qos_class"]

Obj = dict[str, Any]


def apply_defaults(rtype: ResourceType, obj: Obj) -> Obj:
    """``obj`` (a new object, or the whole object of an update) with the kind's defaults filled in."""
    if not rtype.group and rtype.plural == "pods":
        obj = _default_pod(obj)
    elif not rtype.group and rtype.plural == "nodes":
        obj = _default_node(obj)
    elif not rtype.group and rtype.plural == "events":
        obj = _default_event(obj)
    elif rtype.group == "resource.k8s.io" and rtype.plural in ("resourceclaims", "resourceclaimtemplates"):
        obj = default_claim(rtype.plural, obj)
    elif rtype.group == "admissionregistration.k8s.io" and rtype.plural == "validatingwebhookconfigurations":
        obj = default_webhook_configuration(obj)
    return obj


# -- pods (pkg/apis/core/v1/defaults.go, the ServiceAccount and DefaultTolerationSeconds admission) --

_IMAGE_NAME = (
    r"(?:(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])(?:\.(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*"
    r"[a-zA-Z0-9]))*(?::[0-9]+)?/)?[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
)
_IMAGE_REFERENCE = re.compile(
    rf"^({_IMAGE_NAME})(?::([\w][\w.-]{{0,127}}))?(?:@([A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{{32,}}))?$"
)
TOKEN_MOUNT_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"
TOKEN_VOLUME_PREFIX = "kube-api-access-"
_NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # the apiserver's utilrand alphabet
_DEFAULT_TOLERATIONS = (
    {
        "key": "node.kubernetes.io/not-ready",
        "operator": "Exists",
        "effect": "NoExecute",
        "tolerationSeconds": 300,
    },
    {
        "key": "node.kubernetes.io/unreachable",
        "operator": "Exists",
        "effect": "NoExecute",
        "tolerationSeconds": 300,
    },
)
_QOS_RESOURCES = ("cpu", "memory")
SCHEDULING_GATED = {
    "type": "PodScheduled",
    "status": "False",
    "reason": "SchedulingGated",
    "message": "Scheduling is blocked due to non-empty scheduling gates",
}


def _pull_policy(image: Any) -> str:
    """``SetDefaults_Container``: Always for ``:latest`` (or no tag and no digest), else IfNotPresent;
    an image that does not parse (``parsers.ParseImageName`` fails) gets IfNotPresent."""
    match = _IMAGE_REFERENCE.match(image) if isinstance(image, str) else None
    if match is None:
        return "IfNotPresent"
    tag, digest = match.group(2), match.group(3)
    return "Always" if (tag or ("" if digest else "latest")) == "latest" else "IfNotPresent"


def _default_probe(probe: Any) -> None:
    if not isinstance(probe, dict):
        return
    for key, value in (
        ("timeoutSeconds", 1),
        ("periodSeconds", 10),
        ("successThreshold", 1),
        ("failureThreshold", 3),
    ):
        probe.setdefault(key, value)
    _default_handler(probe)


def _default_handler(handler: Any) -> None:
    if isinstance(handler, dict) and isinstance(handler.get("httpGet"), dict):
        handler["httpGet"].setdefault("path", "/")
        handler["httpGet"].setdefault("scheme", "HTTP")


def _default_field_ref(source: Any) -> None:
    if isinstance(source, dict) and isinstance(source.get("fieldRef"), dict):
        source["fieldRef"].setdefault("apiVersion", "v1")


def _default_container(container: Obj, *, host_network: bool, pod_level: bool) -> None:
    """``SetDefaults_Container`` and the defaults of what a container holds; ``pod_level``: requests
    default to limits (``SetDefaults_Pod``, not for templates)."""
    if not container.get("imagePullPolicy"):
        container["imagePullPolicy"] = _pull_policy(container.get("image"))
    if not container.get("terminationMessagePath"):
        container["terminationMessagePath"] = "/dev/termination-log"
    if not container.get("terminationMessagePolicy"):
        container["terminationMessagePolicy"] = "File"
    resources = container.get("resources")
    if not isinstance(resources, dict):
        resources = container["resources"] = {}
    limits = resources.get("limits")
    if pod_level and isinstance(limits, dict) and limits:
        resources["requests"] = {**limits, **_dict(resources.get("requests"))}
    for port in container.get("ports") or []:
        if isinstance(port, dict):
            port.setdefault("protocol", "TCP")
            if host_network and not port.get("hostPort") and "containerPort" in port:
                port["hostPort"] = port["containerPort"]
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        _default_probe(container.get(probe))
    lifecycle = container.get("lifecycle")
    if isinstance(lifecycle, dict):
        for hook in ("postStart", "preStop"):
            _default_handler(lifecycle.get(hook))
    for env in container.get("env") or []:
        if isinstance(env, dict):
            _default_field_ref(env.get("valueFrom"))


_VOLUME_SOURCES = frozenset({
    "hostPath", "emptyDir", "gcePersistentDisk", "awsElasticBlockStore", "gitRepo", "secret", "nfs", "iscsi",
    "glusterfs", "persistentVolumeClaim", "rbd", "flexVolume", "cinder", "cephfs", "flocker", "downwardAPI",
    "fc", "azureFile", "configMap", "vsphereVolume", "quobyte", "azureDisk", "photonPersistentDisk",
    "projected", "portworxVolume", "scaleIO", "storageos", "csi", "ephemeral", "image",
})  # fmt: skip


def _default_volume(volume: Obj) -> None:
    """``SetDefaults_Volume`` (no source is an emptyDir) and the sources' defaults."""
    if not any(volume.get(source) is not None for source in _VOLUME_SOURCES):
        volume["emptyDir"] = {}
    for source in ("secret", "configMap", "downwardAPI", "projected"):
        if isinstance(volume.get(source), dict):
            volume[source].setdefault("defaultMode", 420)
    if isinstance(volume.get("hostPath"), dict):
        volume["hostPath"].setdefault("type", "")
    for item in (volume.get("downwardAPI") or {}).get("items") or []:
        _default_field_ref(item)
    for projection in (volume.get("projected") or {}).get("sources") or []:
        if not isinstance(projection, dict):
            continue
        if isinstance(projection.get("serviceAccountToken"), dict):
            projection["serviceAccountToken"].setdefault("expirationSeconds", 3600)
        for item in (projection.get("downwardAPI") or {}).get("items") or []:
            _default_field_ref(item)


def default_pod_spec(spec: Obj, *, pod_level: bool = False) -> Obj:
    """``SetDefaults_PodSpec`` (and ``SetDefaults_Pod`` with ``pod_level``) on a copy of ``spec``."""
    spec = copy.deepcopy(spec)
    host_network = bool(spec.get("hostNetwork"))
    if not spec.get("dnsPolicy"):
        spec["dnsPolicy"] = "ClusterFirst"
    if not spec.get("restartPolicy"):
        spec["restartPolicy"] = "Always"
    if not isinstance(spec.get("securityContext"), dict):
        spec["securityContext"] = {}
    if spec.get("terminationGracePeriodSeconds") is None:
        spec["terminationGracePeriodSeconds"] = 30
    if not spec.get("schedulerName"):
        spec["schedulerName"] = "default-scheduler"
    if pod_level and spec.get("enableServiceLinks") is None:
        spec["enableServiceLinks"] = True
    for field in ("containers", "initContainers", "ephemeralContainers"):
        for container in spec.get(field) or []:
            if isinstance(container, dict):
                _default_container(container, host_network=host_network,
                                   pod_level=pod_level and field != "ephemeralContainers")  # fmt: skip
    for volume in spec.get("volumes") or []:
        if isinstance(volume, dict):
            _default_volume(volume)
    # the deprecated serviceAccount is an alias of serviceAccountName, and served as its copy
    if not spec.get("serviceAccountName") and spec.get("serviceAccount"):
        spec["serviceAccountName"] = spec["serviceAccount"]
    if spec.get("serviceAccountName"):
        spec["serviceAccount"] = spec["serviceAccountName"]
    return spec


def _admit_service_account(spec: Obj) -> None:
    """The ServiceAccount admission: the ``default`` account, and unless automounting is off, the
    projected API token volume mounted into every container that mounts nothing at its path."""
    if not spec.get("serviceAccountName"):
        spec["serviceAccountName"] = spec["serviceAccount"] = "default"
    if spec.get("automountServiceAccountToken") is False:
        return
    volumes = spec.get("volumes") or []
    existing = next(
        (v.get("name") for v in volumes if str(v.get("name", "")).startswith(TOKEN_VOLUME_PREFIX)), None
    )
    name = existing or TOKEN_VOLUME_PREFIX + "".join(secrets.choice(_NAME_ALPHABET) for _ in range(5))
    needed = False
    for field in ("initContainers", "containers"):
        for container in spec.get(field) or []:
            mounts = container.get("volumeMounts") or []
            if not any(mount.get("mountPath") == TOKEN_MOUNT_PATH for mount in mounts):
                container["volumeMounts"] = [
                    *mounts,
                    {"name": name, "readOnly": True, "mountPath": TOKEN_MOUNT_PATH},
                ]
                needed = True
    if needed and existing is None:
        spec["volumes"] = [*volumes, _token_volume(name)]


def _token_volume(name: str) -> Obj:
    return {
        "name": name,
        "projected": {
            "sources": [
                {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                {"downwardAPI": {"items": [{
                    "path": "namespace", "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"},
                }]}},
            ],
            "defaultMode": 420,
        },
    }  # fmt: skip


def _admit_toleration_seconds(spec: Obj) -> None:
    """The DefaultTolerationSeconds admission: 300 s on not-ready and unreachable nodes, unless the
    pod already tolerates the NoExecute taint (an empty key or effect tolerates every one)."""
    tolerations = list(spec.get("tolerations") or [])
    for default in _DEFAULT_TOLERATIONS:
        if not any(
            t.get("key", "") in (default["key"], "") and t.get("effect", "") in ("NoExecute", "")
            for t in tolerations
        ):
            tolerations.append(dict(default))
    spec["tolerations"] = tolerations


def _default_conditions(status: Any, times: tuple[str, ...]) -> None:
    """A condition's unset times are served as null (``metav1.Time`` is never omitted)."""
    if isinstance(status, dict):
        for condition in status.get("conditions") or []:
            if isinstance(condition, dict):
                for key in times:
                    condition.setdefault(key, None)


def _default_pod(pod: Obj) -> Obj:
    """A written pod as kube-apiserver completes it. The create-time admissions (ServiceAccount,
    DefaultTolerationSeconds) are applied on every write: they only fill what is missing, so an
    update of a pod that has them changes nothing."""
    spec = default_pod_spec(pod.get("spec") or {}, pod_level=True)
    _admit_service_account(spec)
    _admit_toleration_seconds(spec)
    pod = {**pod, "spec": spec}
    if isinstance(pod.get("status"), dict):
        pod["status"] = copy.deepcopy(pod["status"])
        _default_conditions(pod["status"], ("lastProbeTime", "lastTransitionTime"))
    return pod


def pod_qos_class(spec: Obj) -> str:
    """``qos.ComputePodQOS``: from the pod-level resources when set, else the containers' (cpu and
    memory only; a zero quantity counts as unset)."""
    requests: dict[str, Number] = {}
    limits: dict[str, Number] = {}
    guaranteed = True
    pod_level = isinstance(spec.get("resources"), dict)
    containers = [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]
    sources = [spec["resources"]] if pod_level else [(c or {}).get("resources") or {} for c in containers]
    for resources in sources:
        for name, text in (resources.get("requests") or {}).items():
            if name in _QOS_RESOURCES and (value := _quantity(text)) > 0:
                requests[name] = requests.get(name, 0) + value
        found = set()
        for name, text in (resources.get("limits") or {}).items():
            if name in _QOS_RESOURCES and (value := _quantity(text)) > 0:
                found.add(name)
                limits[name] = limits.get(name, 0) + value
        if found != set(_QOS_RESOURCES) and (not pod_level or resources.get("limits")):
            guaranteed = False
    if not requests and not limits:
        return "BestEffort"
    if guaranteed and len(requests) == len(limits) and all(limits.get(k) == v for k, v in requests.items()):
        return "Guaranteed"
    return "Burstable"


def _quantity(text: Any) -> Number:
    try:
        return parse_quantity(str(text))
    except ValueError:
        return 0


def initial_pod_status(pod: Obj) -> Obj:
    """The status the pod strategy's ``PrepareForCreate`` gives a new pod: Pending, its QoS class,
    and, while it has scheduling gates, the PodScheduled=False condition that says so."""
    spec = pod.get("spec") or {}
    status: Obj = {"phase": "Pending", "qosClass": pod_qos_class(spec)}
    if spec.get("schedulingGates"):
        status["conditions"] = [
            {**SCHEDULING_GATED, "lastProbeTime": None, "lastTransitionTime": new_timestamp()}
        ]
    return status


# -- nodes and events: the fields Go serves even when unset ---------------------------------------

_NODE_INFO = ("machineID", "systemUUID", "bootID", "kernelVersion", "osImage", "containerRuntimeVersion",
              "kubeletVersion", "kubeProxyVersion", "operatingSystem", "architecture")  # fmt: skip


def _default_node(node: Obj) -> Obj:
    """``SetDefaults_NodeStatus`` (allocatable defaults to capacity) and the structs Go never omits:
    ``spec``, ``status.daemonEndpoints``, ``status.nodeInfo``."""
    status = copy.deepcopy(_dict(node.get("status")))
    if status.get("allocatable") is None and status.get("capacity") is not None:
        status["allocatable"] = dict(status["capacity"])
    endpoints = _dict(status.get("daemonEndpoints"))
    status["daemonEndpoints"] = {
        **endpoints,
        "kubeletEndpoint": {"Port": 0, **_dict(endpoints.get("kubeletEndpoint"))},
    }
    status["nodeInfo"] = {**dict.fromkeys(_NODE_INFO, ""), **_dict(status.get("nodeInfo"))}
    _default_conditions(status, ("lastHeartbeatTime", "lastTransitionTime"))
    return {**node, "spec": _dict(node.get("spec")), "status": status}


def _dict(value: Any) -> Obj:
    return value if isinstance(value, dict) else {}


def _default_event(event: Obj) -> Obj:
    """A core/v1 Event as Go serves it: the times are null when unset, ``source`` and
    ``involvedObject`` are objects, the reporting fields are strings."""
    defaults: Obj = {"involvedObject": {}, "source": {}, "firstTimestamp": None, "lastTimestamp": None,
                     "eventTime": None, "reportingComponent": "", "reportingInstance": ""}  # fmt: skip
    event = dict(event)
    for key, value in defaults.items():
        if event.get(key) is None:
            event[key] = value
    return event
