"""Evaluate the chart's ValidatingAdmissionPolicies the way kube-apiserver does, in Python.

Neither the API emulator nor any other test double runs admission policies, so the chart tests
evaluate the rendered policies' CEL themselves with the ``cel`` module (package
``common-expression-language``, cel-rust). The steps follow kube-apiserver's validating admission
policy plugin (k8s.io/apiserver/pkg/admission/plugin/policy/validating):

1. ``matchConstraints.resourceRules``: API group, resource (``resourceclaims/status`` for the
   status subresource) and operation; ``matchPolicy: Equivalent`` ignores the version.
2. ``matchConditions``: all must be true, else the policy does not apply (the request passes).
3. ``variables``: evaluated in order, each seeing the earlier ones as ``variables.<name>``
   (upstream evaluates them lazily, on first use; ours are cheap and error-free, and an error fails
   the request either way under ``failurePolicy: Fail``).
4. ``validations``: every false one denies the request with its ``message`` or evaluated
   ``messageExpression``. An evaluation error is a denial too (``failurePolicy: Fail``); results
   keep errors apart from false validations so that a test of a forbidden request can tell a
   policy that denies it from one that merely fails to evaluate.

What is not modelled: kube-apiserver answers a denial with 422 Invalid (a validation without
``reason``) and reports only the first false validation; and it runs its own validation and the
granular status authorization before admission, so some forbidden requests never reach a policy.
tests/e2e/test_policies_real.py replays every case on the real server and records those.

Inputs are built as kube-apiserver builds them: ``object`` and ``oldObject`` are the objects as
stored (for a patch, ``object`` is the patched object) and ``request`` is the AdmissionRequest
converted to a map with empty fields left out (JSON ``omitempty``: no ``subResource`` on a main
resource, no ``userInfo.extra`` for a user without extras). ``object`` is null for DELETE.

No Kubernetes CEL library function had to be re-implemented: the chart's expressions keep to
what both CEL implementations share (``has``, ``dyn``, ``size``, ``in``, macros, ``+`` on
lists); the optional syntax (``.?``, ``[?]``) and ``cel.bind``, which the Python library cannot
parse, are left out of the chart on purpose (templates/_policy-helpers.tpl).
"""

from __future__ import annotations

import copy
import uuid
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import cel

__all__ = [
    "Decision",
    "admission_request",
    "apply_merge_patch",
    "evaluate",
    "policy_matches",
    "service_account_user",
]

Obj = dict[str, Any]


@dataclass(frozen=True)
class Decision:
    applies: bool  # false: not matched by the rules or the match conditions
    denials: tuple[str, ...] = ()  # messages of the validations that were false
    errors: tuple[str, ...] = field(default=())  # evaluation errors (also a denial: failurePolicy Fail)

    @property
    def allowed(self) -> bool:
        return not self.denials and not self.errors


@cache
def _program(expression: str) -> Any:
    return cel.compile(expression)


def _run(expression: str, activation: Obj) -> Any:
    # A fresh deep copy per evaluation: the binding keeps no reference into the test's objects.
    return _program(expression).execute(cel.Context(variables=copy.deepcopy(activation)))


def service_account_user(namespace: str, name: str, *, node: str | None = None) -> Obj:
    """``request.userInfo`` of a service account token bound to a pod (on ``node`` if given).

    The extras are the ones kube-apiserver sets for a pod-bound token (pod name and UID, credential
    ID, and with ServiceAccountTokenPodNodeInfo the node's name and UID)."""
    extra: dict[str, list[str]] = {
        "authentication.kubernetes.io/credential-id": [f"JTI={uuid.uuid4()}"],
        "authentication.kubernetes.io/pod-name": [f"{name}-x7k2p"],
        "authentication.kubernetes.io/pod-uid": [str(uuid.uuid4())],
    }
    if node is not None:
        extra["authentication.kubernetes.io/node-name"] = [node]
        extra["authentication.kubernetes.io/node-uid"] = [str(uuid.uuid4())]
    return {
        "username": f"system:serviceaccount:{namespace}:{name}",
        "uid": str(uuid.uuid4()),
        "groups": ["system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated"],
        "extra": extra,
    }


_KINDS = {
    ("", "pods"): ("", "v1", "Pod"),
    ("resource.k8s.io", "resourceclaims"): ("resource.k8s.io", "v1", "ResourceClaim"),
    ("resource.k8s.io", "resourceslices"): ("resource.k8s.io", "v1", "ResourceSlice"),
    ("apps", "deployments"): ("apps", "v1", "Deployment"),
}

_SUBRESOURCE_KINDS = {("", "pods", "eviction"): ("policy", "v1", "Eviction")}


def admission_request(
    *,
    user: Obj,
    operation: str,
    group: str,
    resource: str,
    subresource: str = "",
    meta: Obj,
) -> Obj:
    """An AdmissionRequest as the policy plugin sees it: a map, empty fields left out. ``meta`` is
    the metadata of the object (name, namespace)."""
    # A subresource whose body is a kind of its own (pods/eviction takes a policy/v1 Eviction).
    kind_group, version, kind = (
        _SUBRESOURCE_KINDS.get((group, resource, subresource)) or _KINDS[(group, resource)]
    )
    request: Obj = {
        "uid": str(uuid.uuid4()),
        "kind": {"group": kind_group, "version": version, "kind": kind},
        "resource": {"group": group, "version": version, "resource": resource},
        "requestKind": {"group": kind_group, "version": version, "kind": kind},
        "requestResource": {"group": group, "version": version, "resource": resource},
        "name": meta.get("name", ""),
        "operation": operation,
        "userInfo": {key: value for key, value in user.items() if value},
        "dryRun": False,
    }
    if subresource:
        request["subResource"] = subresource
        request["requestSubResource"] = subresource
    if meta.get("namespace"):
        request["namespace"] = meta["namespace"]
    if operation == "UPDATE":
        request["options"] = {"kind": "UpdateOptions", "apiVersion": "meta.k8s.io/v1"}
    elif operation == "CREATE":
        request["options"] = {"kind": "CreateOptions", "apiVersion": "meta.k8s.io/v1"}
    return request


def policy_matches(policy: Obj, request: Obj) -> bool:
    """``matchConstraints.resourceRules`` (no namespace or object selectors in our policies)."""
    constraints = policy["spec"]["matchConstraints"]
    assert constraints.get("matchPolicy") == "Equivalent"
    assert "namespaceSelector" not in constraints and "objectSelector" not in constraints
    resource = request["resource"]["resource"]
    if request.get("subResource"):
        resource += "/" + request["subResource"]
    for rule in constraints["resourceRules"]:
        if (
            request["resource"]["group"] in rule["apiGroups"]
            and resource in rule["resources"]
            and request["operation"] in rule["operations"]
        ):
            return True
    return False


def evaluate(policy: Obj, request: Obj, *, obj: Obj | None, old: Obj | None) -> Decision:
    """The policy's decision on ``request`` with ``object`` = obj and ``oldObject`` = old."""
    if not policy_matches(policy, request):
        return Decision(applies=False)
    spec = policy["spec"]
    activation: Obj = {"object": obj, "oldObject": old, "request": request}
    try:
        for condition in spec.get("matchConditions", ()):
            if _run(condition["expression"], activation) is not True:
                return Decision(applies=False)
    except Exception as error:  # a match condition error fails the request (failurePolicy Fail)
        return Decision(applies=True, errors=(f"matchCondition: {error}",))
    variables: Obj = {}
    errors: list[str] = []
    for variable in spec.get("variables", ()):
        try:
            variables[variable["name"]] = _run(variable["expression"], {**activation, "variables": variables})
        except Exception as error:
            errors.append(f"variables.{variable['name']}: {error}")
    if errors:
        return Decision(applies=True, errors=tuple(errors))
    denials: list[str] = []
    for validation in spec["validations"]:
        scope = {**activation, "variables": variables}
        try:
            result = _run(validation["expression"], scope)
        except Exception as error:
            errors.append(f"{validation['expression'][:60]}...: {error}")
            continue
        if result is not True:
            if "messageExpression" in validation:
                denials.append(str(_run(validation["messageExpression"], scope)))
            else:
                denials.append(validation.get("message", validation["expression"]))
    return Decision(applies=True, denials=tuple(denials), errors=tuple(errors))


def apply_merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (what the API server applies for application/merge-patch+json)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = apply_merge_patch(result.get(key), value)
    return result
