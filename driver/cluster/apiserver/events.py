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


def events_v1_event(event: Obj) -> Obj:
    """A stored (core/v1) Event as events.k8s.io/v1 serves it."""
    converted: Obj = {"apiVersion": "events.k8s.io/v1", "kind": "Event"}
    for key, value in event.items():
        if key in ("apiVersion", "kind") or (value in (None, "", {}) and key in _RENAMED):
            continue
        converted[_RENAMED.get(key, key)] = value
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
