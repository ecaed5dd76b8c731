"""More server-side rules of the embedded API emulator (a test double), taken from upstream's
``pkg/apis/core/validation`` (pods) and ``pkg/apis/resource/validation`` (device class names and
CEL selectors, which kube-apiserver compiles at admission):

- a pod needs at least one container; on update, its spec may change only where
  ``ValidatePodUpdate`` allows it (images, ``activeDeadlineSeconds``, added tolerations,
  ``terminationGracePeriodSeconds`` from negative to 1, removed scheduling gates, and, while the
  pod is gated, added ``nodeSelector`` entries and node affinity);
- scheduling gates can only be removed;
- ``deviceClassName`` is a DNS subdomain; every CEL selector compiles in the DRA environment
  (``driver.allocator.celenv``) and names no variable but ``device``;
- a PriorityClass (``pkg/apis/scheduling/validation``): a name with the ``system-`` prefix only for
  the two known system classes, at their value; any other class at most 1000000000
  (``HighestUserDefinablePriority``);
- a ValidatingWebhookConfiguration: the rules of ``webhook_rules``.
"""

from __future__ import annotations

import copy
from typing import Any

from driver.allocator.celenv import SelectorError, compile_selector
from driver.cluster.apiserver.formats import Causes, dns_subdomain, go_quote
from driver.cluster.apiserver.policy import SYSTEM_PRIORITY_CLASSES
from driver.cluster.apiserver.store import ResourceType
from driver.cluster.apiserver.webhook_rules import check_webhook_configuration

__all__ = ["check_core_rules"]

Obj = dict[str, Any]
POD_UPDATE_FORBIDDEN = (
    "Forbidden: pod updates may not change fields other than `spec.containers[*].image`,"
    "`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` (only additions to "
    "existing tolerations),`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was "
    "previously negative)"
)


def _check_pod(spec: Obj, causes: Causes) -> None:
    if not spec.get("containers"):
        causes.append(("spec.containers", "Required value"))


def _check_pod_update(spec: Obj, old_spec: Obj, causes: Causes) -> None:
    old_gates = {gate.get("name") for gate in old_spec.get("schedulingGates") or []}
    for index, gate in enumerate(spec.get("schedulingGates") or []):
        if gate.get("name") not in old_gates:
            causes.append(
                (
                    f"spec.schedulingGates[{index}].name",
                    "Forbidden: only deletion is allowed, but found new scheduling gate "
                    f"'{gate.get('name')}'",
                )
            )
    old_tolerations = old_spec.get("tolerations") or []
    tolerations = spec.get("tolerations") or []
    if any(toleration not in tolerations for toleration in old_tolerations):
        causes.append(
            (
                "spec.tolerations",
                "Forbidden: existing toleration can not be modified except its tolerationSeconds",
            )
        )
    munged = copy.deepcopy(spec)
    for field in ("containers", "initContainers"):
        new_list, old_list = munged.get(field) or [], old_spec.get(field) or []
        if len(new_list) == len(old_list):
            for new_container, old_container in zip(new_list, old_list, strict=True):
                if "image" in old_container:
                    new_container["image"] = old_container["image"]
    for field in ("activeDeadlineSeconds", "tolerations", "schedulingGates"):
        _same(munged, old_spec, field)
    grace, old_grace = (
        spec.get("terminationGracePeriodSeconds"),
        old_spec.get("terminationGracePeriodSeconds"),
    )
    if grace == 1 and isinstance(old_grace, int) and old_grace < 0:
        _same(munged, old_spec, "terminationGracePeriodSeconds")
    if old_spec.get("schedulingGates"):  # a gated pod may narrow where it runs
        old_selector = old_spec.get("nodeSelector") or {}
        if all((spec.get("nodeSelector") or {}).get(key) == value for key, value in old_selector.items()):
            _same(munged, old_spec, "nodeSelector")
        else:
            causes.append(
                (
                    "spec.nodeSelector",
                    "Invalid value: only additions to spec.nodeSelector are allowed "
                    "(no mutations or deletions)",
                )
            )
        if not old_spec.get("affinity"):
            _same(munged, old_spec, "affinity")
    if munged != old_spec:
        causes.append(("spec", POD_UPDATE_FORBIDDEN))


def _same(munged: Obj, old_spec: Obj, field: str) -> None:
    if field in old_spec:
        munged[field] = copy.deepcopy(old_spec[field])
    else:
        munged.pop(field, None)


def _check_selectors(selectors: Any, base: str, causes: Causes) -> None:
    for index, selector in enumerate(selectors or []):
        expression = ((selector or {}).get("cel") or {}).get("expression")
        if not isinstance(expression, str):
            continue
        field = f"{base}[{index}].cel.expression"
        try:
            compiled = compile_selector(expression)
        except SelectorError as error:
            # cel-go's wording: "compilation failed: ERROR: <input>:1:45: ..." with its caret lines
            text, prefix = str(error.__cause__ or ""), f"Failed to parse expression '{expression}': "
            problem = (
                "compilation failed: " + text[len(prefix) :].replace("\n| ", "\n | ")
                if text.startswith(prefix)
                else str(error)
            )
            causes.append((field, f"Invalid value: {go_quote(expression)}: {problem}"))
            continue
        unknown = sorted(set(compiled.program.references()["variables"]) - {"device"})
        if unknown:
            causes.append(
                (
                    field,
                    f"Invalid value: {go_quote(expression)}: compilation failed: ERROR: <input>: "
                    f"undeclared reference to '{unknown[0]}' (in container '')",
                )
            )


def _check_requests(devices: Obj, base: str, causes: Causes) -> None:
    for index, request in enumerate(devices.get("requests") or []):
        field = f"{base}.requests[{index}]"
        subrequests = []
        if isinstance(request.get("exactly"), dict):
            subrequests.append((f"{field}.exactly", request["exactly"]))
        for sub_index, sub in enumerate(request.get("firstAvailable") or []):
            subrequests.append((f"{field}.firstAvailable[{sub_index}]", sub))
        for sub_field, sub in subrequests:
            name = sub.get("deviceClassName")
            if name is not None and (problem := dns_subdomain(name)):
                causes.append((f"{sub_field}.deviceClassName", problem))
            _check_selectors(sub.get("selectors"), f"{sub_field}.selectors", causes)


HIGHEST_USER_DEFINABLE_PRIORITY = 1000000000
_SYSTEM_PREFIX = "system-"


def _check_priority_class(obj: Obj, causes: Causes) -> None:
    name = str((obj.get("metadata") or {}).get("name", ""))
    value = obj.get("value")
    if name.startswith(_SYSTEM_PREFIX):
        known = SYSTEM_PRIORITY_CLASSES.get(name)
        if known is None:
            problem = f"{name} is not a known system priority class"
        elif value != known:
            problem = f"value of {name} PriorityClass must be {known}"
        else:
            return
        causes.append(
            (
                "metadata.name",
                f"Forbidden: priority class names with '{_SYSTEM_PREFIX}' prefix are reserved for system "
                f"use only. error: {problem}",
            )
        )
    elif isinstance(value, int) and value > HIGHEST_USER_DEFINABLE_PRIORITY:
        causes.append(
            (
                "value",
                "Forbidden: maximum allowed value of a user defined priority is "
                f"{HIGHEST_USER_DEFINABLE_PRIORITY}",
            )
        )


def check_core_rules(rtype: ResourceType, obj: Obj, old: Obj | None) -> Causes:
    """(field, problem) for each rule broken; ``old`` is the stored object on an update."""
    causes: Causes = []
    spec = obj.get("spec") or {}
    if rtype.plural == "pods" and not rtype.group:
        _check_pod(spec, causes)
        if old is not None:
            _check_pod_update(spec, old.get("spec") or {}, causes)
    elif rtype.group == "resource.k8s.io" and rtype.plural == "resourceclaims":
        if old is None:
            _check_requests(spec.get("devices") or {}, "spec.devices", causes)
    elif rtype.group == "resource.k8s.io" and rtype.plural == "resourceclaimtemplates":
        _check_requests((spec.get("spec") or {}).get("devices") or {}, "spec.spec.devices", causes)
    elif rtype.group == "resource.k8s.io" and rtype.plural == "deviceclasses":
        _check_selectors(spec.get("selectors"), "spec.selectors", causes)
    elif rtype.group == "scheduling.k8s.io" and rtype.plural == "priorityclasses":
        _check_priority_class(obj, causes)
    elif rtype.group == "admissionregistration.k8s.io" and rtype.plural == "validatingwebhookconfigurations":
        causes.extend(check_webhook_configuration(obj))
    return causes
