"""The rendered RBAC is exactly the justified allow-list, has no wildcard, and matches the code."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes.client
import pytest
from chart_support import REPO_ROOT, VALUES_FILES, load_values, render_chart
from rbac_allowlist import (
    AGENT_CODE,
    ALLOCATION_GUARD,
    CONSOLIDATION,
    CONTROLLER_CODE,
    EXCLUDED_CODE,
    GRANTS,
    IMPLIED_BY_STATUS_WRITE,
    KUEUE_ADMISSION_CHECK,
    PROVISIONING_REQUESTS,
    Grant,
)

# (role, scope, group, resource, verb, resourceNames)
Permission = tuple[str, str, str, str, str, tuple[str, ...]]

ROLE_KINDS = {"ClusterRole": "cluster", "Role": "namespace"}


def _rendered_rules(objects: Iterable[dict[str, Any]]) -> list[tuple[str, str, dict[str, Any]]]:
    found = []
    for obj in objects:
        if obj["kind"] in ROLE_KINDS:
            role = obj["metadata"]["labels"]["app.kubernetes.io/component"]
            for rule in obj.get("rules", []):
                found.append((role, ROLE_KINDS[obj["kind"]], rule))
    return found


def _permissions(rules: list[tuple[str, str, dict[str, Any]]]) -> set[Permission]:
    perms: set[Permission] = set()
    for role, scope, rule in rules:
        names = tuple(sorted(rule.get("resourceNames", [])))
        for group in rule.get("apiGroups", []):
            for resource in rule.get("resources", []):
                for verb in rule.get("verbs", []):
                    perms.add((role, scope, group, resource, verb, names))
    return perms


def _expected(grants: Iterable[Grant]) -> set[Permission]:
    return {
        (g.role, g.scope, g.group, g.resource, verb, tuple(sorted(g.resource_names)))
        for g in grants
        for verb in g.verbs
    }


def _grants_for(values: dict[str, Any] | None) -> list[Grant]:
    grants = list(GRANTS)
    if (values or {}).get("controller", {}).get("allocationGuard", {}).get("enabled") is False:
        grants = [g for g in grants if g not in ALLOCATION_GUARD]
    if (values or {}).get("controller", {}).get("provisioningRequests", {}).get("enabled"):
        grants.extend(PROVISIONING_REQUESTS)
    if (values or {}).get("controller", {}).get("kueueAdmissionCheck", {}).get("enabled"):
        grants.extend(KUEUE_ADMISSION_CHECK)
    if (values or {}).get("controller", {}).get("consolidation", {}).get("enabled"):
        grants.extend(CONSOLIDATION)
    return grants


@pytest.fixture(scope="module", params=sorted(VALUES_FILES))
def rendered(request: pytest.FixtureRequest) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    values = load_values(request.param)
    return values, render_chart(values)


def test_no_wildcards(rendered: tuple[dict[str, Any] | None, list[dict[str, Any]]]) -> None:
    _, objects = rendered
    rules = _rendered_rules(objects)
    assert rules, "no RBAC rules rendered"
    for role, _, rule in rules:
        assert "nonResourceURLs" not in rule, f"{role}: nonResourceURLs are not needed: {rule}"
        for field in ("apiGroups", "resources", "verbs", "resourceNames"):
            for entry in rule.get(field, []):
                assert "*" not in entry, f"{role}: wildcard in {field}: {rule}"


def test_rules_equal_allowlist(rendered: tuple[dict[str, Any] | None, list[dict[str, Any]]]) -> None:
    values, objects = rendered
    granted = _permissions(_rendered_rules(objects))
    expected = _expected(_grants_for(values))
    assert granted - expected == set(), "granted but not in tests/chart/rbac_allowlist.py"
    assert expected - granted == set(), "in the allow-list but not rendered"


def test_bindings_bind_each_role_to_its_own_service_account(
    rendered: tuple[dict[str, Any] | None, list[dict[str, Any]]],
) -> None:
    _, objects = rendered
    roles = {(o["kind"], o["metadata"]["name"]): o for o in objects if o["kind"] in ROLE_KINDS}
    accounts = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ServiceAccount"}
    bindings = [o for o in objects if o["kind"] in ("ClusterRoleBinding", "RoleBinding")]
    assert len(bindings) == len(roles)
    bound = set()
    for binding in bindings:
        ref = binding["roleRef"]
        role = roles[(ref["kind"], ref["name"])]
        if binding["kind"] == "ClusterRoleBinding":
            assert ref["kind"] == "ClusterRole"
        component = role["metadata"]["labels"]["app.kubernetes.io/component"]
        (subject,) = binding["subjects"]
        assert subject["kind"] == "ServiceAccount"
        account = accounts[subject["name"]]
        assert account["metadata"]["labels"]["app.kubernetes.io/component"] == component
        assert subject["namespace"] == account["metadata"]["namespace"]
        bound.add((ref["kind"], ref["name"]))
    assert bound == set(roles)


# -- the code -----------------------------------------------------------------------------------

# snake_case kind in a client method name -> (API group, resource)
KINDS = {
    "resource_slice": ("resource.k8s.io", "resourceslices"),
    "resource_claim": ("resource.k8s.io", "resourceclaims"),
    "resource_claim_template": ("resource.k8s.io", "resourceclaimtemplates"),
    "device_class": ("resource.k8s.io", "deviceclasses"),
    "device_taint_rule": ("resource.k8s.io", "devicetaintrules"),
    "pod": ("", "pods"),
    "pod_binding": ("", "pods/binding"),
    "pod_eviction": ("", "pods/eviction"),
    "pod_disruption_budget": ("policy", "poddisruptionbudgets"),
    "pod_template": ("", "podtemplates"),
    "node": ("", "nodes"),
    "event": ("", "events"),
    "namespace": ("", "namespaces"),
    "config_map": ("", "configmaps"),
    "secret": ("", "secrets"),
    "service": ("", "services"),
    "service_account": ("", "serviceaccounts"),
    "endpoints": ("", "endpoints"),
    "persistent_volume_claim": ("", "persistentvolumeclaims"),
    "lease": ("coordination.k8s.io", "leases"),
    "deployment": ("apps", "deployments"),
    "replica_set": ("apps", "replicasets"),
    "daemon_set": ("apps", "daemonsets"),
    "stateful_set": ("apps", "statefulsets"),
    "job": ("batch", "jobs"),
    "cluster_role": ("rbac.authorization.k8s.io", "clusterroles"),
}
CUSTOM_PLURALS = {
    "provisioningrequests": "autoscaling.x-k8s.io",
    "workloads": "kueue.x-k8s.io",
    "admissionchecks": "kueue.x-k8s.io",
}
# Custom-object calls whose group, version and plural are discovered at run time (the served gang
# API): file -> the (group, plural) pairs it may list and watch.
DISCOVERED_CUSTOM = {
    "driver/controller/view/watch.py": (
        ("autoscaling.x-k8s.io", "provisioningrequests"),
        ("scheduling.k8s.io", "workloads"),
        ("scheduling.k8s.io", "podgroups"),
        ("scheduling.x-k8s.io", "podgroups"),
        ("scheduling.volcano.sh", "podgroups"),
    ),
}
VERBS = {
    "read": "get",
    "list": "list",
    "create": "create",
    "replace": "update",
    "patch": "patch",
    "delete_collection": "deletecollection",
    "delete": "delete",
}
CALL = re.compile(r"\.(read|list|create|replace|patch|delete_collection|delete)_([a-z_]+)\b")
WATCH = re.compile(r"watch\s*=\s*True|watch\.Watch\(|\bWatch\(\)|iter_resp_lines")


def _code_files(globs: Iterable[str]) -> list[Path]:
    excluded = {path for pattern in EXCLUDED_CODE for path in REPO_ROOT.glob(pattern)}
    files = {path for pattern in globs for path in REPO_ROOT.glob(pattern) if path.is_file()}
    return sorted(files - excluded)


@cache
def _client_methods() -> frozenset[str]:
    """Every public method of the kubernetes client's *Api classes (read from their sources:
    importing them all takes seconds)."""
    api_dir = Path(kubernetes.client.__file__).parent / "api"
    names: set[str] = set()
    for path in api_dir.glob("*_api.py"):
        names.update(
            re.findall(r"^    def ([a-z][a-z0-9_]*)\(", path.read_text(encoding="utf-8"), re.MULTILINE)
        )
    return frozenset(names)


RAW_GET = re.compile(
    r'get_json\(\s*[\w.]+,\s*f?"/(?:api/v1|apis/([\w.]+)/\w+)/(?:namespaces/[^/"]+/)?([a-z]+)/'
)
# driver.kube.transport: sender.send_json("PUT", CLAIM_STATUS_PATH, ...), or the writer's own _send
# in front of it: the template is a literal or a module constant (resolved with ast); HTTP method ->
# RBAC verb.
RAW_SEND = re.compile(r'(?:send_json|\._send)\(\s*"([A-Z]+)",\s*("[^"]*"|[A-Z_]+)')
SEND_VERBS = {"PUT": "update", "PATCH": "patch", "POST": "create", "DELETE": "delete"}
PATH_TEMPLATE = re.compile(
    r"/(?:api/v1|apis/([\w.]+)/\w+)/(?:namespaces/\{namespace\}/)?([a-z]+)(?:/\{name\})?(/status)?"
)


def _string_constants(text: str) -> dict[str, str]:
    """Module-level ``NAME = "..."`` (or sums of such) in a source file."""
    constants: dict[str, str] = {}

    def value(node: ast.expr) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name):
            return constants.get(node.id)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left, right = value(node.left), value(node.right)
            return None if left is None or right is None else left + right
        return None

    for statement in ast.parse(text).body:
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
            target = statement.targets[0]
            if isinstance(target, ast.Name) and (found := value(statement.value)) is not None:
                constants[target.id] = found
    return constants


def _calls_in(path: Path) -> set[tuple[str, str, str]]:
    """(group, resource, verb) of every Kubernetes client method referenced in one file."""
    text = path.read_text(encoding="utf-8")
    found: set[tuple[str, str, str]] = set()
    for match in CALL.finditer(text):
        verb = VERBS[match.group(1)]
        name = match.group(2).removesuffix("_with_http_info")
        status = name.endswith("_status")
        name = name.removesuffix("_status").removesuffix("_for_all_namespaces").removeprefix("namespaced_")
        discovered = DISCOVERED_CUSTOM.get(str(path.relative_to(REPO_ROOT)))
        if name in ("custom_object", "cluster_custom_object") and discovered:
            found.update((group, plural, verb) for group, plural in discovered)
            if verb == "list" and WATCH.search(text):
                found.update((group, plural, "watch") for group, plural in discovered)
            continue
        if name in ("custom_object", "cluster_custom_object"):
            # the plural is the first known one quoted in the call's arguments (else any in the file)
            quoted = re.search(
                "|".join(f'"{p}"' for p in CUSTOM_PLURALS), text[match.end() : match.end() + 400]
            )
            plurals = [quoted.group(0).strip('"')] if quoted else [p for p in CUSTOM_PLURALS if p in text]
            assert plurals, f"{path}: custom object call with no known plural; extend CUSTOM_PLURALS"
            suffix = "/status" if status else ""
            found.update((CUSTOM_PLURALS[plural], plural + suffix, verb) for plural in plurals)
            if verb == "list" and WATCH.search(text):
                found.update((CUSTOM_PLURALS[plural], plural, "watch") for plural in plurals)
            continue
        if name not in KINDS:
            assert f"{match.group(1)}_{match.group(2)}" not in _client_methods(), (
                f"{path}: {match.group(0)[1:]} is a Kubernetes client method of a kind this test does "
                "not know: add it to KINDS"
            )
            continue  # not a Kubernetes client method (read_text, list_profiles, ...)
        group, resource = KINDS[name]
        if resource == "events" and "EventsV1Api" in text:
            group = "events.k8s.io"
        if status:
            resource += "/status"
        found.add((group, resource, verb))
        if verb == "list" and WATCH.search(text):
            found.add((group, resource, "watch"))
    for match in RAW_GET.finditer(text):  # driver.kube.client.get_json: a GET without a typed API class
        group = match.group(1) or ""
        found.add((group, match.group(2), "get"))
    sends = list(RAW_SEND.finditer(text))
    constants = _string_constants(text) if sends else {}
    for match in sends:  # JsonSender.send_json: a write without a typed API class
        argument = match.group(2)
        template = argument.strip('"') if argument.startswith('"') else constants.get(argument)
        assert template is not None, f"{path}: send_json path {argument} is not a module string constant"
        parsed = PATH_TEMPLATE.fullmatch(template)
        assert parsed is not None, f"{path}: send_json path {template!r} is not an API object path"
        resource = parsed.group(2) + (parsed.group(3) or "")
        found.add((parsed.group(1) or "", resource, SEND_VERBS[match.group(1)]))
    return found


def _code_permissions(globs: Iterable[str]) -> dict[tuple[str, str, str], list[str]]:
    where: dict[tuple[str, str, str], list[str]] = {}
    for path in _code_files(globs):
        for call in _calls_in(path):
            where.setdefault(call, []).append(str(path.relative_to(REPO_ROOT)))
    return where


def _all_grants() -> list[Grant]:
    return [*GRANTS, *PROVISIONING_REQUESTS, *KUEUE_ADMISSION_CHECK, *CONSOLIDATION]


@pytest.mark.parametrize(("role", "globs"), [("agent", AGENT_CODE), ("controller", CONTROLLER_CODE)])
def test_every_api_call_in_the_code_is_granted(role: str, globs: tuple[str, ...]) -> None:
    used = _code_permissions(globs)
    granted = {(g.group, g.resource, verb) for g in _all_grants() if g.role == role for verb in g.verbs}
    missing = {call: files for call, files in used.items() if call not in granted}
    for (group, resource, verb), files in used.items():
        for (implied_role, synthetic), mapping in IMPLIED_BY_STATUS_WRITE.items():
            if implied_role == role and resource == "resourceclaims/status":
                needed = (group, synthetic, mapping(verb))
                if needed not in granted:
                    missing[needed] = files
    assert missing == {}, f"{role}: the code makes API calls the chart does not allow"


@pytest.mark.parametrize(("role", "globs"), [("agent", AGENT_CODE), ("controller", CONTROLLER_CODE)])
def test_every_granted_verb_is_used_by_the_code(role: str, globs: tuple[str, ...]) -> None:
    used = _code_permissions(globs)
    touched = {resource for _, resource, _ in used}
    unused, pending = [], []
    for grant in _all_grants():
        if grant.role != role:
            continue
        for verb in grant.verbs:
            implied = IMPLIED_BY_STATUS_WRITE.get((role, grant.resource))
            if implied is not None:
                status_verbs = {v for g, r, v in used if r == "resourceclaims/status"}
                is_used = verb in {implied(v) for v in status_verbs}
                resource_touched = bool(status_verbs)
            else:
                is_used = (grant.group, grant.resource, verb) in used
                resource_touched = grant.resource in touched
            if is_used:
                continue
            entry = f"{grant.group or 'core'} {grant.resource} {verb} ({', '.join(grant.owner)})"
            (unused if resource_touched else pending).append(entry)
    assert unused == [], (
        f"{role}: granted verbs the code does not use; drop them from the chart and allow-list"
    )
    if pending:
        pytest.skip(f"{role}: code for these grants is not written yet: {'; '.join(pending)}")
