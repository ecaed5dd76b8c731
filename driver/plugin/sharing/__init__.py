"""Sharing backends: mps | hami | none (see ``base``)."""

from __future__ import annotations

from driver.plugin.sharing.base import ContainerEdits, DeviceNode, Mount, ShareSpec, SharingBackend
from driver.plugin.sharing.factory import build_sharing_backends
from driver.plugin.sharing.hami import HamiBackend
from driver.plugin.sharing.mps import MpsBackend, MpsDaemonStatus
from driver.plugin.sharing.none import NoneBackend

__all__ = [
    "ContainerEdits",
    "DeviceNode",
    "HamiBackend",
    "Mount",
    "MpsBackend",
    "MpsDaemonStatus",
    "NoneBackend",
    "ShareSpec",
    "SharingBackend",
    "build_sharing_backends",
]
