# ruff: noqa: E501  # one case per entry, each kept on its own lines as a table
"""The requests compared between the emulator and the real kube-apiserver (tests/cluster/test_differential.py).

Drawn from what the product, the demo and the tests send (the slices and classes our agent
publishes, the claims of the examples, the controller's gate removal, binding, status and apply
writes, kubectl's tables, discovery and OpenAPI reads), plus the validation rules the emulator
copies, one case per rule. Each case starts on an empty cluster: the four system namespaces and
the default service account, nothing else.
"""

from __future__ import annotations

import copy
from typing import Any

from driver.inventory.fake import load_profile, resolve_profile
from driver.slices import build_device_classes, build_resource_slices
from tests.differential.engine import Case, Step

R = "/apis/resource.k8s.io/v1"
CLAIMS = f"{R}/namespaces/default/resourceclaims"
TEMPLATES = f"{R}/namespaces/default/resourceclaimtemplates"
SLICES = f"{R}/resourceslices"
CLASSES = f"{R}/deviceclasses"
PODS = "/api/v1/namespaces/default/pods"
GATE = "fractional.dev/allocation"


def _product_slice() -> dict[str, Any]:
    (body,) = build_resource_slices(load_profile(resolve_profile("a100-pcie-4x"), node_name="node-1"))
    body = copy.deepcopy(body)
    body["metadata"].pop("ownerReferences", None)
    body["metadata"]["name"] = "node-1-fractional.dev"
    body["metadata"].pop("generateName", None)
    return body


SLICE = _product_slice()
GPU_CLASS, NIC_CLASS = build_device_classes()


def claim(name: str = "share", requests: list[dict[str, Any]] | None = None, **spec: Any) -> dict[str, Any]:
    exactly = {
        "deviceClassName": "gpu.fractional.dev",
        "capacity": {"requests": {"memory": "12Gi", "compute": "15"}},
    }
    devices: dict[str, Any] = {
        "requests": requests if requests is not None else [{"name": "gpu", "exactly": exactly}]
    }
    devices.update(spec)
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default"}, "spec": {"devices": devices}}  # fmt: skip


def request(name: str = "gpu", **exactly: Any) -> dict[str, Any]:
    return {"name": name, "exactly": {"deviceClassName": "gpu.fractional.dev", **exactly}}


def pod(name: str = "worker", *, gated: bool = True, automount: bool = False, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
        "spec": {"containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}], **spec},
    }  # fmt: skip
    if gated:
        body["spec"]["schedulingGates"] = [{"name": GATE}]
    if not automount:
        body["spec"]["automountServiceAccountToken"] = False
    return body


def allocation(device: str = "gpu-0", **result: Any) -> dict[str, Any]:
    entry = {"request": "gpu", "driver": "fractional.dev", "pool": "node-1", "device": device,
             "shareID": "6a1b4b7e-2a1c-4c43-9a35-1d8e3f0b6c11",
             "consumedCapacity": {"memory": "12Gi", "compute": "15"}, **result}  # fmt: skip
    return {"devices": {"results": [entry]},
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": ["node-1"]}]}]}}  # fmt: skip


def post(path: str, body: Any, **kwargs: Any) -> Step:
    return Step("POST", path, body, **kwargs)


def get(path: str, **kwargs: Any) -> Step:
    return Step("GET", path, **kwargs)


def setup(method: str, path: str, body: Any = None, **kwargs: Any) -> Step:
    return Step(method, path, body, compare=False, **kwargs)


def _claim_rule(name: str, rules: str, body: dict[str, Any]) -> Case:
    return Case(f"claim-{name}", (post(CLAIMS, body),), rules, ("claims", "validation"))


def _slice_rule(name: str, rules: str, mutate: Any) -> Case:
    body = copy.deepcopy(SLICE)
    mutate(body)
    return Case(f"slice-{name}", (post(SLICES, body),), rules, ("slices", "validation"))


def _first_gpu(body: dict[str, Any]) -> dict[str, Any]:
    device: dict[str, Any] = body["spec"]["devices"][0]
    return device


def _cases() -> list[Case]:
    cases: list[Case] = []
    add = cases.append
    ns = "/api/v1/namespaces"
    configmap = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "held", "finalizers": ["example.com/hold"]},
    }

    # -- namespaces --------------------------------------------------------------------------------
    add(Case("namespace-created-with-empty-spec", (
        post(ns, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team-a"}, "spec": {}}),
        get(f"{ns}/team-a"),
    ), "kubectl create namespace sends spec: {}; the kubernetes finalizer is added", ("namespaces",)))  # fmt: skip
    add(Case("namespace-deleted-is-terminating", (
        setup("POST", ns, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team-a"}}),
        setup("POST", f"{ns}/team-a/configmaps", configmap),
        Step("DELETE", f"{ns}/team-a"),
        get(f"{ns}/team-a"),
        post(f"{ns}/team-a/configmaps", {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "late"}}),
    ), "deletion makes the namespace Terminating while content remains; new content is refused",
        ("namespaces", "deletion")))  # fmt: skip
    add(Case("namespace-missing", (
        post(f"{ns}/nowhere/configmaps", {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}}),
    ), "NamespaceLifecycle: content of a namespace that does not exist", ("namespaces",)))  # fmt: skip
    add(Case("namespace-invalid-name", (
        post(ns, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "Team_A"}}),
    ), "a namespace name is a DNS label", ("namespaces", "validation")))  # fmt: skip
    add(Case("namespace-system-undeletable", (Step("DELETE", f"{ns}/kube-system"),),
             "the system namespaces cannot be deleted", ("namespaces",)))  # fmt: skip

    # -- claims: what users and the examples send ---------------------------------------------------
    add(Case("claim-share-created", (post(CLAIMS, claim()), get(f"{CLAIMS}/share")),
             "a share claim of the README", ("claims",)))  # fmt: skip
    add(_claim_rule("negative-memory", "a negative capacity request", claim(requests=[
        request(capacity={"requests": {"memory": "-4Gi"}})])))  # fmt: skip
    add(
        _claim_rule(
            "no-class", "exactly without deviceClassName", claim(requests=[{"name": "gpu", "exactly": {}}])
        )
    )
    add(_claim_rule("count-zero", "count must be positive", claim(requests=[request(count=0)])))
    add(_claim_rule("all-with-count", "allocationMode All takes no count",
                    claim(requests=[request(allocationMode="All", count=2)])))  # fmt: skip
    add(_claim_rule("exactly-and-first-available", "a request is exactly or firstAvailable", claim(requests=[{
        "name": "gpu", "exactly": {"deviceClassName": "gpu.fractional.dev"},
        "firstAvailable": [{"name": "a", "deviceClassName": "gpu.fractional.dev"}]}])))  # fmt: skip
    add(_claim_rule("bad-request-name", "a request name is a DNS label", claim(requests=[request("GPU_1")])))
    add(
        _claim_rule(
            "duplicate-request-names", "request names are unique", claim(requests=[request(), request()])
        )
    )
    add(_claim_rule("cel-syntax-error", "a selector must compile", claim(requests=[
        request(selectors=[{"cel": {"expression": "device.attributes['fractional.dev'].memory >"}}])])))  # fmt: skip
    add(_claim_rule("cel-not-bool", "a selector must be a bool", claim(requests=[
        request(selectors=[{"cel": {"expression": "device.driver"}}])])))  # fmt: skip
    add(_claim_rule("bad-quantity", "a capacity request is a quantity", claim(requests=[
        request(capacity={"requests": {"memory": "12 GiB"}})])))  # fmt: skip
    add(_claim_rule("constraint-unknown-request", "a constraint names requests of the claim", claim(
        constraints=[{"requests": ["nope"], "matchAttribute": "resource.kubernetes.io/pcieRoot"}])))  # fmt: skip
    add(_claim_rule("constraint-bad-attribute", "matchAttribute is a qualified name", claim(
        constraints=[{"matchAttribute": "not a name"}])))  # fmt: skip
    add(_claim_rule("config-unknown-request", "config names requests of the claim", claim(config=[{
        "requests": ["nope"], "opaque": {"driver": "fractional.dev", "parameters": {"sharing": "mps"}}}])))  # fmt: skip
    add(_claim_rule("config-bad-driver", "an opaque config's driver is a DNS subdomain", claim(config=[{
        "opaque": {"driver": "Fractional_Dev", "parameters": {}}}])))  # fmt: skip
    add(_claim_rule("tolerations-bad-operator", "a toleration's operator is Exists or Equal", claim(requests=[
        request(tolerations=[{"key": "fractional.dev/unhealthy", "operator": "Sometimes"}])])))  # fmt: skip
    add(_claim_rule("no-requests", "a claim may ask for nothing", claim(requests=[])))
    add(_claim_rule("name-too-long", "a claim name is a DNS subdomain", {**claim(), "metadata": {
        "name": "x" * 254, "namespace": "default"}}))  # fmt: skip
    add(Case("claim-generate-name", (post(CLAIMS, {**claim(), "metadata": {"generateName": "share-"}}),),
             "generateName gets a suffix", ("claims",)))  # fmt: skip
    add(Case("claim-reserved-finalizer", (post(CLAIMS, {**claim(), "metadata": {
        "name": "share", "finalizers": ["resource.kubernetes.io/delete-protection"]}}),),
        "the delete-protection finalizer is the claim controller's", ("claims", "finalizers")))  # fmt: skip
    add(Case("claim-spec-immutable", (
        setup("POST", CLAIMS, claim()),
        Step("PATCH", f"{CLAIMS}/share", {"spec": {"devices": {"requests": [request()]}}}, content="merge"),
    ), "a claim's spec cannot change", ("claims", "validation")))  # fmt: skip
    add(Case("claim-deleted-with-finalizer", (
        setup("POST", CLAIMS, {**claim(), "metadata": {"name": "share", "finalizers": ["fractional.dev/allocation"]}}),
        Step("DELETE", f"{CLAIMS}/share"),
        get(f"{CLAIMS}/share"),
        Step("PATCH", f"{CLAIMS}/share", {"metadata": {"finalizers": None}}, content="merge"),
        get(f"{CLAIMS}/share"),
    ), "a finalizer keeps a deleted claim until it is removed", ("claims", "finalizers", "deletion")))  # fmt: skip
    add(Case("claim-dry-run", (post(f"{CLAIMS}?dryRun=All", claim()), get(f"{CLAIMS}/share")),
             "a dry run stores nothing", ("claims", "dry-run")))  # fmt: skip
    add(Case("claim-unknown-field-strict", (
        post(f"{CLAIMS}?fieldValidation=Strict", {**claim(), "spec": {"devices": {"requests": [], "colour": "red"}}}),
    ), "kubectl's strict field validation", ("claims", "validation")))  # fmt: skip
    add(Case("claim-unknown-field-warn", (
        post(f"{CLAIMS}?fieldValidation=Warn", {**claim(), "spec": {"devices": {"requests": [], "colour": "red"}}}),
    ), "an unknown field warned about and dropped", ("claims", "validation")))  # fmt: skip
    add(Case("claim-stale-update", (
        setup("POST", CLAIMS, claim()),
        setup("PATCH", f"{CLAIMS}/share", {"metadata": {"labels": {"a": "b"}}}, content="merge"),
        Step("PUT", f"{CLAIMS}/share", {**claim(), "metadata": {"name": "share", "namespace": "default",
                                                                 "resourceVersion": "{rv:0}"}}),
    ), "optimistic concurrency: a stale resourceVersion is a conflict", ("claims", "conflicts")))  # fmt: skip
    add(Case("claim-missing", (get(f"{CLAIMS}/nope"), Step("DELETE", f"{CLAIMS}/nope")),
             "NotFound, as kubectl prints it", ("claims", "errors")))  # fmt: skip
    add(Case("claim-namespace-mismatch", (post(CLAIMS, {**claim(), "metadata": {"name": "s", "namespace": "other"}}),),
             "the body's namespace must match the path's", ("claims", "errors")))  # fmt: skip
    add(Case("claim-wrong-kind", (post(CLAIMS, {**claim(), "kind": "DeviceClass"}),),
             "a body of another kind", ("claims", "errors")))  # fmt: skip
    add(Case("claim-name-mismatch", (
        setup("POST", CLAIMS, claim()),
        Step("PUT", f"{CLAIMS}/share", claim("other")),
    ), "the body's name must match the path's", ("claims", "errors")))  # fmt: skip
    add(Case("claim-list-label-selector", (
        setup("POST", CLAIMS, {**claim("a"), "metadata": {"name": "a", "labels": {"team": "x"}}}),
        setup("POST", CLAIMS, {**claim("b"), "metadata": {"name": "b", "labels": {"team": "y"}}}),
        get(f"{CLAIMS}?labelSelector=team%3Dx"),
        get(f"{CLAIMS}?labelSelector=team%20in%20(x,y)"),
        get(f"{CLAIMS}?labelSelector=team%3D%3D"),
    ), "label selectors, and a malformed one", ("claims", "lists")))  # fmt: skip
    add(Case("claim-table", (setup("POST", CLAIMS, claim()), get(CLAIMS, accept="table")),
             "kubectl get resourceclaims", ("claims", "tables")))  # fmt: skip
    add(Case("claim-template", (
        post(TEMPLATES, {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                         "metadata": {"name": "share"}, "spec": {"spec": claim()["spec"]}}),
        post(TEMPLATES, {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                         "metadata": {"name": "bad"}, "spec": {"spec": claim(requests=[request(count=0)])["spec"]}}),
        get(TEMPLATES, accept="table"),
    ), "templates, valid and not", ("templates",)))  # fmt: skip

    # -- claim status: the allocation rules ---------------------------------------------------------
    status = f"{CLAIMS}/share/status"

    def with_status(body_status: dict[str, Any]) -> dict[str, Any]:
        return {**claim(), "metadata": {"name": "share", "namespace": "default", "resourceVersion": "{rv:0}"},
                "status": body_status}  # fmt: skip

    add(Case("claim-status-allocated", (
        setup("POST", CLAIMS, claim()),
        Step("PUT", status, with_status({"allocation": allocation()})),
    ), "the controller's allocation write", ("claims", "status")))  # fmt: skip
    add(Case("claim-status-reserved-without-allocation", (
        setup("POST", CLAIMS, claim()),
        Step("PUT", status, with_status({"reservedFor": [{"resource": "pods", "name": "w", "uid": "1"}]})),
    ), "reservedFor needs an allocation", ("claims", "status", "validation")))  # fmt: skip
    add(Case("claim-status-bad-driver", (
        setup("POST", CLAIMS, claim()),
        Step("PUT", status, with_status({"allocation": allocation(driver="Fractional_Dev")})),
    ), "a result's driver is a DNS subdomain", ("claims", "status", "validation")))  # fmt: skip
    add(Case("claim-status-unknown-request", (
        setup("POST", CLAIMS, claim()),
        Step("PUT", status, with_status({"allocation": allocation(request="other")})),
    ), "a result names a request of the claim", ("claims", "status", "validation")))  # fmt: skip
    add(Case("claim-status-allocation-immutable", (
        setup("POST", CLAIMS, claim()),
        setup("PUT", status, with_status({"allocation": allocation()})),
        Step("PUT", status, {**with_status({"allocation": allocation("gpu-1")}),
                             "metadata": {"name": "share", "namespace": "default"}}),
    ), "an allocation, once written, cannot change", ("claims", "status", "validation")))  # fmt: skip
    add(Case("claim-status-device-status", (
        setup("POST", CLAIMS, claim()),
        setup("PUT", status, with_status({"allocation": allocation()})),
        Step("PATCH", status, {"status": {"devices": [{"driver": "fractional.dev", "pool": "node-1", "device": "gpu-0",
                                                      "shareID": "6a1b4b7e-2a1c-4c43-9a35-1d8e3f0b6c11",
                                                      "conditions": [{"type": "Ready", "status": "True",
                                                                      "reason": "Prepared", "message": "",
                                                                      "lastTransitionTime": "2026-12-01T00:00:00Z"}]}]}},
             content="merge"),
    ), "the agent's device status on the claim", ("claims", "status")))  # fmt: skip
    add(Case("claim-status-device-status-unallocated", (
        setup("POST", CLAIMS, claim()),
        setup("PUT", status, with_status({"allocation": allocation()})),
        Step("PATCH", status, {"status": {"devices": [{"driver": "fractional.dev", "pool": "node-1", "device": "gpu-3"}]}},
             content="merge"),
    ), "device status only for allocated devices", ("claims", "status", "validation")))  # fmt: skip

    # -- slices: what our agent publishes, and the rules on them ------------------------------------
    add(Case("slice-product", (post(SLICES, SLICE), get(f"{SLICES}/node-1-fractional.dev")),
             "the agent's slice of an a100-pcie-4x node", ("slices",)))  # fmt: skip
    add(_slice_rule("missing-pool", "pool is required", lambda b: b["spec"].pop("pool")))
    add(_slice_rule("duplicate-devices", "device names are unique",
                    lambda b: b["spec"]["devices"].append(copy.deepcopy(b["spec"]["devices"][0]))))  # fmt: skip
    add(_slice_rule("policy-without-multiple-allocations", "requestPolicy needs allowMultipleAllocations",
                    lambda b: _first_gpu(b).pop("allowMultipleAllocations")))  # fmt: skip
    add(_slice_rule("policy-default-outside-range", "a policy's default lies within its range",
                    lambda b: _first_gpu(b)["capacity"]["compute"]["requestPolicy"].update(default="101")))  # fmt: skip
    add(_slice_rule("policy-default-off-step", "a policy's default is min + n*step",
                    lambda b: _first_gpu(b)["capacity"]["memory"]["requestPolicy"].update(default="300Mi")))  # fmt: skip
    add(_slice_rule("policy-min-above-value", "a range's min is at most the value",
                    lambda b: _first_gpu(b)["capacity"]["memory"]["requestPolicy"]["validRange"].update(min="80Gi")))  # fmt: skip
    add(_slice_rule("node-and-all-nodes", "exactly one of nodeName, nodeSelector, allNodes, perDeviceNodeSelection",
                    lambda b: b["spec"].update(allNodes=True)))  # fmt: skip
    add(_slice_rule("no-node", "one of nodeName, nodeSelector, allNodes, perDeviceNodeSelection is required",
                    lambda b: b["spec"].pop("nodeName")))  # fmt: skip
    add(_slice_rule("bad-attribute-name", "attribute names are C identifiers, optionally qualified",
                    lambda b: _first_gpu(b)["attributes"].update({"not valid": {"string": "x"}})))  # fmt: skip
    add(_slice_rule("attribute-two-values", "an attribute has exactly one value",
                    lambda b: _first_gpu(b)["attributes"].update(x={"string": "a", "int": 1})))  # fmt: skip
    add(_slice_rule("too-many-devices", "at most 128 devices in a slice",
                    lambda b: b["spec"].update(devices=[{**copy.deepcopy(_first_gpu(b)), "name": f"gpu-{i}"}
                                                        for i in range(129)])))  # fmt: skip
    add(
        _slice_rule(
            "bad-device-name", "a device name is a DNS label", lambda b: _first_gpu(b).update(name="GPU 0")
        )
    )
    add(_slice_rule("bad-taint-effect", "a device taint's effect is NoSchedule, NoExecute or None",
                    lambda b: _first_gpu(b).update(taints=[{"key": "fractional.dev/unhealthy", "effect": "Never"}])))  # fmt: skip
    add(Case("slice-pool-generation-update", (
        setup("POST", SLICES, SLICE),
        Step("PATCH", f"{SLICES}/node-1-fractional.dev", {"spec": {"pool": {"generation": 2}}}, content="merge"),
        Step("PATCH", f"{SLICES}/node-1-fractional.dev", {"spec": {"driver": "other.example.com"}}, content="merge"),
    ), "the publisher's generation bump; the driver is immutable", ("slices",)))  # fmt: skip
    add(Case("slice-field-selectors", (
        setup("POST", SLICES, SLICE),
        get(f"{SLICES}?fieldSelector=spec.nodeName%3Dnode-1"),
        get(f"{SLICES}?fieldSelector=spec.driver%3Dother.example.com"),
        get(f"{SLICES}?fieldSelector=spec.pool.name%3Dnode-1"),
    ), "the field selectors the agent and kubectl use", ("slices", "lists")))  # fmt: skip
    add(Case("slice-table", (setup("POST", SLICES, SLICE), get(SLICES, accept="table")),
             "kubectl get resourceslices", ("slices", "tables")))  # fmt: skip

    # -- device classes -----------------------------------------------------------------------------
    add(Case("class-product", (post(CLASSES, GPU_CLASS), post(CLASSES, NIC_CLASS), get(CLASSES, accept="table")),
             "the chart's DeviceClasses", ("classes",)))  # fmt: skip
    add(Case("class-cel-error", (post(CLASSES, {**GPU_CLASS, "spec": {"selectors": [
        {"cel": {"expression": "device.driver =="}}]}}),), "a class selector must compile", ("classes", "validation")))  # fmt: skip

    # -- pods: the controller's writes -------------------------------------------------------------
    claims = [{"name": "gpu", "resourceClaimName": "share"}]
    containers = [
        {"name": "main", "image": "registry.k8s.io/pause:3.10", "resources": {"claims": [{"name": "gpu"}]}}
    ]
    add(Case("pod-user-defaults", (post(PODS, pod(automount=True, resourceClaims=claims, containers=containers)),),
             "a user's pod with a claim, defaulted and admitted (service account token included)", ("pods",)))  # fmt: skip
    add(Case("pod-gate-removed", (
        setup("POST", PODS, pod()),
        Step("PATCH", f"{PODS}/worker", [{"op": "remove", "path": "/spec/schedulingGates"}], content="json-patch"),
    ), "the controller removes its gate", ("pods",)))  # fmt: skip
    add(Case("pod-gate-added-later", (
        setup("POST", PODS, pod(gated=False)),
        Step("PATCH", f"{PODS}/worker", {"spec": {"schedulingGates": [{"name": GATE}]}}, content="strategic"),
    ), "a gate cannot be added after creation", ("pods", "validation")))  # fmt: skip
    add(Case("pod-claims-immutable", (
        setup("POST", PODS, pod(resourceClaims=claims, containers=containers)),
        Step("PATCH", f"{PODS}/worker", {"spec": {"resourceClaims": [{"name": "gpu", "resourceClaimName": "other"}]}},
             content="strategic"),
    ), "a pod's resourceClaims cannot change", ("pods", "validation")))  # fmt: skip
    add(Case("pod-annotated", (
        setup("POST", PODS, pod()),
        Step("PATCH", f"{PODS}/worker", {"metadata": {"annotations": {"fractional.dev/plan": "node-1"}}}, content="merge"),
    ), "the controller's annotation", ("pods",)))  # fmt: skip
    add(Case("pod-bound", (
        setup("POST", PODS, pod(gated=False)),
        post(f"{PODS}/worker/binding", {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": "worker"},
                                        "target": {"apiVersion": "v1", "kind": "Node", "name": "node-1"}}),
        get(f"{PODS}/worker"),
    ), "a binding sets nodeName", ("pods", "binding")))  # fmt: skip
    add(Case("pod-bound-while-gated", (
        setup("POST", PODS, pod()),
        post(f"{PODS}/worker/binding", {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": "worker"},
                                        "target": {"apiVersion": "v1", "kind": "Node", "name": "node-1"}}),
    ), "a gated pod cannot be bound", ("pods", "binding")))  # fmt: skip
    add(Case("pod-status-condition", (
        setup("POST", PODS, pod()),
        Step("PATCH", f"{PODS}/worker/status", {"status": {"conditions": [{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": "waiting for GPU share"}]}}, content="strategic"),
    ), "the controller's PodScheduled reason", ("pods", "status")))  # fmt: skip
    add(Case("pod-evicted", (
        setup("POST", PODS, pod()),
        post(f"{PODS}/worker/eviction", {"apiVersion": "policy/v1", "kind": "Eviction",
                                         "metadata": {"name": "worker", "namespace": "default"}}),
        get(f"{PODS}/worker"),
    ), "an eviction of a pod no budget covers", ("pods", "eviction")))  # fmt: skip
    add(Case("pod-table", (setup("POST", PODS, pod()), get(PODS, accept="table")),
             "kubectl get pods", ("pods", "tables")))  # fmt: skip

    # -- nodes, events, leases ----------------------------------------------------------------------
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-1", "labels": {"fractional.dev/fake-profile": "a100-pcie-4x"}},
            "status": {"capacity": {"cpu": "64", "pods": "110"}, "allocatable": {"cpu": "64", "pods": "110"}}}  # fmt: skip
    add(Case("node-created", (post("/api/v1/nodes", node), get("/api/v1/nodes", accept="table")),
             "a node as the tests make them; kubectl get nodes", ("nodes", "tables")))  # fmt: skip
    event = {"apiVersion": "v1", "kind": "Event", "metadata": {"name": "worker.1", "namespace": "default"},
             "involvedObject": {"kind": "Pod", "name": "worker", "namespace": "default", "apiVersion": "v1"},
             "reason": "HandedToKubeScheduler", "message": "m", "type": "Normal", "count": 1,
             "source": {"component": "fractional-controller"},
             "firstTimestamp": "2026-12-01T00:00:00Z", "lastTimestamp": "2026-12-01T00:00:00Z"}  # fmt: skip
    add(Case("event-core", (post("/api/v1/namespaces/default/events", event),
                            get("/api/v1/namespaces/default/events", accept="table")),
             "the controller's core/v1 Event; kubectl get events", ("events", "tables")))  # fmt: skip
    add(Case("event-bad-type", (post("/api/v1/namespaces/default/events", {**event, "type": "Loud"}),),
             "an Event's type is Normal or Warning", ("events", "validation")))  # fmt: skip
    lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": "fractional-controller"},
             "spec": {"holderIdentity": "a", "leaseDurationSeconds": 15}}  # fmt: skip
    leases = "/apis/coordination.k8s.io/v1/namespaces/default/leases"
    add(Case("lease-taken-over", (
        post(leases, lease),
        Step("PUT", f"{leases}/fractional-controller", {**lease, "metadata": {"name": "fractional-controller",
             "resourceVersion": "{rv:0}"}, "spec": {"holderIdentity": "b", "leaseDurationSeconds": 15}}),
        Step("PUT", f"{leases}/fractional-controller", {**lease, "metadata": {"name": "fractional-controller",
             "resourceVersion": "{rv:0}"}, "spec": {"holderIdentity": "c", "leaseDurationSeconds": 15}}),
    ), "leader election: the second stale write loses", ("leases", "conflicts")))  # fmt: skip

    add(Case("lease-microtime-whole-second", (
        post(leases, {**lease, "spec": {**lease["spec"], "renewTime": "2026-01-01T00:16:40+00:00"}}),
        post(leases, {**lease, "metadata": {"name": "micro"},
                      "spec": {**lease["spec"], "renewTime": "2026-01-01T00:16:40.000000Z"}}),
    ), "a MicroTime needs its six fractional digits (what Python's isoformat drops at a whole second)",
        ("leases", "validation")))  # fmt: skip

    # -- server-side apply ------------------------------------------------------------------------
    def apply_claim(labels: dict[str, str]) -> str:
        return ("apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata:\n  name: share\n  labels:\n"
                + "".join(f"    {k}: '{v}'\n" for k, v in labels.items())
                + "spec:\n  devices:\n    requests:\n    - name: gpu\n      exactly:\n"
                "        deviceClassName: gpu.fractional.dev\n")  # fmt: skip

    add(Case("apply-created-then-conflict", (
        Step("PATCH", f"{CLAIMS}/share?fieldManager=alice", apply_claim({"team": "a"}), content="apply"),
        Step("PATCH", f"{CLAIMS}/share?fieldManager=bob", apply_claim({"team": "b"}), content="apply"),
        Step("PATCH", f"{CLAIMS}/share?fieldManager=bob&force=true", apply_claim({"team": "b"}), content="apply"),
    ), "apply creates, a second manager conflicts, force takes the field", ("apply", "conflicts")))  # fmt: skip
    add(Case("apply-without-manager", (
        Step("PATCH", f"{CLAIMS}/share", apply_claim({"team": "a"}), content="apply"),
    ), "apply needs a field manager", ("apply", "errors")))  # fmt: skip
    add(Case("json-patch-test-fails", (
        setup("POST", CLAIMS, claim()),
        Step("PATCH", f"{CLAIMS}/share", [{"op": "test", "path": "/metadata/name", "value": "other"}], content="json-patch"),
    ), "a JSON patch whose test fails", ("patch", "errors")))  # fmt: skip

    # -- watch -------------------------------------------------------------------------------------
    add(Case("watch-claims", (
        setup("GET", CLAIMS),
        setup("POST", CLAIMS, claim()),
        setup("PATCH", f"{CLAIMS}/share", {"metadata": {"labels": {"team": "a"}}}, content="merge"),
        setup("DELETE", f"{CLAIMS}/share"),
        get(f"{CLAIMS}?watch=1&resourceVersion={{rv:0}}&timeoutSeconds=1"),
    ), "a watch from a list's resourceVersion: added, modified, deleted", ("watch",)))  # fmt: skip
    add(Case("watch-label-selector", (
        setup("GET", CLAIMS),
        setup("POST", CLAIMS, {**claim(), "metadata": {"name": "share", "labels": {"team": "a"}}}),
        setup("PATCH", f"{CLAIMS}/share", {"metadata": {"labels": {"team": "b"}}}, content="merge"),
        get(f"{CLAIMS}?watch=1&labelSelector=team%3Da&resourceVersion={{rv:0}}&timeoutSeconds=1"),
    ), "an object leaving a watch's selector", ("watch",)))  # fmt: skip

    # -- discovery and OpenAPI, as kubectl reads them -----------------------------------------------
    add(Case("discovery-resource-group", (get("/apis/resource.k8s.io/v1"),),
             "the resource.k8s.io/v1 resource list (kubectl api-resources)", ("discovery",)))  # fmt: skip
    add(Case("missing-resource-type", (get(f"{R}/widgets"),), "an unknown resource", ("errors", "discovery")))
    return cases


CASES: list[Case] = _cases()
