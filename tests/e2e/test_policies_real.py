"""The chart's ValidatingAdmissionPolicies and RBAC on the real kube-apiserver: every allowed and
forbidden request of tests/chart/test_policies.py, replayed as the agent's and the controller's
service accounts with real tokens.

The chart is rendered with Helm (helm_python, as the chart tests do) under a release of its own, so
its service accounts, roles and policies sit beside an installed driver without touching it; only
the ServiceAccounts, RBAC, policies and bindings are applied. The agent's identity is node-bound as
in a cluster: its token comes from the TokenRequest API bound to a Pod on the node (the pod never
runs), so kube-apiserver puts the node in the user's extra ``authentication.kubernetes.io/node-name``
(ServiceAccountTokenPodNodeInfo); the nodes are Node objects made here.

Runs under ``make e2e`` (on the full local cluster) and alone on any cluster KUBECONFIG names, a
control plane without nodes being enough:
``hack/localcluster up --control-plane-only`` then
``KUBECONFIG=.cluster/kubeconfig pytest -n0 -m e2e tests/e2e/test_policies_real.py``.

Where kube-apiserver refuses a forbidden request before the policy sees it (its own validation of
a pod update, the granular status authorization of 1.36+), the refusal is recorded per case in
``REFUSED_FIRST``; every other forbidden request is refused by our policy, with its message.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import urllib3
from e2e_support import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tests" / "chart"))

import helm_python as helm
import test_policies as cases
from kubernetes import client, config
from test_leader_failover import controller_rolled_out

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

Obj = dict[str, Any]
RUN = uuid.uuid4().hex[:5]
RELEASE = f"fractional-dra-vap{RUN}"  # contains the chart name: objects are named <release>-agent, ...
NAMESPACE = f"fractional-vap-{RUN}"
WORKLOADS = f"team-a-{RUN}"
NODES = (cases.NODE, cases.OTHER_NODE)


@dataclass
class Answer:
    status: int
    body: Obj

    @property
    def message(self) -> str:
        return str(self.body.get("message", ""))


class Http:
    """Raw requests to kube-apiserver as one identity (a bearer token, or the kubeconfig's client)."""

    def __init__(self, configuration: client.Configuration, token: str | None = None) -> None:
        self.host = configuration.host
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        if not token and configuration.api_key.get("authorization"):
            self.headers = {"Authorization": configuration.api_key["authorization"]}
        self.pool = urllib3.PoolManager(
            ca_certs=configuration.ssl_ca_cert,
            cert_file=None if token else configuration.cert_file,
            key_file=None if token else configuration.key_file,
            cert_reqs="CERT_REQUIRED" if configuration.ssl_ca_cert else "CERT_NONE",
        )

    def __call__(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> Answer:
        data = None if body is None else json.dumps(body).encode()
        response = self.pool.request(
            method, self.host + path, body=data, headers={**self.headers, "Content-Type": content_type},
            retries=False, timeout=30,
        )  # fmt: skip
        try:
            decoded = json.loads(response.data) if response.data else {}
        except ValueError:
            decoded = {"message": response.data.decode(errors="replace")}
        return Answer(int(response.status), decoded)

    def close(self) -> None:
        """Close the kept connections (at the fixture's teardown, not whenever GC runs)."""
        self.pool.clear()

    def ok(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Obj:
        answer = self(method, path, body, content_type)
        assert answer.status < 300, (method, path, answer)
        return answer.body


def merge_patch(old: Any, new: Any) -> Any:
    """The RFC 7386 merge patch that turns old into new (lists replaced whole)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return copy.deepcopy(new)
    patch: Obj = {key: None for key in old if key not in new}
    for key, value in new.items():
        if key not in old:
            patch[key] = copy.deepcopy(value)
        elif old[key] != value:
            patch[key] = merge_patch(old[key], value)
    return patch


MERGE = "application/merge-patch+json"
SERVER_FIELDS = ("uid", "resourceVersion", "generation", "creationTimestamp", "managedFields")


def _for_create(obj: Obj, name: str, namespace: str | None) -> Obj:
    """A case's object as a client creates it: server fields and status left out, named for the case."""
    body = copy.deepcopy(obj)
    body.pop("status", None)
    metadata = {k: v for k, v in body["metadata"].items() if k not in SERVER_FIELDS}
    metadata["name"] = name
    if namespace:
        metadata["namespace"] = namespace
    body["metadata"] = metadata
    return body


def _slug(case: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in case.lower()).strip("-")[:50].strip("-")


@dataclass
class Cluster:
    admin: Http
    agent: dict[str | None, Http]  # by node; None: a token bound to no pod
    controller: Http
    owner: Obj  # a ConfigMap standing in for the owners the chart tests' objects name

    def pods(self, namespace: str = WORKLOADS) -> str:
        return f"/api/v1/namespaces/{namespace}/pods"

    def claims(self) -> str:
        return f"/apis/resource.k8s.io/v1/namespaces/{WORKLOADS}/resourceclaims"


def _render() -> list[Obj]:
    chart = helm.Chart.load(str(REPO_ROOT / "charts" / "fractional-dra"))
    values = {"admissionPolicy": {"agentClaimStatus": "policy"}}
    import yaml

    manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    wanted = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
              "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}  # fmt: skip
    return [
        doc
        for template, text in sorted(manifests.items())
        if not template.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc and doc["kind"] in wanted
    ]


_PATHS = {
    "ServiceAccount": "/api/v1/namespaces/{ns}/serviceaccounts",
    "ClusterRole": "/apis/rbac.authorization.k8s.io/v1/clusterroles",
    "ClusterRoleBinding": "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
    "Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
    "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
    "ValidatingAdmissionPolicy": "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies",
    "ValidatingAdmissionPolicyBinding": (
        "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings"
    ),
}


def _token(admin: Http, account: str, pod: Obj | None) -> str:
    spec: Obj = {"expirationSeconds": 3600}
    if pod is not None:
        spec["boundObjectRef"] = {"kind": "Pod", "apiVersion": "v1", "name": pod["metadata"]["name"],
                                  "uid": pod["metadata"]["uid"]}  # fmt: skip
    answer = admin.ok(
        "POST", f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/{account}/token",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
    )  # fmt: skip
    return str(answer["status"]["token"])


def _whoami(http: Http) -> Obj:
    review = http.ok("POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews",
                     {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})  # fmt: skip
    return dict(review["status"]["userInfo"])


def _kubeconfig_configuration() -> client.Configuration:
    configuration = client.Configuration()
    path = os.environ.get("KUBECONFIG") or str(REPO_ROOT / ".cluster" / "kubeconfig")
    context = os.environ.get("FRACTIONAL_E2E_CONTEXT")
    config.load_kube_config(config_file=path, context=context, client_configuration=configuration)
    return configuration


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    opened: list[Http] = []  # every client the setup makes: closed however it ends

    def connect(configuration: client.Configuration, token: str | None = None) -> Http:
        opened.append(Http(configuration, token))
        return opened[-1]

    try:
        yield from _cluster(connect)
    finally:
        for http in opened:
            http.close()


def _cluster(connect: Callable[..., Http]) -> Iterator[Cluster]:
    try:
        configuration = _kubeconfig_configuration()
        admin = connect(configuration)
        ready = admin("GET", "/readyz")
    except Exception as error:  # no kubeconfig or nothing listening: no cluster here
        problem = f"no reachable kube-apiserver (KUBECONFIG): {error}"
        if os.environ.get("FRACTIONAL_E2E_REQUIRE") == "1":
            pytest.fail(problem)
        pytest.skip(problem)
    assert ready.status == 200, ready
    controller_rolled_out()  # the Lease stays put while the cases write through the guard
    made: list[str] = []
    try:
        for name in (NAMESPACE, WORKLOADS):
            # Out of the chart's scheduling-gate policy (installed where the whole driver is): the
            # pods stored here are exactly what each case writes.
            labels = {"fractional.dev/auto-gate": "disabled"}
            admin.ok(
                "POST",
                "/api/v1/namespaces",
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}},
            )
            made.append(f"/api/v1/namespaces/{name}")
        for obj in _render():
            path = _PATHS[obj["kind"]].format(ns=NAMESPACE)
            created = admin.ok("POST", path, obj)
            if "{ns}" not in _PATHS[obj["kind"]]:
                made.append(f"{path}/{created['metadata']['name']}")
        for node in NODES:
            if admin("GET", f"/api/v1/nodes/{node}").status == 404:
                admin.ok(
                    "POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}}
                )
                made.append(f"/api/v1/nodes/{node}")
        agent, controller = f"{RELEASE}-agent", f"{RELEASE}-controller"
        agents: dict[str | None, Http] = {None: connect(configuration, _token(admin, agent, None))}
        for node in NODES:  # a pod of the agent's service account on the node: its token names the node
            pod = admin.ok("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", {
                "apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"agent-{node}"},
                "spec": {"serviceAccountName": agent, "nodeName": node, "automountServiceAccountToken": False,
                         "containers": [{"name": "agent", "image": "registry.k8s.io/pause:3.10"}]},
            })  # fmt: skip
            agents[node] = connect(configuration, _token(admin, agent, pod))
        owner_body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "owner"}}
        owner = admin.ok("POST", f"/api/v1/namespaces/{WORKLOADS}/configmaps", owner_body)
        found = Cluster(admin, agents, connect(configuration, _token(admin, controller, None)), owner)
        _wait_for_policies(found)
        yield found
    finally:
        for path in reversed(made):
            admin("DELETE", path)


def _wait_for_policies(cluster: Cluster) -> None:
    """Policies and RBAC take effect when the apiserver's informers have them: poll one refusal of
    each policy the tests rely on (a pod label through the controller; a slice of another node)."""
    _stored_pod(cluster, "canary", cases.gated_pod)
    slice_body = _for_create(cases.resource_slice(cases.OTHER_NODE), f"canary-{RUN}", None)
    deadline = time.monotonic() + 60
    for attempt in itertools.count():
        labelled = cluster.controller(
            "PATCH", f"{cluster.pods()}/canary", {"metadata": {"labels": {"canary": str(attempt)}}}, MERGE
        )
        foreign = cluster.agent[cases.NODE]("POST", "/apis/resource.k8s.io/v1/resourceslices", slice_body)
        if "ValidatingAdmissionPolicy" in labelled.message and "ValidatingAdmissionPolicy" in foreign.message:
            return
        if foreign.status == 201:  # not in force yet
            cluster.admin("DELETE", f"/apis/resource.k8s.io/v1/resourceslices/canary-{RUN}")
        assert time.monotonic() < deadline, (labelled, foreign)
        time.sleep(1)


def test_tokens_carry_the_identities_the_policies_read(cluster: Cluster) -> None:
    bound = _whoami(cluster.agent[cases.NODE])
    assert bound["username"] == f"system:serviceaccount:{NAMESPACE}:{RELEASE}-agent"
    assert bound["extra"]["authentication.kubernetes.io/node-name"] == [cases.NODE]
    assert "authentication.kubernetes.io/node-name" not in _whoami(cluster.agent[None]).get("extra", {})
    assert (
        _whoami(cluster.controller)["username"] == f"system:serviceaccount:{NAMESPACE}:{RELEASE}-controller"
    )


def _refused_by_policy(answer: Answer, fragment: str) -> None:
    """kube-apiserver answers a policy's denial (a validation without ``reason``) with 422 Invalid,
    naming the policy and the binding: "... is forbidden: ValidatingAdmissionPolicy '<name>' with
    binding '<name>' denied request: <message>" (the chart tests see only the message)."""
    assert answer.status == 422 and answer.body.get("reason") == "Invalid", answer
    assert "ValidatingAdmissionPolicy" in answer.message and fragment in answer.message, answer


# 1.36+: kube-apiserver's granular status authorization refuses, before admission, a status.devices
# change the writer lacks resourceclaims/driver for (422, field status.devices).
GRANULAR = 'changing status.devices requires resource="resourceclaims/driver"'


# -- agent: ResourceSlices ------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(cases.SLICE_CASES))
def test_agent_resource_slices(cluster: Cluster, case: str) -> None:
    operation, stored, node = cases.slice_case(case)
    *_, allowed, fragment = cases.SLICE_CASES[case]
    name = f"{_slug(case)}-{RUN}"
    body = _for_create(stored, name, None)
    path = "/apis/resource.k8s.io/v1/resourceslices"
    try:
        if operation != "CREATE":
            written = cluster.admin.ok("POST", path, body)
        agent = cluster.agent[node]
        if operation == "CREATE":
            answer = agent("POST", path, body)
        elif operation == "UPDATE":
            written["metadata"].setdefault("labels", {})["fractional.dev/e2e"] = RUN
            answer = agent("PUT", f"{path}/{name}", written)
        else:
            answer = agent("DELETE", f"{path}/{name}")
        if allowed:
            assert answer.status in (200, 201), answer
        else:
            _refused_by_policy(answer, fragment)
    finally:
        cluster.admin("DELETE", f"{path}/{name}")


# -- controller: pods -----------------------------------------------------------------------------


def _stored_pod(cluster: Cluster, name: str, stored: Callable[[], Obj], namespace: str = WORKLOADS) -> Obj:
    body = _for_create(stored(), name, namespace)
    owner = cluster.owner["metadata"]
    body["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "ConfigMap", "name": owner["name"],
                                            "uid": owner["uid"], "controller": True}]  # fmt: skip
    return cluster.admin.ok("POST", cluster.pods(namespace), body)


# kube-apiserver's pod update validation refuses these before admission (422), as upstream's
# ValidatePodUpdate does: the policy never sees them. Recorded here; each is still refused.
REFUSED_FIRST: dict[str, int] = {
    "drop a container's claims": 422,
    "set nodeName": 422,
    "add a gate": 422,
    "re-add our gate": 422,
    # A gated pod may only add to spec.nodeSelector: changing or replacing an entry is refused with
    # "only additions to spec.nodeSelector are allowed (no mutations or deletions)" (1.37.2).
    "re-pin a pod pinned already": 422,
    "change the pod's nodeSelector while pinning": 422,
}


@pytest.mark.parametrize("case", sorted(cases.POD_ALLOWED) + sorted(cases.POD_FORBIDDEN))
def test_controller_pod_writes(cluster: Cluster, case: str) -> None:
    allowed = case in cases.POD_ALLOWED
    stored, change = cases.POD_ALLOWED[case] if allowed else cases.POD_FORBIDDEN[case][:2]
    name = _slug(case)
    old = _stored_pod(cluster, name, stored)
    new = copy.deepcopy(old)
    change(new)
    answer = cluster.controller("PATCH", f"{cluster.pods()}/{name}", merge_patch(old, new), MERGE)
    if allowed:
        assert answer.status == 200, answer
    elif case in REFUSED_FIRST:
        assert answer.status == REFUSED_FIRST[case] and "ValidatingAdmissionPolicy" not in answer.message, (
            answer
        )
    else:
        _refused_by_policy(answer, cases.POD_FORBIDDEN[case][2])


# -- controller: pods' status -------------------------------------------------------------------------


def _running(cluster: Cluster, name: str, stored: Callable[[], Obj]) -> Obj:
    pod = stored()
    if pod["spec"].get(
        "nodeName"
    ):  # a running pod: bound when created (nominatedNodeName is for unbound ones)
        pod["spec"]["nodeName"] = cases.NODE
        pod["spec"].pop("schedulingGates", None)
    created = _stored_pod(cluster, name, lambda: pod)
    # kube-controller-manager's disruption controller turns a DisruptionTarget older than two
    # minutes on a pod not being deleted to False (stalePodDisruptionTimeout): the stored one is new.
    for condition in pod["status"].get("conditions", ()):
        if condition["type"] == "DisruptionTarget":
            condition["lastTransitionTime"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    created["status"] = {**created.get("status", {}), **pod["status"]}
    path = f"{cluster.pods()}/{name}/status"
    return cluster.admin.ok("PUT", path, created)


# The status strategy resets spec and most metadata before admission: these changes are taken
# without effect (the pod stays as it was), where the chart tests' model, which has no reset, sees
# them refused. The policy denies them regardless (tests/chart/test_policies.py).
DROPPED_BY_THE_SERVER = {"spec"}


def _status_cases() -> dict[str, tuple[Callable[[], Obj], Callable[[Obj], None], bool, str]]:
    from driver.controller.preemption.preemptor import build_disruption_condition

    found = {
        f"status: {name}": (cases.running_pod, change, False, fragment)
        for name, (change, fragment) in cases.STATUS_FORBIDDEN.items()
    }
    condition = build_disruption_condition(cases.gated_pod())
    found["status: our DisruptionTarget"] = (
        cases.running_pod, cases._status_patch({"conditions": [condition]}), True, "")  # fmt: skip
    found["status: nominate a node"] = (
        cases.gated_pod, cases._status_patch({"nominatedNodeName": cases.NODE}), True, "")  # fmt: skip
    found.update(cases.DISRUPTION_CASES)
    return found


STATUS_CASES = _status_cases()


@pytest.mark.parametrize("case", sorted(STATUS_CASES))
def test_controller_pod_status_writes(cluster: Cluster, case: str) -> None:
    stored, change, allowed, fragment = STATUS_CASES[case]
    name = _slug(case)
    old = _running(cluster, name, stored)
    new = copy.deepcopy(old)
    change(new)
    answer = cluster.controller("PATCH", f"{cluster.pods()}/{name}/status", merge_patch(old, new), MERGE)
    short = case.removeprefix("status: ")
    if allowed:
        assert answer.status == 200, answer
    elif short in DROPPED_BY_THE_SERVER:
        assert answer.status == 200 and answer.body["spec"] == old["spec"], answer
    else:
        _refused_by_policy(answer, fragment)


# -- controller: evictions -------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(cases.EVICTION_CASES))
def test_controller_evictions(cluster: Cluster, case: str) -> None:
    namespace, options, allowed, fragment = cases.EVICTION_CASES[case]
    namespace = WORKLOADS if namespace == "team-a" else namespace
    name = f"{_slug(case)}-{RUN}"
    victim = _for_create(cases.gated_pod(), name, namespace)
    victim["metadata"].pop("ownerReferences")  # its Job does not exist: the garbage collector would take it
    pod = cluster.admin.ok("POST", cluster.pods(namespace), victim | {
        "spec": {"containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}],
                 "schedulingGates": [{"name": "example.com/hold"}]},
    })  # fmt: skip
    try:
        body = cases.eviction(namespace, options)
        body["metadata"] = {"name": name, "namespace": namespace}
        if options and "preconditions" in options:
            body["deleteOptions"]["preconditions"]["uid"] = pod["metadata"]["uid"]
        answer = cluster.controller("POST", f"{cluster.pods(namespace)}/{name}/eviction", body)
        if allowed:
            assert answer.status == 201, answer
        else:
            _refused_by_policy(answer, fragment)
    finally:
        cluster.admin("DELETE", f"{cluster.pods(namespace)}/{name}")


def test_the_preemptors_own_evictions_pass(cluster: Cluster) -> None:
    name = f"victim-{RUN}"
    pod = _running(cluster, name, cases.running_pod)
    dry_run, eviction = cases.preemptor_evictions(pod)
    path = f"{cluster.pods()}/{name}/eviction"
    assert cluster.controller("POST", path, dry_run).status == 201
    assert cluster.admin("GET", f"{cluster.pods()}/{name}").status == 200
    assert cluster.controller("POST", path, eviction).status == 201


# -- ResourceClaims: the controller's and the agent's writes ---------------------------------------------


def _stored_claim(cluster: Cluster, name: str, stored: Obj) -> Obj:
    body = _for_create(stored, name, WORKLOADS)
    owner = cluster.owner["metadata"]
    body["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "ConfigMap", "name": owner["name"],
                                            "uid": owner["uid"], "controller": True}]  # fmt: skip
    created = cluster.admin.ok("POST", cluster.claims(), body)
    if stored.get("status"):
        created["status"] = copy.deepcopy(stored["status"])
        created = cluster.admin.ok("PUT", f"{cluster.claims()}/{name}/status", created)
    return created


def _forget_claim(cluster: Cluster, name: str) -> None:
    """The case's claim gone at once, its status and finalizers dropped by the admin.
    kube-controller-manager would release a claim reserved for pods that do not exist, but not one
    reserved for a PodGroup that never existed ("clear the allocation of a claim a PodGroup uses"):
    left to it, that claim stayed allocated after its namespace went, and every later test waiting
    for an idle cluster timed out. The status goes first: the chart's claims-in-use policy refuses
    to delete a claim allocated without a finalizer while it is reserved (docs/troubleshooting.md),
    which is how the controller's own claims are protected."""
    path = f"{cluster.claims()}/{name}"
    cleared = {"status": {"allocation": None, "reservedFor": None, "devices": None}}
    cluster.admin("PATCH", f"{path}/status", cleared, MERGE)
    cluster.admin("PATCH", path, {"metadata": {"finalizers": None}}, MERGE)
    cluster.admin("DELETE", path)


def _claim_write(cluster: Cluster, who: Http, case: str, stored: Obj, change: Callable[[Obj], None],
                 subresource: str) -> tuple[Obj, Answer]:  # fmt: skip
    name = _slug(case)
    old = _stored_claim(cluster, name, stored)
    new = copy.deepcopy(old)
    change(new)
    suffix = f"/{subresource}" if subresource else ""
    return old, who("PUT", f"{cluster.claims()}/{name}{suffix}", new)


@pytest.mark.parametrize("case", sorted(cases.CLAIM_ALLOWED) + sorted(cases.CLAIM_FORBIDDEN))
def test_controller_claim_writes(cluster: Cluster, case: str) -> None:
    allowed = case in cases.CLAIM_ALLOWED
    if allowed:
        stored, change, subresource = cases.CLAIM_ALLOWED[case]
    else:
        stored, change, subresource, fragment = cases.CLAIM_FORBIDDEN[case]
    for _attempt in range(3):
        # A claim reserved for a pod that does not exist races kube-controller-manager, which drops
        # such reservations: its write between ours makes ours a 409. Made again, it is raced anew.
        try:
            _, answer = _claim_write(cluster, cluster.controller, case, stored(), change, subresource)
        finally:
            _forget_claim(cluster, _slug(case))
        if answer.status != 409:
            break
    if allowed:
        assert answer.status == 200, answer
    elif case in CLAIM_REFUSED_FIRST and not (CLAIM_REFUSED_FIRST[case] == GRANULAR and _minor(cluster) < 36):
        expected = CLAIM_REFUSED_FIRST[case]
        fragments = expected if isinstance(expected, tuple) else (expected,)
        assert answer.status == 422 and any(f in answer.message for f in fragments), answer
    else:
        _refused_by_policy(answer, fragment)


def _minor(cluster: Cluster) -> int:
    """The apiserver's minor release (35 for 1.35.4)."""
    return int(str(cluster.admin.ok("GET", "/version")["minor"]).rstrip("+"))


# The controller's forbidden claim writes that kube-apiserver refuses before the policy sees them:
# 1.36+'s granular status authorization (it lacks resourceclaims/driver) and the claim validation.
# On 1.35, which has no granular status authorization, our policy refuses the status.devices writes
# itself (seen in make e2e on 1.35.4).
CLAIM_REFUSED_FIRST = {
    "write status.devices": GRANULAR,
    "change another driver's device status": GRANULAR,
    # The claim validation's own words change by release (seen on 1.36.3 and 1.37.2), the refusal not.
    "replace the allocation": (
        "status.allocation: Invalid value: null: field cannot be modified once set",  # 1.37
        "field is immutable",  # 1.36: "status.allocation: Invalid value: {the new one}: field is immutable"
    ),
}


def _devices(devices: list[Obj] | None) -> Callable[[Obj], None]:
    def change(claim: Obj) -> None:
        if devices:
            claim["status"]["devices"] = devices
        else:
            claim["status"].pop("devices", None)

    return change


@pytest.mark.parametrize("case", [*sorted(cases.AGENT_FORBIDDEN), "write its own device status"])
def test_agent_claim_status_writes(cluster: Cluster, case: str) -> None:
    if case == "write its own device status":
        stored, devices, allowed = cases.claim(allocated=True, devices=[cases._theirs()]), None, True
        devices = cases.merge_device_statuses([cases._theirs()], [cases.device_status()])
    else:
        make, devices, _ = cases.AGENT_FORBIDDEN[case]
        stored, allowed = make(), False
        if "another node" in case:
            stored["status"]["allocation"] = cases.allocation(cases.OTHER_NODE)
    _, answer = _claim_write(cluster, cluster.agent[cases.NODE], case, stored, _devices(devices), "status")
    if allowed:
        assert answer.status == 200, answer
    else:  # every one of these is refused first by 1.36+'s granular authorization, else by the policy
        assert answer.status == 422 and (
            GRANULAR in answer.message or "ValidatingAdmissionPolicy" in answer.message
        )


def test_the_controller_writes_only_its_allocation_guard_endpoint(cluster: Cluster) -> None:
    """RBAC for the allocation guard: the controller may create EndpointSlices in the release
    namespace (create cannot be limited by name) and read, rewrite and delete only its own
    ``<release>-controller-allocation-guard-leader``; nothing elsewhere."""
    from driver.controller.guard import build_endpoint_slice

    service = f"{RELEASE}-controller-allocation-guard"
    path = f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices"
    ours = build_endpoint_slice(
        namespace=NAMESPACE, service=service, address="10.0.0.7", port=9443, pod_name="c-0"
    )
    name = ours["metadata"]["name"]
    created = cluster.controller.ok("POST", path, ours)
    assert cluster.controller.ok("GET", f"{path}/{name}")["metadata"]["uid"] == created["metadata"]["uid"]
    moved = {**created, "endpoints": [{**created["endpoints"][0], "addresses": ["10.0.0.8"]}]}
    cluster.controller.ok("PUT", f"{path}/{name}", moved)
    other = build_endpoint_slice(
        namespace=NAMESPACE, service="someone-else", address="10.0.0.9", port=80, pod_name=""
    )
    stored_other = cluster.admin.ok("POST", path, other)
    other_name = stored_other["metadata"]["name"]
    for method, target, body in (
        ("GET", f"{path}/{other_name}", None),
        ("PUT", f"{path}/{other_name}", {**stored_other, "endpoints": []}),
        ("DELETE", f"{path}/{other_name}", None),
        (
            "POST",
            f"/apis/discovery.k8s.io/v1/namespaces/{WORKLOADS}/endpointslices",
            _for_create(ours, name, WORKLOADS),
        ),
    ):
        answer = cluster.controller(method, target, body)
        assert answer.status == 403, (method, target, answer)
    cluster.controller.ok("DELETE", f"{path}/{name}")
    cluster.admin("DELETE", f"{path}/{other_name}")
