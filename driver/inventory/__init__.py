"""Device inventory: the model and its discovery backends."""

from __future__ import annotations

from driver.inventory.model import GPU, NIC, NodeInventory, NUMANode, assign_device_names

__all__ = ["GPU", "NIC", "NUMANode", "NodeInventory", "assign_device_names"]
