"""The MutatingAdmissionPolicy that adds the controller's scheduling gate to pods with claims.

What the real kube-apiserver does with it (the gate added, the opt-outs, pods waiting while the
controller is down) is tests/e2e/test_auto_gate.py; these check what the chart renders.
"""

from __future__ import annotations

from typing import Any

import helm_python as helm
import pytest
from chart_support import RELEASE, render_chart, render_notes

from driver.controller.model.objects import GATE

POLICY = f"{RELEASE}-scheduling-gate"
LABEL = "fractional.dev/auto-gate"


def _gate_objects(values: dict[str, Any] | None = None, name: str = POLICY) -> dict[str, dict[str, Any]]:
    """The policy called ``name`` and its binding, by kind."""
    return {
        obj["kind"]: obj
        for obj in render_chart(values)
        if obj["kind"] in ("MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding")
        and obj["metadata"]["name"] == name
    }


def test_the_default_install_gates_pods_with_claims() -> None:
    objects = _gate_objects()
    policy = objects["MutatingAdmissionPolicy"]
    binding = objects["MutatingAdmissionPolicyBinding"]
    # Helm renders offline for 1.36 and later, where the API is GA.
    assert policy["apiVersion"] == binding["apiVersion"] == "admissionregistration.k8s.io/v1"
    assert binding["spec"]["policyName"] == policy["metadata"]["name"] == POLICY
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Ignore", "a policy that cannot run must not block pod creation"
    rule = spec["matchConstraints"]["resourceRules"]
    pods = {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}
    assert rule == [pods]
    conditions = {c["name"]: c["expression"] for c in spec["matchConditions"]}
    assert "resourceClaims" in conditions["usesResourceClaims"]
    assert "nodeName" in conditions["notBoundToANode"]
    (mutation,) = spec["mutations"]
    assert mutation["patchType"] == "ApplyConfiguration"
    assert f'name: "{GATE}"' in mutation["applyConfiguration"]["expression"]


def test_pods_without_claims_are_gated_only_in_namespaces_that_opt_in() -> None:
    objects = _gate_objects(name=f"{POLICY}-all-pods")
    policy, binding = objects["MutatingAdmissionPolicy"], objects["MutatingAdmissionPolicyBinding"]
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Ignore"
    namespace_rules = spec["matchConstraints"]["namespaceSelector"]["matchExpressions"]
    assert {"key": "fractional.dev/placement", "operator": "In", "values": ["all-pods"]} in namespace_rules
    assert {"key": LABEL, "operator": "NotIn", "values": ["disabled"]} in namespace_rules
    # never the release's own namespace: the controller's pods must not wait for the controller
    (names,) = [r for r in namespace_rules if r["key"] == "kubernetes.io/metadata.name"]
    assert names["operator"] == "NotIn" and {"fractional-system", "kube-system"} <= set(names["values"])
    conditions = {c["name"]: c["expression"] for c in spec["matchConditions"]}
    assert set(conditions) == {"usesNoResourceClaims", "notBoundToANode", "notADaemonSetPod"}
    assert "DaemonSet" in conditions["notADaemonSetPod"]
    (mutation,) = spec["mutations"]
    assert f'name: "{GATE}"' in mutation["applyConfiguration"]["expression"]


def test_namespaces_and_pods_opt_out_by_label_and_kube_system_is_excluded() -> None:
    constraints = _gate_objects()["MutatingAdmissionPolicy"]["spec"]["matchConstraints"]
    opt_out = {"key": LABEL, "operator": "NotIn", "values": ["disabled"]}
    assert constraints["objectSelector"]["matchExpressions"] == [opt_out]
    namespace_rules = constraints["namespaceSelector"]["matchExpressions"]
    assert opt_out in namespace_rules
    assert {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system"]} in (
        namespace_rules
    )


def test_excluded_namespaces_are_configurable() -> None:
    constraints = _gate_objects({"autoGate": {"excludeNamespaces": ["kube-system", "batch-legacy"]}})[
        "MutatingAdmissionPolicy"
    ]["spec"]["matchConstraints"]
    rules = constraints["namespaceSelector"]["matchExpressions"]
    names = [e for e in rules if e["key"].startswith("kubernetes")]
    assert names == [
        {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system", "batch-legacy"]}
    ]


@pytest.mark.parametrize(
    "values",
    [{"autoGate": {"enabled": False}}, {"controller": {"enabled": False}}],
    ids=["auto-gate-off", "no-controller"],
)
def test_no_policy_when_off_or_without_a_controller(values: dict[str, Any]) -> None:
    # Without a controller nothing would ever remove the gate: pods would wait forever.
    assert _gate_objects(values) == {}


def test_an_older_cluster_can_be_given_the_beta_api() -> None:
    objects = _gate_objects({"autoGate": {"apiVersion": "admissionregistration.k8s.io/v1beta1"}})
    assert {obj["apiVersion"] for obj in objects.values()} == {"admissionregistration.k8s.io/v1beta1"}


def test_a_wrong_api_version_fails_install() -> None:
    with pytest.raises(helm.HelmValuesError, match="autoGate"):
        render_chart({"autoGate": {"apiVersion": "admissionregistration.k8s.io/v2"}})


def test_the_notes_say_how_pods_are_gated_and_how_to_opt_out() -> None:
    notes = render_notes()
    assert POLICY in notes and f"{LABEL}=disabled" in notes and "SchedulingGated" in notes
