"""Decoding a claim defensively, and the checks on what the allocation says."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from driver.errors import ClaimError
from driver.plugin.claims import (
    MAX_CLAIM_BYTES,
    MAX_CLAIM_DEPTH,
    ClaimRef,
    ClaimUID,
    bounded,
    check_node_selector,
    decode_claim_json,
    parse_claim,
    quoted,
)

UID = "1d2c3b4a-0000-4000-8000-00000000000a"
REF = ClaimRef(namespace="ns", name="c", uid=ClaimUID(UID))


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (f'{{"a": {nested(MAX_CLAIM_DEPTH)}}}'.encode(), "nested more than 64 levels"),
        (f'{{"a": {nested(2_000)}}}'.encode(), "nested more than 64 levels"),
        (f'{{"a": {nested(20_000)}}}'.encode(), "nested more than 64 levels"),
        (b'{"a": "' + b"x" * MAX_CLAIM_BYTES + b'"}', "larger than"),
        (b"\xff\xfe", "not JSON"),
        (b'{"a": ', "not JSON"),
        (b"[1, 2]", "not a JSON object"),
    ],
)
def test_hostile_bodies_are_claim_errors(data: bytes, problem: str) -> None:
    with pytest.raises(ClaimError, match=problem) as raised:
        decode_claim_json(data, "ns/c")
    assert len(str(raised.value)) < 500


def test_brackets_in_strings_do_not_count_and_shallow_bodies_decode() -> None:
    body = {"a": "[" * 5_000 + '\\"{', "b": [[[{"c": 1}]]], "d": nested(3)}
    assert decode_claim_json(json.dumps(body).encode(), "ns/c") == body
    assert decode_claim_json(f'{{"a": {nested(MAX_CLAIM_DEPTH - 1)}}}'.encode(), "ns/c")["a"]


def allocation(results: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "ns", "name": "c", "uid": UID},
        "status": {"allocation": {"devices": {"results": results}, **extra}},
    }


GPU = {"request": "gpu", "driver": "fractional.dev", "pool": "node-a", "device": "gpu-0"}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (allocation([GPU] * 33), "status.allocation.devices.results"),
        (allocation([{**GPU, "pool": "p" * 300}]), "results[0].pool"),
        (allocation([{**GPU, "request": ["gpu"]}]), "results[0].request"),
        (allocation([{**GPU, "consumedCapacity": {"memory": "1" * 100}}]), "consumedCapacity.memory"),
        (allocation([GPU], devices={"results": [GPU], "config": "x"}), "status.allocation.devices"),
        ({"metadata": "x", "status": {}}, "metadata"),
        ({**allocation([GPU]), "status": {"allocation": ["x"]}}, "status.allocation"),
    ],
)
def test_out_of_bounds_claims_are_refused(body: dict[str, Any], field: str) -> None:
    with pytest.raises(ClaimError, match=re.escape(field)):
        parse_claim(body, REF)


def selector(*terms: dict[str, Any]) -> dict[str, Any]:
    return allocation([GPU], nodeSelector={"nodeSelectorTerms": list(terms)})


def names(operator: str, *values: str) -> dict[str, Any]:
    return {"matchFields": [{"key": "metadata.name", "operator": operator, "values": list(values)}]}


LABELS = {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}


@pytest.mark.parametrize(
    ("body", "selected"),
    [
        (allocation([GPU]), True),  # no selector: reachable from every node
        (selector(names("In", "node-a")), True),
        (selector(names("In", "node-b")), False),
        (selector(names("In", "node-b"), names("In", "node-a", "node-c")), True),
        (selector(names("NotIn", "node-a")), False),
        (selector(names("NotIn", "node-b")), True),
        (selector(LABELS), True),  # labels this agent cannot see: not refused
        (selector({**LABELS, **names("In", "node-b")}), False),
        (selector({}), False),  # an empty term selects no node
        (selector(), False),
        (selector({"matchFields": [{"key": "spec.x", "operator": "In", "values": ["node-a"]}]}), False),
        (selector(names("In", "node-a\n")), False),
    ],
)
def test_node_selector(body: dict[str, Any], selected: bool) -> None:
    if selected:
        check_node_selector(body, "node-a", "ns/c")
    else:
        with pytest.raises(ClaimError, match=r"status\.allocation\.nodeSelector"):
            check_node_selector(body, "node-a", "ns/c")


def test_echoes_are_bounded() -> None:
    assert bounded("x" * 10) == "x" * 10
    assert bounded("x" * 1_000_000) == "x" * 200 + "... (999800 more characters)"
    assert quoted("é" * 1_000).startswith("'éé") and len(quoted("é" * 1_000)) < 250


def test_api_error_messages_are_bounded() -> None:
    from kubernetes.client.exceptions import ApiException

    from driver.kube.errors import translate_api_exception

    error = ApiException(status=422, reason="Unprocessable Entity")
    error.body = json.dumps({"message": "x" * 1_000_000})
    assert len(str(translate_api_exception(error, "update ResourceClaim ns/c"))) < 700
    error.body = '{"message": ' + "[" * 100_000 + "]" * 100_000 + "}"  # nested past json's limit
    assert str(translate_api_exception(error, "get x")) == "get x: HTTP 422: Unprocessable Entity"
