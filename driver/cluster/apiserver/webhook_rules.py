"""ValidatingWebhookConfiguration as kube-apiserver writes it, for the embedded API emulator (a test
double): the v1 defaults (``pkg/apis/admissionregistration/v1/defaults.go``) and the server-side
rules (``pkg/apis/admissionregistration/validation/validation.go``, with ``ValidateWebhookURL`` and
``ValidateWebhookService`` of ``k8s.io/apiserver/pkg/util/webhook``), worded as the real server words
them. Problems are (field, message) causes.

Departures: a ``matchConditions`` expression is compiled by the ``cel`` library, which knows no
types: an expression that compiles but is not boolean is accepted here (kube-apiserver refuses it
with "must evaluate to bool") and fails when it is evaluated. The relaxations an update grants to
a stored object that older servers accepted do not apply: every object stored here passed these
rules when it was written.
"""

from __future__ import annotations

import functools
import json
import re
import urllib.parse
from typing import Any

import cel

from driver.cluster.apiserver.formats import (
    Causes,
    dns_subdomain_problems,
    go_quote,
    label_name,
    label_value_problems,
    unsupported,
)

__all__ = [
    "ADMISSION_REVIEW_VERSIONS",
    "compile_condition",
    "compile_problem",
    "check_webhook_configuration",
    "default_webhook_configuration",
    "required_field_causes",
]

Obj = dict[str, Any]
ADMISSION_REVIEW_VERSIONS = ("v1", "v1beta1")  # the AdmissionReview versions kube-apiserver sends
_OPERATIONS = ("*", "CONNECT", "CREATE", "DELETE", "UPDATE")  # sorted, as sets.String.List() is
_SCOPES = ("*", "Cluster", "Namespaced")
_FAILURE_POLICIES = ("Fail", "Ignore")
_MATCH_POLICIES = ("Equivalent", "Exact")
_SIDE_EFFECTS = ("None", "NoneOnDryRun")  # v1 writes may name no other class
_MAX_MATCH_CONDITIONS = 64
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_1035_MESSAGE = (
    "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an "
    "alphabetic character, and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', regex "
    "used for validation is '[a-z]([-a-z0-9]*[a-z0-9])?')"
)
_URL_FORM = "; desired format: https://host[/path]"


# -- defaults ---------------------------------------------------------------------------------


def default_webhook_configuration(obj: Obj) -> Obj:
    """``obj`` with each webhook's defaults: ``failurePolicy: Fail``, ``matchPolicy: Equivalent``,
    empty ``namespaceSelector`` and ``objectSelector``, ``timeoutSeconds: 10``; each rule's
    ``scope: "*"``; a service reference's ``port: 443``."""
    webhooks = obj.get("webhooks")
    if not isinstance(webhooks, list):
        return obj
    return {**obj, "webhooks": [_default_webhook(hook) for hook in webhooks]}


def _default_webhook(hook: Any) -> Any:
    if not isinstance(hook, dict):
        return hook
    defaulted = dict(hook)
    for field, value in (("failurePolicy", "Fail"), ("matchPolicy", "Equivalent"), ("timeoutSeconds", 10)):
        if defaulted.get(field) is None:
            defaulted[field] = value
    for field in ("namespaceSelector", "objectSelector"):
        if defaulted.get(field) is None:
            defaulted[field] = {}
    if isinstance(defaulted.get("rules"), list):
        defaulted["rules"] = [
            {**rule, "scope": rule.get("scope") or "*"} if isinstance(rule, dict) else rule
            for rule in defaulted["rules"]
        ]
    client_config = defaulted.get("clientConfig")
    if isinstance(client_config, dict) and isinstance(client_config.get("service"), dict):
        service = client_config["service"]
        if service.get("port") is None:
            defaulted["clientConfig"] = {**client_config, "service": {**service, "port": 443}}
    return defaulted


# -- validation -------------------------------------------------------------------------------


def required_field_causes(obj: Obj) -> Causes:
    """Every cause of :func:`check_webhook_configuration` when a field the schema marks required is
    missing, else none: kube-apiserver reports those through its own rules (``sideEffects: Required
    value: must specify one of None, NoneOnDryRun``), not as the schema's bare "Required value"."""
    for hook in obj.get("webhooks") or ():
        if not isinstance(hook, dict):
            continue
        missing = any(hook.get(field) is None for field in ("name", "clientConfig", "sideEffects"))
        missing = missing or "admissionReviewVersions" not in hook
        service = (
            (hook.get("clientConfig") or {}).get("service")
            if isinstance(hook.get("clientConfig"), dict)
            else None
        )
        if isinstance(service, dict):
            missing = missing or any(service.get(field) is None for field in ("name", "namespace"))
        conditions = hook.get("matchConditions") or ()
        missing = missing or any(
            isinstance(c, dict) and (c.get("name") is None or c.get("expression") is None) for c in conditions
        )
        if missing:
            return check_webhook_configuration(obj)
    return []


def check_webhook_configuration(obj: Obj) -> Causes:
    """(field, problem) for each rule a ValidatingWebhookConfiguration breaks."""
    causes: Causes = []
    names: set[str] = set()
    for index, hook in enumerate(obj.get("webhooks") or ()):
        if not isinstance(hook, dict):
            continue
        base = f"webhooks[{index}]"
        _check_webhook(hook, base, causes)
        _check_review_versions(hook.get("admissionReviewVersions"), f"{base}.admissionReviewVersions", causes)
        name = hook.get("name")
        if isinstance(name, str) and name:
            if name in names:
                causes.append((f"{base}.name", f"Duplicate value: {go_quote(name)}"))
            names.add(name)
    return causes


def _strings(values: Any) -> list[str]:
    return [str(value) for value in values] if isinstance(values, list) else []


def _json_list(values: list[str]) -> str:
    """A list as ``field.Invalid`` prints it: JSON, as Go's encoding/json writes it (compact, with
    ``<``, ``>`` and ``&`` escaped): ``["*","a"]`` (kube-apiserver 1.37.2; it falls back to Go's
    ``%#v`` only for values JSON cannot encode)."""
    text = json.dumps(list(values), separators=(",", ":"), ensure_ascii=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _check_webhook(hook: Obj, base: str, causes: Causes) -> None:
    _fully_qualified_name(hook.get("name"), f"{base}.name", causes)
    for index, rule in enumerate(hook.get("rules") or ()):
        if isinstance(rule, dict):
            _check_rule(rule, f"{base}.rules[{index}]", causes)
    for field, supported in (("failurePolicy", _FAILURE_POLICIES), ("matchPolicy", _MATCH_POLICIES)):
        value = hook.get(field)
        if value is not None and value not in supported:
            causes.append((f"{base}.{field}", unsupported(value, supported)))
    side_effects = hook.get("sideEffects")
    if side_effects is None:
        causes.append(
            (f"{base}.sideEffects", f"Required value: must specify one of {', '.join(_SIDE_EFFECTS)}")
        )
    elif side_effects not in _SIDE_EFFECTS:
        causes.append((f"{base}.sideEffects", unsupported(side_effects, _SIDE_EFFECTS)))
    timeout = hook.get("timeoutSeconds")
    if isinstance(timeout, int) and not 1 <= timeout <= 30:
        causes.append(
            (
                f"{base}.timeoutSeconds",
                f"Invalid value: {timeout}: the timeout value must be between 1 and 30 seconds",
            )
        )
    for field in ("namespaceSelector", "objectSelector"):
        if isinstance(hook.get(field), dict):
            _check_label_selector(hook[field], f"{base}.{field}", causes)
    _check_client_config(hook.get("clientConfig"), f"{base}.clientConfig", causes)
    _check_match_conditions(hook.get("matchConditions"), f"{base}.matchConditions", causes)


def _fully_qualified_name(name: Any, field: str, causes: Causes) -> None:
    """apimachinery's ``IsFullyQualifiedName``: a DNS subdomain of at least three segments."""
    if not isinstance(name, str) or not name:
        causes.append((field, "Required value"))
        return
    problems = dns_subdomain_problems(name)
    if problems:
        detail = ",".join(problem.removeprefix(f"Invalid value: {go_quote(name)}: ") for problem in problems)
        causes.append((field, f"Invalid value: {go_quote(name)}: {detail}"))
    elif len(name.split(".")) < 3:
        causes.append(
            (
                field,
                f"Invalid value: {go_quote(name)}: "
                + "should be a domain with at least three segments separated by dots",
            )
        )


def _star_alone(values: list[str], field: str, what: str, causes: Causes) -> None:
    """``*`` may not stand beside other values (operations, API groups, API versions)."""
    if len(values) > 1 and "*" in values:
        causes.append(
            (field, f"Invalid value: {_json_list(values)}: if '*' is present, must not specify other {what}")
        )


def _check_rule(rule: Obj, base: str, causes: Causes) -> None:
    operations = _strings(rule.get("operations"))
    if not operations:
        causes.append((f"{base}.operations", "Required value"))
    _star_alone(operations, f"{base}.operations", "operations", causes)
    for index, operation in enumerate(operations):
        if operation not in _OPERATIONS:
            causes.append((f"{base}.operations[{index}]", unsupported(operation, _OPERATIONS)))
    groups, versions = _strings(rule.get("apiGroups")), _strings(rule.get("apiVersions"))
    if not groups:
        causes.append((f"{base}.apiGroups", "Required value"))
    _star_alone(groups, f"{base}.apiGroups", "API groups", causes)
    if not versions:
        causes.append((f"{base}.apiVersions", "Required value"))
    _star_alone(versions, f"{base}.apiVersions", "API versions", causes)
    for index, version in enumerate(versions):
        if not version:
            causes.append((f"{base}.apiVersions[{index}]", "Required value"))
    _check_resources(_strings(rule.get("resources")), f"{base}.resources", causes)
    scope = rule.get("scope")
    if scope is not None and scope not in _SCOPES:
        causes.append((f"{base}.scope", unsupported(scope, _SCOPES)))


def _check_resources(resources: list[str], field: str, causes: Causes) -> None:
    """``resource``, ``resource/subresource`` and their wildcards, as ``validateResources`` allows them."""
    if not resources:
        causes.append((field, "Required value"))
    wildcard_subresources: set[str] = set()  # x/*
    wildcard_resources: set[str] = set()  # */x
    double_wildcard = single_wildcard = without_subresource = False
    for index, entry in enumerate(resources):
        if not entry:
            causes.append((f"{field}[{index}]", "Required value"))
            continue
        double_wildcard = double_wildcard or entry == "*/*"
        single_wildcard = single_wildcard or entry == "*"
        resource, slash, subresource = entry.partition("/")
        if not slash:
            without_subresource = entry != "*"
            continue
        if resource in wildcard_subresources:
            causes.append(
                (f"{field}[{index}]", f"Invalid value: {go_quote(entry)}: "
                 f"if '{resource}/*' is present, must not specify {entry}")
            )  # fmt: skip
        if subresource in wildcard_resources:
            causes.append(
                (f"{field}[{index}]", f"Invalid value: {go_quote(entry)}: "
                 f"if '*/{subresource}' is present, must not specify {entry}")
            )  # fmt: skip
        if subresource == "*":
            wildcard_subresources.add(resource)
        if resource == "*":
            wildcard_resources.add(subresource)
    if len(resources) > 1 and double_wildcard:
        causes.append(
            (field, f"Invalid value: {_json_list(resources)}: "
             "if '*/*' is present, must not specify other resources")
        )  # fmt: skip
    if single_wildcard and without_subresource:
        causes.append(
            (field, f"Invalid value: {_json_list(resources)}: "
             "if '*' is present, must not specify other resources without subresources")
        )  # fmt: skip


def _check_label_selector(selector: Obj, base: str, causes: Causes) -> None:
    """metav1 ``ValidateLabelSelector``: label names and values, operators and their values."""
    match_labels = selector.get("matchLabels")
    for key, value in (match_labels if isinstance(match_labels, dict) else {}).items():
        causes.extend((f"{base}.matchLabels", problem) for problem in label_name(str(key)))
        causes.extend((f"{base}.matchLabels", problem) for problem in label_value_problems(str(value)))
    for index, requirement in enumerate(selector.get("matchExpressions") or ()):
        if not isinstance(requirement, dict):
            continue
        field = f"{base}.matchExpressions[{index}]"
        operator, values = requirement.get("operator"), _strings(requirement.get("values"))
        if operator in ("In", "NotIn"):
            if not values:
                causes.append(
                    (
                        f"{field}.values",
                        "Required value: must be specified when `operator` is 'In' or 'NotIn'",
                    )
                )
        elif operator in ("Exists", "DoesNotExist"):
            if values:
                causes.append(
                    (
                        f"{field}.values",
                        "Forbidden: may not be specified when `operator` is 'Exists' or 'DoesNotExist'",
                    )
                )
        else:
            causes.append(
                (
                    f"{field}.operator",
                    f"Invalid value: {go_quote(str(operator))}: not a valid selector operator",
                )
            )
        causes.extend((f"{field}.key", problem) for problem in label_name(str(requirement.get("key") or "")))
        for value_index, value in enumerate(values):
            causes.extend(
                (f"{field}.values[{value_index}]", problem) for problem in label_value_problems(value)
            )


def _check_client_config(client_config: Any, base: str, causes: Causes) -> None:
    client_config = client_config if isinstance(client_config, dict) else {}
    url, service = client_config.get("url"), client_config.get("service")
    if (url is None) == (service is None):
        causes.append((base, "Required value: exactly one of url or service is required"))
    elif url is not None:
        _check_url(str(url), f"{base}.url", causes)
    elif isinstance(service, dict):
        _check_service(service, f"{base}.service", causes)


def _check_url(url: str, field: str, causes: Causes) -> None:
    """``ValidateWebhookURL`` with https forced."""
    try:
        parsed = urllib.parse.urlsplit(url)
    except ValueError as error:
        causes.append((field, f"Required value: url must be a valid URL: {error}{_URL_FORM}"))
        return
    if parsed.scheme != "https":
        causes.append(
            (
                field,
                f"Invalid value: {go_quote(parsed.scheme)}: "
                f"'https' is the only allowed URL scheme{_URL_FORM}",
            )
        )
    host = parsed.netloc.rpartition("@")[2]
    if not host:
        causes.append((field, f'Invalid value: "": host must be specified{_URL_FORM}'))
    if "@" in parsed.netloc:
        user = parsed.netloc.rpartition("@")[0]
        causes.append(
            (field, f"Invalid value: {go_quote(user)}: user information is not permitted in the URL")
        )
    if parsed.fragment:
        causes.append(
            (field, f"Invalid value: {go_quote(parsed.fragment)}: fragments are not permitted in the URL")
        )
    if parsed.query:
        causes.append(
            (field, f"Invalid value: {go_quote(parsed.query)}: query parameters are not permitted in the URL")
        )


def _check_service(service: Obj, base: str, causes: Causes) -> None:
    """``ValidateWebhookService``: name, namespace, port, and a path of DNS-subdomain segments."""
    if not service.get("name"):
        causes.append((f"{base}.name", "Required value"))
    if not service.get("namespace"):
        causes.append((f"{base}.namespace", "Required value"))
    port = service.get("port", 443)
    if isinstance(port, int) and not 1 <= port <= 65535:
        causes.append(
            (
                f"{base}.port",
                f"Invalid value: {port}: port is not valid: must be between 1 and 65535, inclusive",
            )
        )
    path = service.get("path")
    if not isinstance(path, str) or path in ("", "/"):
        return
    field, quoted = f"{base}.path", go_quote(path)
    if path == "//":
        causes.append((field, f"Invalid value: {quoted}: segment[0] may not be empty"))
        return
    if not path.startswith("/"):
        causes.append((field, f"Invalid value: {quoted}: must start with a '/'"))
    steps = path[1:].removesuffix("/").split("/")
    for index, step in enumerate(steps):
        if not step:
            causes.append((field, f"Invalid value: {quoted}: segment[{index}] may not be empty"))
            continue
        for problem in dns_subdomain_problems(step):
            text = problem.removeprefix(f"Invalid value: {go_quote(step)}: ")
            causes.append((field, f"Invalid value: {quoted}: segment[{index}]: {text}"))


def _check_review_versions(versions: Any, field: str, causes: Causes) -> None:
    versions = _strings(versions)
    if not versions:
        causes.append((field, f"Required value: must specify one of {', '.join(ADMISSION_REVIEW_VERSIONS)}"))
        return
    seen: set[str] = set()
    for index, version in enumerate(versions):
        if version in seen:
            causes.append((f"{field}[{index}]", f"Invalid value: {go_quote(version)}: duplicate version"))
            continue
        seen.add(version)
        if len(version) > 63:
            causes.append(
                (
                    f"{field}[{index}]",
                    f"Invalid value: {go_quote(version)}: must be no more than 63 characters",
                )
            )
        if not _DNS_1035.fullmatch(version):
            causes.append((f"{field}[{index}]", f"Invalid value: {go_quote(version)}: {_DNS_1035_MESSAGE}"))
    if not seen & set(ADMISSION_REVIEW_VERSIONS):
        causes.append(
            (field, f"Invalid value: {_json_list(versions)}: must include at least one of "
             f"{', '.join(ADMISSION_REVIEW_VERSIONS)}")
        )  # fmt: skip


def _check_match_conditions(conditions: Any, base: str, causes: Causes) -> None:
    if not isinstance(conditions, list):
        return
    if len(conditions) > _MAX_MATCH_CONDITIONS:
        causes.append((base, f"Too many: {len(conditions)}: must have at most {_MAX_MATCH_CONDITIONS} items"))
    names: set[str] = set()
    for index, condition in enumerate(conditions):
        if not isinstance(condition, dict):
            continue
        field = f"{base}[{index}]"
        expression = str(condition.get("expression") or "").strip()
        if not expression:
            causes.append((f"{field}.expression", "Required value"))
        else:
            problem = compile_problem(expression)
            if problem is not None:
                causes.append((f"{field}.expression", f"Invalid value: {go_quote(expression)}: {problem}"))
        name = condition.get("name")
        if not name:
            causes.append((f"{field}.name", "Required value"))
        else:
            causes.extend((f"{field}.name", problem) for problem in label_name(str(name)))
            if name in names:
                causes.append((f"{field}.name", f"Duplicate value: {go_quote(str(name))}"))
            names.add(str(name))


@functools.lru_cache(maxsize=256)
def compile_condition(expression: str) -> Any:
    """The compiled program of a ``matchConditions`` expression (kept: configurations rarely change);
    raises ``ValueError`` with the parser's message when it does not compile."""
    return cel.compile(expression)


def compile_problem(expression: str) -> str | None:
    """``compilation failed: <the parser's message>`` for an expression that does not compile."""
    try:
        compile_condition(expression)
    except ValueError as error:
        message = str(error)
        issues = message[message.find("ERROR:") :] if "ERROR:" in message else message
        return "compilation failed: " + issues.replace("\n| ", "\n | ")  # cel-go's indent
    return None
