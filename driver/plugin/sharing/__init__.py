"""Sharing backends: mps | hami | none (see ``base``)."""

from __future__ import annotations

from driver.plugin.sharing.base import ContainerEdits, DeviceNode, Mount, ShareSpec, SharingBackend

__all__ = ["ContainerEdits", "DeviceNode", "Mount", "ShareSpec", "SharingBackend"]
