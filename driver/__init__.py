"""fractional-dra: a Kubernetes DRA driver that shares GPUs by memory and compute slices."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

DRIVER_NAME = "fractional.dev"
"""The DRA driver name (docs/architecture.md: Names)."""

__all__ = ["DRIVER_NAME"]
try:
    __version__ = version("fractional-dra")  # pyproject.toml's, the one place it is written
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
