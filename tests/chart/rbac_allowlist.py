"""Every RBAC permission the chart grants, why, and which code needs it.

tests/chart/test_rbac.py checks three things against this list:
1. the rendered ClusterRoles/Roles grant exactly these (no wildcard, nothing more, nothing less);
2. every Kubernetes client call in a component's code is covered by a grant (nothing missing);
3. every granted verb is used by the code (nothing spare) — checked once the owning module makes
   API calls at all, so a grant for code not written yet is reported as skipped, not passed.

Synthetic subresources have no client method: ``resourceclaims/binding`` is authorized on the
status writes that change ``allocation``/``reservedFor`` (1.36+, DRAResourceClaimGranularStatusAuthorization),
``resourceclaims/driver`` with verbs ``associated-node:<verb>`` on writes of ``status.devices``
(status.devices: KEP-4817; the verbs: kubernetes PR #134947, constants in
``k8s.io/api/resource/v1/types.go``). Their "use" is the status write itself.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "AGENT_CODE",
    "ALLOCATION_GUARD",
    "CONTROLLER_CODE",
    "GRANTS",
    "KUEUE_ADMISSION_CHECK",
    "Grant",
    "IMPLIED_BY_STATUS_WRITE",
]


@dataclass(frozen=True, slots=True)
class Grant:
    role: str  # "agent" | "controller"
    scope: str  # "cluster" | "namespace" (the release namespace)
    group: str
    resource: str
    verbs: tuple[str, ...]
    why: str
    owner: tuple[str, ...]  # globs (repo-relative) of the code that needs it
    resource_names: tuple[str, ...] = ()


# The code each component runs (globs, repo-relative). The demo, the emulator and the kubelet
# simulator are test doubles and not deployed.
AGENT_CODE = (
    "driver/plugin/**/*.py",
    "driver/publisher.py",
    "driver/slices.py",
    "driver/inventory/**/*.py",
)
CONTROLLER_CODE = ("driver/controller/**/*.py",)
EXCLUDED_CODE = ("driver/plugin/proto_gen/**",)

_PUBLISHER = ("driver/publisher.py",)
_PLUGIN = ("driver/plugin/**/*.py",)

GRANTS: tuple[Grant, ...] = (
    # -- node agent ---------------------------------------------------------------------------
    Grant(
        "agent",
        "cluster",
        "resource.k8s.io",
        "resourceslices",
        ("list", "create", "update", "delete"),
        "the publisher keeps the node's pool equal to the inventory: lists its slices (periodic "
        "resync, no watch), creates, replaces with the resourceVersion (generation bumps), deletes "
        "obsolete ones with preconditions (driver/publisher.py, as upstream's resourceslice controller); the "
        "admission policy keeps it to its own node",
        _PUBLISHER,
    ),
    Grant(
        "agent",
        "cluster",
        "resource.k8s.io",
        "resourceclaims",
        ("get",),
        "NodePrepareResources carries only namespace/name/uid: the allocation is read from the claim "
        "(kubelet pkg/apis/dra/v1/api.proto)",
        _PLUGIN,
    ),
    Grant(
        "agent",
        "cluster",
        "resource.k8s.io",
        "resourceclaims/status",
        ("update", "patch"),
        "status.devices after prepare (KEP-4817); kept to our driver's entries of the "
        "agent's own pool by the next grant on 1.36+, by the agent-claim-status admission policy before",
        _PLUGIN,
    ),
    Grant(
        "agent",
        "cluster",
        "resource.k8s.io",
        "resourceclaims/driver",
        ("associated-node:update", "associated-node:patch"),
        "1.36+: status.devices writes need this synthetic subresource, only for our driver's "
        "entries on claims allocated to the agent's node",
        _PLUGIN,
        resource_names=("fractional.dev",),
    ),
    Grant(
        "agent",
        "cluster",
        "",
        "nodes",
        ("get",),
        "the Node owner reference of each ResourceSlice needs the node's UID (as upstream kubeletplugin's "
        "PublishResources); with --profile-node-label the agent also reads its Node's labels once at start "
        "(driver/plugin/agent.py); cluster-wide: resourceNames cannot differ per node and admission never "
        "sees reads (docs/install.md, Admission policies)",
        (*_PUBLISHER, "driver/plugin/agent.py"),
    ),
    Grant(
        "agent",
        "cluster",
        "",
        "events",
        ("create",),
        "one Event on the agent's Node (namespace default, as the kubelet's) when its GPUs are also handed "
        "out by NVIDIA's device plugin or another DRA driver, and one when that clears "
        "(driver/plugin/coexistence.py)",
        ("driver/plugin/coexistence.py",),
    ),
    # -- controller ---------------------------------------------------------------------------
    Grant(
        "controller",
        "cluster",
        "resource.k8s.io",
        "resourceslices",
        ("list", "watch"),
        "the allocator's inventory: list + watch of every slice (driver/controller/view/watch.py)",
        CONTROLLER_CODE,
    ),
    Grant(
        "controller",
        "cluster",
        "resource.k8s.io",
        "deviceclasses",
        ("list", "watch"),
        "claims name a DeviceClass whose selectors the allocator applies (driver/controller/view/watch.py)",
        CONTROLLER_CODE,
    ),
    Grant(
        "controller",
        "cluster",
        "resource.k8s.io",
        "resourceclaims",
        ("get", "list", "watch", "update"),
        "claims of gated pods; get re-reads before a write; update adds/removes the finalizer "
        "fractional.dev/allocation (driver/controller/writes/writer.py), and the controller-claims "
        "admission policy denies any other change",
        CONTROLLER_CODE,
    ),
    Grant(
        "controller",
        "cluster",
        "resource.k8s.io",
        "resourceclaims/status",
        ("update",),
        "writes status.allocation with the claim's resourceVersion (driver/controller/writes/writer.py); "
        "the controller-claims admission policy allows only setting or clearing it",
        CONTROLLER_CODE,
    ),
    Grant(
        "controller",
        "cluster",
        "resource.k8s.io",
        "resourceclaims/binding",
        ("update",),
        "1.36+: a status write that sets or clears allocation is also authorized here",
        CONTROLLER_CODE,
    ),
    Grant(
        "controller",
        "cluster",
        "",
        "pods",
        ("get", "list", "watch", "patch"),
        "gated pods: watch them, re-read, remove the scheduling gate with a merge patch carrying the "
        "resourceVersion, patch the scale-up-hint annotation (driver/controller/writes/writer.py); the "
        "controller-pods admission policy denies every other change to a pod",
        CONTROLLER_CODE,
    ),
    Grant(
        "controller",
        "cluster",
        "",
        "pods/eviction",
        ("create",),
        "priority preemption evicts the chosen lower-priority pods through the Eviction API, so the "
        "server enforces their PodDisruptionBudgets; a dry run first "
        "(driver/controller/preemption/preemptor.py); the controller-evictions policy keeps it out "
        "of the system namespaces and to the victim's UID",
        CONTROLLER_CODE,
    ),
    Grant(
        "controller",
        "cluster",
        "",
        "pods/status",
        ("patch",),
        "priority preemption, as kube-scheduler: the DisruptionTarget condition on each victim and "
        "status.nominatedNodeName on the preemptor's pods (driver/controller/preemption/preemptor.py); the "
        "controller-pod-status admission policy denies every other status change",
        CONTROLLER_CODE,
    ),
    Grant(
        "controller",
        "cluster",
        "policy",
        "poddisruptionbudgets",
        ("list",),
        "priority preemption avoids victims whose budgets allow no disruption, as kube-scheduler "
        "does (driver/controller/preemption/preemptor.py)",
        CONTROLLER_CODE,
    ),
    Grant(
        "controller",
        "cluster",
        "",
        "nodes",
        ("list", "watch"),
        "node allocatable and topology labels for the node-fit check (driver/controller/view/watch.py)",
        CONTROLLER_CODE,
    ),
    Grant(
        "controller",
        "cluster",
        "",
        "events",
        ("create", "patch"),
        "GangUnschedulable/AllocationFailed/ObjectRejected/DeviceOvercommitted Events as client-go "
        "series: a repeat patches count and lastTimestamp of the same Event "
        "(driver/controller/writes/events.py)",
        CONTROLLER_CODE,
    ),
    Grant(
        "controller",
        "namespace",
        "coordination.k8s.io",
        "leases",
        ("create",),
        "leader election creates its Lease once (driver/controller/loop/elector.py); create cannot be "
        "restricted by name",
        CONTROLLER_CODE,
    ),
    Grant(
        "controller",
        "namespace",
        "coordination.k8s.io",
        "leases",
        ("get", "update"),
        "leader election reads and renews its own Lease only (driver/controller/loop/elector.py)",
        CONTROLLER_CODE,
        resource_names=("fractional-dra-controller",),
    ),
)

_GUARD_ENDPOINT = ("driver/controller/guard/endpoint.py",)

# With controller.allocationGuard.enabled (the default).
ALLOCATION_GUARD: tuple[Grant, ...] = (
    Grant(
        "controller", "namespace", "discovery.k8s.io", "endpointslices", ("create",),
        "the leader points the allocation guard's Service (no selector) at itself with one EndpointSlice "
        "(driver/controller/guard/endpoint.py); create cannot be restricted by name",
        _GUARD_ENDPOINT,
    ),
    Grant(
        "controller", "namespace", "discovery.k8s.io", "endpointslices", ("get", "update", "delete"),
        "reads it when it takes over and every 30 s, rewrites it when it names another replica, and "
        "withdraws it (with the resourceVersion it wrote as precondition) when it stops cleanly",
        _GUARD_ENDPOINT,
        resource_names=("fractional-dra-controller-allocation-guard-leader",),
    ),
)  # fmt: skip
GRANTS = (*GRANTS, *ALLOCATION_GUARD)

GANG_OBJECTS: tuple[Grant, ...] = tuple(
    Grant(
        "controller",
        "cluster",
        group,
        resource,
        ("list", "watch"),
        f"gangs: {why}, watched at the version discovery finds (driver/controller/view/watch.py, "
        "driver/controller/gangs/api.py)",
        CONTROLLER_CODE,
    )
    for group, resource, why in (
        ("scheduling.k8s.io", "workloads", "a Workload's podGroups[].policy.gang.minCount (1.35)"),
        ("scheduling.k8s.io", "podgroups", "a PodGroup's minCount, topology and claims (1.36+)"),
        ("scheduling.x-k8s.io", "podgroups", "scheduler-plugins coscheduling's PodGroup minMember"),
        ("scheduling.volcano.sh", "podgroups", "Volcano's PodGroup minMember"),
    )
)
GRANTS = (*GRANTS, *GANG_OBJECTS)

# Only with controller.provisioningRequests.enabled=true.
PROVISIONING_REQUESTS: tuple[Grant, ...] = (
    Grant(
        "controller",
        "cluster",
        "autoscaling.x-k8s.io",
        "provisioningrequests",
        ("create", "delete", "list", "watch"),
        "--provisioning-requests: the requests of unschedulable gangs (an existing one, 409, stands: "
        "its spec is immutable), watched for the conditions cluster-autoscaler writes, deleted when one "
        "ended or the gang was placed (driver/controller/loop/provisioning.py)",
        CONTROLLER_CODE,
    ),
    Grant(
        "controller",
        "cluster",
        "",
        "podtemplates",
        ("create", "delete"),
        "the requests' podSets reference PodTemplates made from the gang's pods, deleted with their "
        "request (driver/controller/writes/events.py)",
        CONTROLLER_CODE,
    ),
)

# Only with controller.consolidation.enabled=true (docs/consolidation.md).
CONSOLIDATION: tuple[Grant, ...] = (
    Grant(
        "controller",
        "cluster",
        "",
        "namespaces",
        ("list",),
        "--consolidation: the namespaces whose label fractional.dev/movable=true opts their pods in "
        "(driver/controller/consolidation/consolidator.py)",
        ("driver/controller/consolidation/consolidator.py",),
    ),
    Grant(
        "controller",
        "cluster",
        "apps",
        "replicasets",
        ("get",),
        "--consolidation, make before break: the ReplicaSet of a pod with no spare replica, for its "
        "Deployment (driver/controller/consolidation/consolidator.py)",
        ("driver/controller/consolidation/consolidator.py",),
    ),
    Grant(
        "controller",
        "cluster",
        "apps",
        "deployments",
        ("get", "patch"),
        "--consolidation, make before break: read the Deployment's rolling update, then set the "
        "annotation fractional.dev/replaces on its pod template, nothing else (the controller-deployments "
        "policy) (driver/controller/consolidation/consolidator.py)",
        ("driver/controller/consolidation/consolidator.py",),
    ),
)

_KUEUE_CHECK = ("driver/controller/kueue/worker.py", "driver/controller/kueue/watch.py")

# Only with controller.kueueAdmissionCheck.enabled=true (docs/kueue.md).
KUEUE_ADMISSION_CHECK: tuple[Grant, ...] = (
    Grant(
        "controller", "cluster", "kueue.x-k8s.io", "workloads", ("list", "watch"),
        "the admission check reads Workloads whose check is Pending or Ready "
        "(driver/controller/kueue/worker.py, driver/controller/kueue/watch.py)",
        _KUEUE_CHECK,
    ),
    Grant(
        "controller", "cluster", "kueue.x-k8s.io", "workloads/status", ("update",),
        "writes its own status.admissionChecks entry with the Workload's resourceVersion",
        _KUEUE_CHECK,
    ),
    Grant(
        "controller", "cluster", "kueue.x-k8s.io", "admissionchecks", ("list",),
        "finds the AdmissionChecks whose spec.controllerName is fractional.dev/placement",
        _KUEUE_CHECK,
    ),
    Grant(
        "controller", "cluster", "kueue.x-k8s.io", "admissionchecks/status", ("update",),
        "sets Active=True on them, with the resourceVersion",
        _KUEUE_CHECK,
    ),
    Grant(
        "controller", "cluster", "resource.k8s.io", "resourceclaimtemplates", ("list",),
        "a Workload's pod sets name ResourceClaimTemplates: their claims are planned before pods exist",
        _KUEUE_CHECK,
    ),
)  # fmt: skip

# Synthetic subresource -> (role, the status subresource whose writes imply it, verb mapping).
IMPLIED_BY_STATUS_WRITE = {
    ("controller", "resourceclaims/binding"): lambda verb: verb,
    ("agent", "resourceclaims/driver"): lambda verb: f"associated-node:{verb}",
}
