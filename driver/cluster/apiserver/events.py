"""One Event store for ``core/v1`` and ``events.k8s.io/v1`` in the embedded API emulator (a test
double), as kube-apiserver has it: both groups serve the same objects, converted field by field
the way ``pkg/apis/events/v1`` converts them (``involvedObject`` is ``regarding``, ``message`` is
``note``, ``source`` is ``deprecatedSource``, ``firstTimestamp``/``lastTimestamp``/``count`` are the
``deprecated*`` fields, ``reportingComponent`` is ``reportingController``)."""

from __future__ import annotations

from typing import Any

__all__ = ["core_event", "events_v1_event", "events_v1_field_selector"]

Obj = dict[str, Any]
# core/v1 field -> events.k8s.io/v1 field (the rest keep their names)
_RENAMED = {
    "involvedObject": "regarding",
    "message": "note",
    "source": "deprecatedSource",
    "firstTimestamp": "deprecatedFirstTimestamp",
    "lastTimestamp": "deprecatedLastTimestamp",
    "count": "deprecatedCount",
    "reportingComponent": "reportingController",
}
_BACK = {v1: core for core, v1 in _RENAMED.items()}
_SELECTOR_FIELDS = {"regarding.": "involvedObject.", "reportingController": "reportingComponent"}


# events.k8s.io/v1 fields Go serves even when unset (``eventTime`` and the structs), and those it omits
# when empty (``omitempty`` strings, numbers and pointers)
_V1_ALWAYS: dict[str, Any] = {
    "eventTime": None,
    "regarding": {},
    "deprecatedSource": {},
    "deprecatedFirstTimestamp": None,
    "deprecatedLastTimestamp": None,
}
_V1_OMIT_EMPTY = frozenset(
    {"series", "reportingController", "reportingInstance", "action", "reason", "related", "note", "type",
     "deprecatedCount"}
)  # fmt: skip


def events_v1_event(event: Obj) -> Obj:
    """A stored (core/v1) Event as events.k8s.io/v1 serves it."""
    converted: Obj = {"apiVersion": "events.k8s.io/v1", "kind": "Event"}
    for key, value in event.items():
        name = _RENAMED.get(key, key)
        if key in ("apiVersion", "kind") or (name in _V1_OMIT_EMPTY and value in (None, "", 0)):
            continue
        converted[name] = value
    for name, unset in _V1_ALWAYS.items():
        if converted.get(name) is None:
            converted[name] = unset
    return converted


def core_event(event: Obj) -> Obj:
    """An events.k8s.io/v1 Event as it is stored (core/v1)."""
    converted: Obj = {"apiVersion": "v1", "kind": "Event"}
    for key, value in event.items():
        if key in ("apiVersion", "kind"):
            continue
        converted[_BACK.get(key, key)] = value
    return converted


def events_v1_field_selector(selector: str | None) -> str | None:
    """An events.k8s.io/v1 field selector in the stored objects' (core/v1) field names."""
    if not selector:
        return selector
    for v1_name, core_name in _SELECTOR_FIELDS.items():
        selector = selector.replace(v1_name, core_name)
    return selector
