"""Bodies kube-apiserver refuses, answered by the emulator as kube-apiserver 1.37.2 answers them
(status code, reason, message, causes: each expectation below was read off the real server).

Sent as raw HTTP: the typed client would refuse most of them before they leave."""

from __future__ import annotations

import json
from typing import Any

import pytest
import urllib3

from driver.cluster.apiserver import APIServer

Obj = dict[str, Any]


def _send(server: APIServer, method: str, path: str, text: str) -> tuple[int, Obj]:
    content_type = "application/merge-patch+json" if method == "PATCH" else "application/json"
    with urllib3.PoolManager() as pool:
        response = pool.request(
            method,
            server.url + path,
            body=text.encode(),
            headers={"Content-Type": content_type},
            retries=False,
        )
        return int(response.status), json.loads(response.data)


def _failure(code: int, reason: str, message: str, details: Obj | None = None) -> Obj:
    status: Obj = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
    }
    status["reason"] = reason
    if details is not None:
        status["details"] = details
    status["code"] = code
    return status


POD = json.dumps({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p1"},
                  "spec": {"containers": [{"name": "a", "image": "x"}]}})  # fmt: skip


NAN_IN_POD = (
    "the object provided is unrecognized (must be of type Pod): couldn't get version/kind; json "
    "parse error: invalid character 'N' looking for beginning of value "
    '({"apiVersion":"v1","kind":"Pod ...)'
)


@pytest.fixture
def server(api_server: APIServer) -> APIServer:
    assert _send(api_server, "POST", "/api/v1/namespaces/default/pods", POD)[0] == 201
    return api_server


@pytest.mark.parametrize(
    ("method", "path", "body", "message"),
    [
        (
            "POST",
            "/api/v1/namespaces/default/pods",
            '{"apiVersion":"v1","kind":"Pod","metadata":{"name":"nan"},"spec":{"terminationGracePeriodSeconds":NaN}}',
            NAN_IN_POD,
        ),
        (
            "PUT",
            "/api/v1/namespaces/default/pods/p1",
            '{"apiVersion":"v1","kind":"Pod","metadata":{"name":"p1"},"spec":{"x":NaN}}',
            NAN_IN_POD,
        ),
        (
            "POST",
            "/api/v1/namespaces/default/pods/p1/eviction",
            '{"apiVersion":"policy/v1","kind":"Eviction","metadata":{"name":"p1"},"deleteOptions":NaN}',
            "the object provided is unrecognized (must be of type Eviction): couldn't get version/kind; json "
            "parse error: invalid character 'N' looking for beginning of value "
            '({"apiVersion":"policy/v1","kin ...)',
        ),
        (
            "PATCH",
            "/api/v1/namespaces/default/pods/p1",
            '{"spec":{"activeDeadlineSeconds":NaN}}',
            "invalid JSON patch",
        ),
    ],
    ids=["create", "replace", "eviction", "merge-patch"],
)
def test_nan_is_no_json(server: APIServer, method: str, path: str, body: str, message: str) -> None:
    assert _send(server, method, path, body) == (400, _failure(400, "BadRequest", message))
    assert _send(server, "GET", "/api/v1/namespaces/default/pods/p1", "")[0] == 200  # still serving


@pytest.mark.parametrize(("options", "go_type"), [('"now"', "string"), ("[1]", "array"), ("7", "number")])
def test_eviction_with_delete_options_that_are_no_object(
    server: APIServer, options: str, go_type: str
) -> None:
    body = (
        '{"apiVersion":"policy/v1","kind":"Eviction","metadata":{"name":"p1"},"deleteOptions":'
        + options
        + "}"
    )
    message = (
        'Eviction in version "v1" cannot be handled as a Eviction: json: cannot unmarshal '
        f"{go_type} into Go struct field Eviction.deleteOptions of type v1.DeleteOptions"
    )
    assert _send(server, "POST", "/api/v1/namespaces/default/pods/p1/eviction", body) == (
        400,
        _failure(400, "BadRequest", message),
    )
    assert _send(server, "GET", "/api/v1/namespaces/default/pods/p1", "")[0] == 200  # not evicted


def _invalid(kind: str, group: str, name: str, field: str, reason: str, problem: str) -> Obj:
    return _failure(
        422,
        "Invalid",
        f'{kind}.{group} "{name}" is invalid: {field}: {problem}',
        {
            "name": name,
            "group": group,
            "kind": kind,
            "causes": [{"reason": reason, "message": problem, "field": field}],
        },
    )


PODGROUPS = "/apis/scheduling.k8s.io/v1beta1/namespaces/default/podgroups"


def _podgroup(name: str, count: int) -> str:
    return json.dumps({
        "apiVersion": "scheduling.k8s.io/v1beta1", "kind": "PodGroup", "metadata": {"name": name},
        "spec": {"schedulingPolicy": {"gang": {"minCount": count}}},
    })  # fmt: skip


@pytest.mark.parametrize(
    ("count", "reason", "problem"),
    [
        (0, "FieldValueRequired", "Required value"),
        (-3, "FieldValueInvalid", "Invalid value: -3: must be greater than or equal to 1"),
    ],
)
def test_podgroup_min_count_below_one(server: APIServer, count: int, reason: str, problem: str) -> None:
    field = "spec.schedulingPolicy.gang.minCount"
    name = f"pg{count}"
    assert _send(server, "POST", PODGROUPS, _podgroup(name, count)) == (
        422,
        _invalid("PodGroup", "scheduling.k8s.io", name, field, reason, problem),
    )
    assert _send(server, "POST", PODGROUPS, _podgroup("pgok", 2))[0] == 201
    patch = json.dumps({"spec": {"schedulingPolicy": {"gang": {"minCount": count}}}})
    assert _send(server, "PATCH", f"{PODGROUPS}/pgok", patch) == (
        422,
        _invalid("PodGroup", "scheduling.k8s.io", "pgok", field, reason, problem),
    )


PRIORITY_CLASSES = "/apis/scheduling.k8s.io/v1/priorityclasses"
RESERVED = "Forbidden: priority class names with 'system-' prefix are reserved for system use only. error: "


@pytest.mark.parametrize(
    ("name", "value", "field", "problem"),
    [
        (
            "huge",
            1000000001,
            "value",
            "Forbidden: maximum allowed value of a user defined priority is 1000000000",
        ),
        (
            "cluster",
            2000000000,
            "value",
            "Forbidden: maximum allowed value of a user defined priority is 1000000000",
        ),
        (
            "system-foo",
            2000000500,
            "metadata.name",
            RESERVED + "system-foo is not a known system priority class",
        ),
        (
            "system-node-critical",
            2000001001,
            "metadata.name",
            RESERVED + "value of system-node-critical PriorityClass must be 2000001000",
        ),
    ],
)
def test_priority_class_values_past_the_maximum(
    server: APIServer, name: str, value: int, field: str, problem: str
) -> None:
    def priority_class(name: str, value: int) -> str:
        return json.dumps({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                           "metadata": {"name": name}, "value": value})  # fmt: skip

    assert _send(server, "POST", PRIORITY_CLASSES, priority_class(name, value)) == (
        422,
        _invalid("PriorityClass", "scheduling.k8s.io", name, field, "FieldValueForbidden", problem),
    )
    # The bounds themselves are fine (the real server took both).
    for bound in (1000000000, -2147483648):
        assert _send(server, "POST", PRIORITY_CLASSES, priority_class(f"pc{abs(bound)}", bound))[0] == 201
