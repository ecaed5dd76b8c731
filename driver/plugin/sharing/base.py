"""The sharing-backend plug point: how one prepared GPU share is enforced on the node.

The plugin core (``driver.plugin``) computes one ``ShareSpec`` per prepared GPU result and asks the
backend chosen for it (node flag ``--sharing``, overridden per claim by a ``GpuConfig``) for the
CDI container edits. ``acquire``/``release`` run the node-side effects (e.g. an MPS control daemon
per GPU) and must be idempotent: a crashed agent calls ``acquire`` again for every prepared share
found in its checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["ContainerEdits", "DeviceNode", "Mount", "ShareSpec", "SharingBackend"]


@dataclass(frozen=True, slots=True)
class Mount:
    host_path: str
    container_path: str
    options: tuple[str, ...] = ("rbind", "rw")
    type: str | None = None  # e.g. "bind"; a type needs cdiVersion >= 0.4.0


@dataclass(frozen=True, slots=True)
class DeviceNode:
    path: str
    host_path: str | None = None  # a hostPath needs cdiVersion >= 0.5.0
    permissions: str | None = None


@dataclass(frozen=True, slots=True)
class ContainerEdits:
    """A CDI ``containerEdits`` fragment; ``driver.plugin.cdi`` renders and merges them."""

    env: tuple[str, ...] = ()  # "NAME=value"
    mounts: tuple[Mount, ...] = ()
    device_nodes: tuple[DeviceNode, ...] = ()

    def merged(self, other: ContainerEdits) -> ContainerEdits:
        return ContainerEdits(
            env=self.env + other.env,
            mounts=self.mounts + other.mounts,
            device_nodes=self.device_nodes + other.device_nodes,
        )


@dataclass(frozen=True, slots=True)
class ShareSpec:
    """One GPU of one prepared claim, as a sharing backend sees it."""

    claim_uid: str
    device: str  # "gpu-0"
    gpu_uuid: str
    ordinal: int  # position of this GPU among the claim's GPUs (CUDA_DEVICE_MEMORY_LIMIT_<i>)
    share_id: str | None  # None for an exclusive (whole-device) allocation
    memory_bytes: int  # consumed memory
    compute_percent: int  # guaranteed SM share, 0 = best effort
    whole_gpu: bool  # all of the GPU's memory: no limits are applied
    backend_options: tuple[tuple[str, str], ...] = ()  # decoded GpuConfig options for this backend
    claim_key: str = ""  # "namespace/name" of the claim, for messages

    @property
    def claim(self) -> str:
        """How errors name the claim: ``namespace/name (uid)``, or the UID alone when unknown."""
        return f"{self.claim_key} ({self.claim_uid})" if self.claim_key else self.claim_uid


class SharingBackend(Protocol):
    """``mps`` | ``hami`` | ``none``."""

    name: str

    def container_edits(self, share: ShareSpec) -> ContainerEdits:
        """Pure: the edits every container using this share gets (beyond the FRACTIONAL_* ones)."""
        ...

    def acquire(self, share: ShareSpec) -> None:
        """Idempotent node-side effect before the container starts (may raise ClaimError)."""
        ...

    def release(self, share: ShareSpec) -> None:
        """Idempotent undo of ``acquire``; unknown shares are fine."""
        ...

    def close(self) -> None:
        """Agent shutdown: stop daemons cleanly."""
        ...

    def describe(self) -> dict[str, str]:
        """A small JSON-able description (status.devices data, logs)."""
        ...
