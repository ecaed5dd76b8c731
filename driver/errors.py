"""The error tree, sorted by what the caller does (docs/architecture.md, "Layout and layering").

Only ``driver.kube.errors`` touches the Kubernetes client's ``ApiException``; everything above it
sees these classes.
"""

from __future__ import annotations

__all__ = [
    "AllocationError",
    "ClaimError",
    "ConfigError",
    "ConflictError",
    "FractionalError",
    "InventoryError",
    "NamespaceTerminatingError",
    "NotFoundError",
    "TransientError",
]


class FractionalError(Exception):
    """Root of every error this project raises on purpose."""


class ConfigError(FractionalError):
    """A flag, environment variable or values file is wrong; the process exits with status 2."""

    def __init__(self, *, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


class InventoryError(FractionalError):
    """Device discovery failed or a profile is invalid: names the source, device and field."""

    def __init__(
        self, *, source: str, problem: str, device: str | None = None, field: str | None = None
    ) -> None:
        where = source
        if device:
            where += f": device {device}"
        if field:
            where += f": {field}"
        super().__init__(f"{where}: {problem}")
        self.source = source
        self.device = device
        self.field = field
        self.problem = problem


class ClaimError(FractionalError):
    """A ResourceClaim cannot be prepared; reported per claim to the kubelet, never fatal for the batch."""

    def __init__(self, *, claim: str, field: str, problem: str) -> None:
        super().__init__(f"ResourceClaim {claim}: {field}: {problem}")
        self.claim = claim
        self.field = field
        self.problem = problem


class AllocationError(FractionalError):
    """What upstream's allocator treats as fatal: unknown class, bad CEL, runtime CEL error, limits."""


class TransientError(FractionalError):
    """Worth retrying with backoff: connection refused, 429, 5xx, 409."""


class ConflictError(TransientError):
    """409 Conflict: the object changed (stale resourceVersion) or already exists."""


class NotFoundError(FractionalError):
    """404 Not Found from the API."""


class NamespaceTerminatingError(FractionalError):
    """403 from a write into a namespace being deleted (the apiserver's cause NamespaceTerminating):
    nothing new can be created there, and what it holds is going away."""
