"""Builds the node's sharing backends from its configuration."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from driver.config import PluginConfig
from driver.plugin.sharing.base import SharingBackend
from driver.plugin.sharing.hami import HamiBackend
from driver.plugin.sharing.mps import MpsBackend
from driver.plugin.sharing.none import NoneBackend

__all__ = ["build_sharing_backends"]


def build_sharing_backends(
    config: PluginConfig, nvml: ModuleType | Any | None = None
) -> dict[str, SharingBackend]:
    """``{"mps": ..., "hami": ..., "none": ...}``; nothing starts until a share is acquired.

    ``nvml`` is an initialised pynvml-like module (None: fake devices, compute modes untouched).
    The caller owns the result and calls ``close()`` on each backend at shutdown.
    """
    return {
        "mps": MpsBackend(plugin_dir=config.plugin_dir, control=config.mps_control, nvml=nvml),
        "hami": HamiBackend(plugin_dir=config.plugin_dir, library=config.hami_library),
        "none": NoneBackend(),
    }
