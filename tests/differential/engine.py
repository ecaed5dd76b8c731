"""The differential corpus's machinery: send a case's requests to a server, normalise the answers.

A case is a list of steps, each one HTTP request; every step's answer is compared, except those
marked ``compare=False`` (set-up whose answer another case already covers). An answer is the
status code, the warnings, and the body after normalising what must differ between two servers:
uids, resourceVersions, timestamps, generated name suffixes, the age column of a Table.

Steps can refer to an earlier step's answer: ``{rv}`` is the resourceVersion of the latest answer
that had one, ``{rv:N}`` that of step N, ``{name:N}`` the name step N's object got.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

CONTENT_TYPES = {
    "json": "application/json",
    "merge": "application/merge-patch+json",
    "strategic": "application/strategic-merge-patch+json",
    "json-patch": "application/json-patch+json",
    "apply": "application/apply-patch+yaml",
}
ACCEPTS = {
    "json": "application/json",
    "table": "application/json;as=Table;v=v1;g=meta.k8s.io,application/json",
}
_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z$")
_GENERATED_VOLUME = re.compile(r"^kube-api-access-[a-z0-9]{5}$")  # the ServiceAccount admission's volume
# Written by kube-controller-manager's controllers at a moment of their own (the TTL controller on
# every Node): present in one answer, absent in the next, so no answer is judged by them.
_CONTROLLER_ANNOTATIONS = frozenset({"node.alpha.kubernetes.io/ttl"})
_VOLATILE = {"uid", "resourceVersion", "creationTimestamp", "selfLink"}
_AGE_COLUMNS = {"Age", "Last Seen", "First Seen"}


@dataclass(frozen=True)
class Step:
    method: str
    path: str
    body: Any = None
    content: str = "json"  # a key of CONTENT_TYPES
    accept: str = "json"  # a key of ACCEPTS
    compare: bool = True


@dataclass(frozen=True)
class Case:
    name: str
    steps: tuple[Step, ...]
    rules: str = ""  # what the case checks, in a few words
    tags: tuple[str, ...] = field(default=())


# One request: (method, path, body bytes or None, headers) -> (status, headers, body bytes).
Send = Callable[[str, str, bytes | None, dict[str, str]], tuple[int, list[str], bytes]]


def http_sender(base_url: str, opener: Callable[..., Any] = urllib.request.urlopen, **kwargs: Any) -> Send:
    """A ``Send`` over HTTP(S) to ``base_url`` (``kwargs`` reach ``urlopen``: the TLS context)."""

    def send(
        method: str, path: str, body: bytes | None, headers: dict[str, str]
    ) -> tuple[int, list[str], bytes]:
        request = urllib.request.Request(base_url + path, data=body, method=method, headers=headers)
        try:
            with opener(request, timeout=30, **kwargs) as answer:
                return answer.status, answer.headers.get_all("Warning") or [], answer.read()
        except urllib.error.HTTPError as error:
            return error.code, error.headers.get_all("Warning") or [], error.read()

    return send


def run_case(case: Case, send: Send) -> list[dict[str, Any]]:
    """Every step of ``case`` sent in order; the normalised answers of the compared ones."""
    raw: list[Any] = []
    answers: list[dict[str, Any]] = []
    for step in case.steps:
        path = _fill(step.path, raw)
        body = step.body
        if isinstance(body, (dict, list)):
            body = json.loads(_fill(json.dumps(body), raw))
        data: bytes | None = None
        if body is not None:
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        headers = {"Accept": ACCEPTS[step.accept]}
        if data is not None:
            headers["Content-Type"] = CONTENT_TYPES[step.content]
        status, warnings, payload = send(step.method, path, data, headers)
        decoded = _decode(payload, watch="watch=" in path)
        raw.append(decoded)
        if step.compare:
            answers.append({
                "request": f"{step.method} {step.path}",
                "status": status,
                "warnings": sorted(_warning_text(w) for w in warnings),
                "body": normalise(decoded),
            })  # fmt: skip
    return answers


def _fill(text: str, raw: list[Any]) -> str:
    def resource_version(index: int | None) -> str:
        candidates = [raw[index]] if index is not None else list(reversed(raw))
        for answer in candidates:
            if isinstance(answer, dict):
                version = (answer.get("metadata") or {}).get("resourceVersion")
                if version:
                    return str(version)
        return "0"

    text = re.sub(r"\{rv:(\d+)\}", lambda m: resource_version(int(m.group(1))), text)
    text = text.replace("{rv}", resource_version(None))
    return re.sub(r"\{name:(\d+)\}", lambda m: str(raw[int(m.group(1))]["metadata"]["name"]), text)


def _decode(payload: bytes, *, watch: bool) -> Any:
    text = payload.decode(errors="replace")
    if watch:
        events = [json.loads(line) for line in text.splitlines() if line.strip()]
        return {"watchEvents": [e for e in events if e.get("type") != "BOOKMARK"]}
    try:
        return json.loads(text)
    except ValueError:
        return {"text": text}


def _warning_text(header: str) -> str:
    match = re.match(r'^\d{3} \S+ "(.*)"$', header.strip())
    return match.group(1).replace('\\"', '"').replace("\\\\", "\\") if match else header


def normalise(value: Any) -> Any:
    """``value`` with what differs between any two servers replaced by markers."""
    if isinstance(value, dict):
        if value.get("kind") == "Table" and "columnDefinitions" in value:
            return _normalise_table(value)
        out: dict[str, Any] = {}
        for k, v in value.items():
            if k in _VOLATILE or k == "deletionTimestamp":
                out[k] = "<set>"
            elif k == "managedFields":
                out[k] = [{kk: vv for kk, vv in entry.items() if kk != "time"} for entry in v or ()]
            elif k == "continue":
                out[k] = "<token>" if v else v
            else:
                out[k] = normalise(v)
        annotations = out.get("annotations")
        if isinstance(annotations, dict) and _CONTROLLER_ANNOTATIONS & set(annotations):
            kept = {k: v for k, v in annotations.items() if k not in _CONTROLLER_ANNOTATIONS}
            if kept:
                out["annotations"] = kept
            else:
                del out["annotations"]
        generate = out.get("generateName")
        if (
            isinstance(generate, str)
            and isinstance(out.get("name"), str)
            and out["name"].startswith(generate)
        ):
            out["name"] = generate + "<generated>"
        return out
    if isinstance(value, list):
        return [normalise(item) for item in value]
    if isinstance(value, str) and _TIME.match(value):
        return "<time>"
    if isinstance(value, str) and _GENERATED_VOLUME.match(value):
        return "kube-api-access-<generated>"
    return value


def _normalise_table(table: dict[str, Any]) -> dict[str, Any]:
    columns = table.get("columnDefinitions") or []
    ages = {i for i, column in enumerate(columns) if column.get("name") in _AGE_COLUMNS}
    rows = []
    for row in table.get("rows") or []:
        cells = ["<age>" if i in ages else cell for i, cell in enumerate(row.get("cells") or [])]
        rows.append({**row, "cells": cells, "object": normalise(row.get("object"))})
    metadata = {k: v for k, v in (table.get("metadata") or {}).items() if k != "resourceVersion"}
    return {**table, "metadata": metadata, "rows": rows}


def without(value: Any, ignored: frozenset[str]) -> Any:
    """``value`` less the parts no comparison looks at: ``fieldsV1`` (of managedFields entries)."""
    if isinstance(value, dict):
        return {k: without(v, ignored) for k, v in value.items() if k not in ignored}
    if isinstance(value, list):
        return [without(item, ignored) for item in value]
    return value


def differences(
    expected: list[dict[str, Any]],
    actual: list[dict[str, Any]],
    labels: tuple[str, str] = ("real", "emulator"),
    ignored: frozenset[str] = frozenset(),
) -> list[str]:
    """One line per step whose answer differs: which part (status, warnings, body) and how."""
    expected, actual = without(expected, ignored), without(actual, ignored)
    lines = []
    if len(expected) != len(actual):
        return [f"{len(actual)} answers where the recording has {len(expected)}"]
    for index, (want, got) in enumerate(zip(expected, actual, strict=True)):
        for part in ("status", "warnings", "body"):
            if want[part] != got[part]:
                where = _first_difference(want[part], got[part], labels)
                lines.append(f"step {index} ({want['request']}): {part}: {where}")
    return lines


def _first_difference(want: Any, got: Any, labels: tuple[str, str], where: str = "") -> str:
    if isinstance(want, dict) and isinstance(got, dict):
        for k in sorted(set(want) | set(got)):
            if k not in got:
                return f"{where}.{k}: missing ({labels[0]}: {_short(want[k])})"
            if k not in want:
                return f"{where}.{k}: extra ({labels[1]}: {_short(got[k])})"
            if want[k] != got[k]:
                return _first_difference(want[k], got[k], labels, f"{where}.{k}")
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        for i, (a, b) in enumerate(zip(want, got, strict=True)):
            if a != b:
                return _first_difference(a, b, labels, f"{where}[{i}]")
    return f"{where or '.'}: {labels[0]} {_short(want)}, {labels[1]} {_short(got)}"


def _short(value: Any, limit: int = 300) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= limit else text[:limit] + "..."
