"""The chart's MutatingAdmissionPolicy on a real kube-apiserver: a pod with a claim, written with no
scheduling gate, is gated at admission and placed by our controller; a namespace or pod labelled
``fractional.dev/auto-gate=disabled`` is left to kube-scheduler; while the controller is stopped,
gated pods wait (``kubectl get pods`` shows SchedulingGated) and run once it is back.

Where the cluster serves no MutatingAdmissionPolicy (1.35 without its feature gate), the chart
installs none: the pod is admitted ungated and kube-scheduler places it, as the NOTES say.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import pytest
from e2e_support import AUTO_GATE_LABEL, apply, get, kubectl, pod, wait_for
from test_driver import POD_START_SECONDS, gpu_request, running, template

from driver.controller.model.objects import allocated_by_us

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

GATE = "fractional.dev/allocation"
CONTROLLER = "deployment/fractional-dra-controller"
RELEASE_NAMESPACE = "fractional-system"


@pytest.fixture(scope="module")
def policy_served(real_cluster: None) -> bool:
    served = kubectl("api-resources", "--api-group=admissionregistration.k8s.io", "-o", "name")
    return "mutatingadmissionpolicies.admissionregistration.k8s.io" in served.split()


def _share_pod(name: str, namespace: str, *, labels: dict[str, str] | None = None) -> list[dict[str, Any]]:
    body = pod(name, {"gpu": {"resourceClaimTemplateName": name}})
    if labels:
        body["metadata"]["labels"] = labels
    return [template(name, [gpu_request(memory="2Gi", compute="5")]), body]


def _admitted_gates(name: str, namespace: str, *, labels: dict[str, str] | None = None) -> list[str]:
    """The gates the server gives such a pod at admission: a server-side dry run of its creation
    (the controller may already have removed ours from the real one by the time we look)."""
    body = _share_pod(name, namespace, labels=labels)[1]
    dry_run = ("create", "-n", namespace, "--dry-run=server", "-o", "json", "-f", "-")
    admitted = json.loads(kubectl(*dry_run, stdin=json.dumps(body)))
    return [g["name"] for g in admitted["spec"].get("schedulingGates", [])]


def _claim_of(pod_name: str, namespace: str) -> dict[str, Any]:
    """The pod's claim, with its managedFields (kubectl leaves them out unless asked)."""
    stored = get("pod", pod_name, namespace)
    (status,) = stored["status"]["resourceClaimStatuses"]
    shown = ("get", "resourceclaim", status["resourceClaimName"], "-n", namespace, "-o", "json")
    loaded: dict[str, Any] = json.loads(kubectl(*shown, "--show-managed-fields"))
    return loaded


def _scheduled_condition(name: str, namespace: str) -> tuple[str, str] | None:
    for condition in get("pod", name, namespace)["status"].get("conditions", []):
        if condition["type"] == "PodScheduled":
            return condition["status"], condition.get("reason", "")
    return None


def _placed_by_our_controller(claim: dict[str, Any]) -> bool:
    """The server lists ``status.allocation`` under our controller's field manager (kube-scheduler's
    own allocation comes with its finalizer and under its own manager)."""
    return allocated_by_us(claim) and not claim["metadata"].get("finalizers")


def test_a_pod_written_without_the_gate_is_placed_by_our_controller(
    user_namespace: str, policy_served: bool
) -> None:
    apply(_share_pod("plain", user_namespace), user_namespace)
    wait_for(lambda: running("plain", user_namespace), timeout=POD_START_SECONDS, what="pod plain running")
    claim = _claim_of("plain", user_namespace)
    if not policy_served:
        assert _admitted_gates("dry-plain", user_namespace) == []
        assert not _placed_by_our_controller(claim), "no policy: kube-scheduler allocates"
        return
    assert _admitted_gates("dry-plain", user_namespace) == [GATE]
    assert _placed_by_our_controller(claim), claim["metadata"]
    assert get("pod", "plain", user_namespace)["spec"].get("schedulingGates") is None


def test_a_namespace_labelled_disabled_is_left_to_kube_scheduler(namespace: str) -> None:
    # The `namespace` fixture labels its namespace fractional.dev/auto-gate=disabled.
    assert get("namespace", namespace)["metadata"]["labels"][AUTO_GATE_LABEL] == "disabled"
    apply(_share_pod("left", namespace), namespace)
    wait_for(lambda: running("left", namespace), timeout=POD_START_SECONDS, what="pod left running")
    assert _admitted_gates("dry-left", namespace) == []
    assert not _placed_by_our_controller(_claim_of("left", namespace))


def test_a_pod_labelled_disabled_is_left_to_kube_scheduler(user_namespace: str) -> None:
    apply(_share_pod("own-way", user_namespace, labels={AUTO_GATE_LABEL: "disabled"}), user_namespace)
    wait_for(lambda: running("own-way", user_namespace), timeout=POD_START_SECONDS, what="pod own-way")
    assert _admitted_gates("dry-own-way", user_namespace, labels={AUTO_GATE_LABEL: "disabled"}) == []
    assert not _placed_by_our_controller(_claim_of("own-way", user_namespace))


@contextlib.contextmanager
def _controller_stopped() -> Iterator[None]:
    """The controller's Deployment at zero replicas and its pods gone, then back at its own count.

    ``kubectl rollout status`` returns as soon as the Deployment counts no replica, while the old pod
    is still terminating (learned in make e2e): until the kubelet has stopped it, that replica may
    still place pods, so the case waits for the pods themselves to be gone, as a user stopping the
    controller would."""
    deployment = get(*CONTROLLER.split("/"), RELEASE_NAMESPACE)
    replicas = deployment["spec"]["replicas"]
    selector = ",".join(f"{k}={v}" for k, v in deployment["spec"]["selector"]["matchLabels"].items())
    kubectl("scale", CONTROLLER, "-n", RELEASE_NAMESPACE, "--replicas=0")
    try:
        kubectl("rollout", "status", CONTROLLER, "-n", RELEASE_NAMESPACE, "--timeout=120s", timeout=150)
        wait_for(
            lambda: not kubectl("get", "pods", "-l", selector, "-n", RELEASE_NAMESPACE, "-o", "name").strip(),
            timeout=120,
            what="the controller's pods gone",
        )
        yield
    finally:
        kubectl("scale", CONTROLLER, "-n", RELEASE_NAMESPACE, f"--replicas={replicas}")
        kubectl("rollout", "status", CONTROLLER, "-n", RELEASE_NAMESPACE, "--timeout=180s", timeout=200)


def test_gated_pods_wait_while_the_controller_is_stopped(user_namespace: str, policy_served: bool) -> None:
    if not policy_served:
        pytest.skip("this cluster serves no MutatingAdmissionPolicy: nothing gates the pod")
    with _controller_stopped():
        apply(_share_pod("waiting", user_namespace), user_namespace)
        # kube-scheduler marks a gated pod PodScheduled=False/SchedulingGated; kubectl shows the reason.
        wait_for(
            lambda: _scheduled_condition("waiting", user_namespace) == ("False", "SchedulingGated"),
            timeout=60,
            what="PodScheduled=False, reason SchedulingGated",
        )
        listed = kubectl("get", "pod", "waiting", "-n", user_namespace, "--no-headers")
        assert "SchedulingGated" in listed.split(), listed
        # The way out docs/install.md gives while the controller is down: remove the gate by hand,
        # and kube-scheduler places the pod.
        remove = [{"op": "remove", "path": "/spec/schedulingGates/0"}]
        kubectl("patch", "pod", "waiting", "-n", user_namespace, "--type=json", "-p", json.dumps(remove))
        wait_for(lambda: running("waiting", user_namespace), timeout=POD_START_SECONDS, what="ungated pod")
        assert not _placed_by_our_controller(_claim_of("waiting", user_namespace))


def test_a_pod_gated_while_the_controller_was_down_runs_when_it_is_back(
    user_namespace: str, policy_served: bool
) -> None:
    if not policy_served:
        pytest.skip("this cluster serves no MutatingAdmissionPolicy: nothing gates the pod")
    with _controller_stopped():
        apply(_share_pod("later", user_namespace), user_namespace)
        assert get("pod", "later", user_namespace)["spec"]["schedulingGates"] == [{"name": GATE}]
    wait_for(lambda: running("later", user_namespace), timeout=POD_START_SECONDS, what="pod later running")
    assert _placed_by_our_controller(_claim_of("later", user_namespace))


def _cpu_pod(name: str, *, owner: dict[str, Any] | None = None) -> dict[str, Any]:
    body = pod(name, {})
    body["spec"].pop("resourceClaims")
    body["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "100m", "memory": "32Mi"}}
    if owner:
        body["metadata"]["ownerReferences"] = [owner]
    return body


def _dry_run_gates(body: dict[str, Any], namespace: str) -> list[str]:
    dry_run = ("create", "-n", namespace, "--dry-run=server", "-o", "json", "-f", "-")
    admitted = json.loads(kubectl(*dry_run, stdin=json.dumps(body)))
    return [g["name"] for g in admitted["spec"].get("schedulingGates", [])]


def test_a_namespace_that_opts_in_has_its_pods_without_claims_placed_and_pinned_by_our_controller(
    user_namespace: str, policy_served: bool
) -> None:
    if not policy_served:
        pytest.skip("this cluster serves no MutatingAdmissionPolicy (the chart installs none)")
    label = "fractional.dev/placement"
    assert _dry_run_gates(_cpu_pod("dry-cpu"), user_namespace) == [], "not before the namespace opts in"
    kubectl("label", "namespace", user_namespace, f"{label}=all-pods")
    try:
        assert _dry_run_gates(_cpu_pod("dry-cpu"), user_namespace) == [GATE]
        daemon = {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "name": "agent",
            "uid": "0" * 8 + "-0000-0000-0000-" + "0" * 12,
        }
        assert _dry_run_gates(_cpu_pod("dry-daemon", owner=daemon), user_namespace) == [], (
            "never a DaemonSet's pod"
        )
        apply([_cpu_pod("cpu-only")], user_namespace)
        wait_for(lambda: running("cpu-only", user_namespace), timeout=POD_START_SECONDS, what="pod cpu-only")
        stored = get("pod", "cpu-only", user_namespace)
        assert stored["spec"].get("schedulingGates") is None
        node = get("node", stored["spec"]["nodeName"])
        pinned = stored["spec"]["nodeSelector"]["kubernetes.io/hostname"]
        assert pinned == node["metadata"]["labels"]["kubernetes.io/hostname"], "runs where we pinned it"
    finally:
        kubectl("label", "namespace", user_namespace, f"{label}-")
