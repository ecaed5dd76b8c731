"""fractional-dra: a Kubernetes DRA driver that shares GPUs by memory and compute slices."""

from __future__ import annotations

DRIVER_NAME = "fractional.dev"
"""The DRA driver name (docs/architecture.md: Names)."""

__all__ = ["DRIVER_NAME"]
__version__ = "0.1.0"
