"""Validating admission webhooks of the embedded API emulator (a test double), chosen and judged
as kube-apiserver's ValidatingAdmissionWebhook plugin does (``k8s.io/apiserver``'s
``pkg/admission/plugin/webhook``: ``generic/webhook.go`` chooses the hooks, ``predicates/`` match
rules and selectors, ``matchconditions/`` filters, ``validating/dispatcher.go`` calls and decides);
``webhook_calls`` makes each call.

The server hands every write it admits to :meth:`ValidatingWebhooks.admit` (create, update,
patch, apply, delete, deletecollection, and the status, finalize, binding and eviction
subresources) after defaulting and validation and before storing, with the object as it would be
stored; a dry run too (with ``dryRun: true``). Each webhook of each ValidatingWebhookConfiguration
(by configuration name, then in order) is called when its ``namespaceSelector``, ``objectSelector``
(old or new object), ``rules`` and ``matchConditions`` select the request. A refusal answers the
webhook's status (code at least 400, ``admission webhook "NAME" denied the request: ...``); a call
that fails (unreachable, timed out after ``timeoutSeconds``, an invalid answer) refuses the write
with 500 ``failed calling webhook "NAME": ...`` under ``failurePolicy: Fail``, and is ignored under
``Ignore``. Warnings of the answers go to the response's ``Warning`` headers. The configurations
themselves (and the other admissionregistration.k8s.io kinds) are never sent to webhooks.

Departures from kube-apiserver:

- ``clientConfig.service``: the emulator serves no Services and resolves none; such a call fails as
  one to a Service that does not exist, and ``failurePolicy`` decides (``webhook_calls``).
- ``matchPolicy: Equivalent`` matches only the version served (the emulator serves each resource at
  one version; events.k8s.io Events are not sent as equivalents of core ones, and writes through
  events.k8s.io other than a patch reach webhooks as the core/v1 Events they are stored as).
- ``matchConditions`` cannot use ``authorizer`` (the emulator authorizes nothing): such an
  expression fails to evaluate, with a message saying so, and ``failurePolicy`` decides.
- The hooks of one request are called at once, one thread each, as upstream calls them; the answer
  is the first refusal in configuration and webhook order (upstream: the first to arrive). Audit
  annotations are dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import cel

from driver.cluster.apiserver.formats import go_quote
from driver.cluster.apiserver.selectors import match_label_selector
from driver.cluster.apiserver.store import StatusError
from driver.cluster.apiserver.webhook_calls import Attributes, Operation, admission_request, call_webhook
from driver.cluster.apiserver.webhook_rules import compile_condition

__all__ = ["Attributes", "Operation", "ValidatingWebhooks"]

log = logging.getLogger(__name__)

Obj = dict[str, Any]
_EXEMPT_KINDS = frozenset({
    "ValidatingWebhookConfiguration", "MutatingWebhookConfiguration", "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding", "MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding",
})  # fmt: skip


class ValidatingWebhooks:
    """The ValidatingAdmissionWebhook plugin of one server: reads the configurations and the
    namespaces through the callables it is given, on each request (no cache, so a configuration
    written is in force for the next request)."""

    def __init__(self, *, configurations: Callable[[], list[Obj]], namespace: Callable[[str], Obj]) -> None:
        self._configurations = configurations
        self._namespace = namespace  # raises StatusError 404 for a missing namespace

    def admit(self, attributes: Attributes, warnings: list[str]) -> None:
        """Call every webhook that selects the request; raise ``StatusError`` when one refuses it or
        fails under ``failurePolicy: Fail``. The answers' warnings are appended to ``warnings``."""
        if (
            attributes.rtype.group == "admissionregistration.k8s.io"
            and attributes.rtype.kind in _EXEMPT_KINDS
        ):
            return
        configurations = self._configurations()
        if not configurations:
            return
        hooks = [
            hook
            for configuration in configurations
            for hook in configuration.get("webhooks") or ()
            if self._selects(hook, attributes)
        ]
        if not hooks:
            return
        if len(hooks) == 1:
            outcomes = [call_webhook(hooks[0], attributes)]
        else:
            with ThreadPoolExecutor(max_workers=len(hooks), thread_name_prefix="apiserver-webhook") as pool:
                outcomes = list(pool.map(lambda hook: call_webhook(hook, attributes), hooks))
        first: StatusError | None = None
        for hook, outcome in zip(hooks, outcomes, strict=True):
            warnings.extend(outcome.warnings)
            error = outcome.refusal
            if outcome.failure is not None:
                reason = f"failed calling webhook {go_quote(hook['name'])}: {outcome.failure}"
                if hook.get("failurePolicy") == "Ignore":
                    log.warning("webhook call failed, failing open", extra={"webhook": hook["name"]})
                    continue
                error = _internal_error(reason)
            if error is not None and first is None:
                first = error
        if first is not None:
            raise first

    # which hooks (generic/webhook.go ShouldCallHook) -------------------------------------------

    def _selects(self, hook: Obj, attributes: Attributes) -> bool:
        namespace_matches, namespace_error = self._namespace_matches(hook, attributes)
        if not namespace_matches and namespace_error is None:
            return False
        if not _object_matches(hook, attributes):
            return False
        if not any(_rule_matches(rule, attributes) for rule in hook.get("rules") or ()):
            return False
        if namespace_error is not None:
            raise namespace_error
        return _conditions_match(hook, attributes)

    def _namespace_matches(self, hook: Obj, attributes: Attributes) -> tuple[bool, StatusError | None]:
        """predicates/namespace: cluster-scoped requests (but Namespaces) always match; a Namespace
        written is judged by its new labels, anything else by its namespace's stored labels."""
        if not attributes.namespace and attributes.rtype.plural != "namespaces":
            return True, None
        selector = hook.get("namespaceSelector") or {}
        if not selector.get("matchLabels") and not selector.get("matchExpressions"):
            return True, None
        if (
            attributes.rtype.plural == "namespaces"
            and not attributes.subresource
            and attributes.operation in (Operation.CREATE, Operation.UPDATE)
        ):
            labels = _labels(attributes.obj)
        else:
            try:
                labels = _labels(self._namespace(attributes.namespace))
            except StatusError as error:
                if error.code != 404:
                    raise
                return False, error
        return match_label_selector(selector, labels), None


def _labels(obj: Obj | None) -> dict[str, str]:
    return dict(((obj or {}).get("metadata") or {}).get("labels") or {})


def _object_matches(hook: Obj, attributes: Attributes) -> bool:
    """predicates/object: an empty selector matches; else the new or the old object must match."""
    selector = hook.get("objectSelector") or {}
    if not selector.get("matchLabels") and not selector.get("matchExpressions"):
        return True
    return any(
        candidate is not None and match_label_selector(selector, _labels(candidate))
        for candidate in (attributes.obj, attributes.old)
    )


def _rule_matches(rule: Obj, attributes: Attributes) -> bool:
    """predicates/rules: scope, operation, group, version, and resource with subresource."""
    rtype = attributes.rtype
    is_namespace = rtype.group == "" and rtype.plural == "namespaces"
    scope = rule.get("scope") or "*"
    if scope == "Namespaced" and (is_namespace or not attributes.namespace):
        return False
    if scope == "Cluster" and not (is_namespace or not attributes.namespace):
        return False
    if scope not in ("*", "Namespaced", "Cluster"):
        return False
    operations = rule.get("operations") or ()
    if "*" not in operations and attributes.operation.value not in operations:
        return False
    for values, wanted in ((rule.get("apiGroups"), rtype.group), (rule.get("apiVersions"), rtype.version)):
        if "*" not in (values or ()) and wanted not in (values or ()):
            return False
    for entry in rule.get("resources") or ():
        resource, _, subresource = str(entry).partition("/")
        if resource in ("*", rtype.plural) and subresource in ("*", attributes.subresource):
            return True
    return False


# matchConditions (matchconditions/matcher.go) ------------------------------------------------


def _conditions_match(hook: Obj, attributes: Attributes) -> bool:
    """False as soon as one condition is false; errors (without a false) follow ``failurePolicy``:
    403 under Fail, the hook skipped under Ignore."""
    conditions = hook.get("matchConditions") or ()
    if not conditions:
        return True
    variables = {
        "object": attributes.obj,
        "oldObject": attributes.old,
        "request": admission_request(attributes, uid="", omit_empty=False),
    }
    errors: list[str] = []
    for condition in conditions:
        expression = str(condition.get("expression", ""))
        result, problem = _evaluate(expression, variables)
        if problem is not None:
            errors.append(problem)
        elif result is False:
            return False
    if not errors:
        return True
    if hook.get("failurePolicy") == "Ignore":
        return False
    unique = list(dict.fromkeys(errors))  # apimachinery's aggregate drops repeats
    message = unique[0] if len(unique) == 1 else "[" + ", ".join(unique) + "]"
    rtype = attributes.rtype
    resource = rtype.qualified
    where = f'{resource} "{attributes.name}"' if attributes.name else resource
    raise StatusError(
        code=403,
        reason="Forbidden",
        message=f"{where} is forbidden: {message}",
        details={
            "group": rtype.group,
            "kind": rtype.plural,
            **({"name": attributes.name} if attributes.name else {}),
        },
    )


def _evaluate(expression: str, variables: Obj) -> tuple[Any, str | None]:
    """(result, None), or (None, the error as upstream's condition evaluator words it)."""
    try:
        program = compile_condition(expression)
    except ValueError as error:
        return None, f"compilation error: {error}"
    try:
        result = program.execute(cel.Context(variables=variables))
    except KeyError as error:
        return None, f"expression '{expression}' resulted in error: no such key: {error.args[0]}"
    except Exception as error:  # the cel library's evaluation errors have no common base class
        text = str(error)
        if "authorizer" in text:
            text = "authorizer is not supported by the API emulator (a test double): it authorizes nothing"
        return None, f"expression '{expression}' resulted in error: {text}"
    if not isinstance(result, bool):
        return None, f"expression '{expression}' resulted in error: must evaluate to bool"
    return result, None


def _internal_error(reason: str) -> StatusError:
    """apimachinery's NewInternalError."""
    return StatusError(
        code=500,
        reason="InternalError",
        message=f"Internal error occurred: {reason}",
        details={"causes": [{"message": reason}]},
    )
