"""Device inventory: the model and its discovery backends."""

from __future__ import annotations

from driver.inventory.discover import discover_inventory, render_inventory_table
from driver.inventory.fake import list_profiles, load_profile, resolve_profile
from driver.inventory.model import (
    GPU,
    NIC,
    NodeInventory,
    NUMANode,
    assign_device_names,
    normalize_pci_bus_id,
    normalize_version,
    parse_cpu_list,
)

__all__ = [
    "GPU",
    "NIC",
    "NUMANode",
    "NodeInventory",
    "assign_device_names",
    "discover_inventory",
    "list_profiles",
    "load_profile",
    "normalize_pci_bus_id",
    "normalize_version",
    "parse_cpu_list",
    "render_inventory_table",
    "resolve_profile",
]
