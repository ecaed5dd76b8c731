"""``none``: accounting only. The plugin core's FRACTIONAL_* variables are all a share gets."""

from __future__ import annotations

from driver.plugin.sharing.base import ContainerEdits, ShareSpec

__all__ = ["NoneBackend"]


class NoneBackend:
    """Nothing to enforce, nothing to run: the scheduler's accounting is the only limit."""

    name = "none"

    def container_edits(self, share: ShareSpec) -> ContainerEdits:
        return ContainerEdits()

    def acquire(self, share: ShareSpec) -> None:
        return None

    def release(self, share: ShareSpec) -> None:
        return None

    def close(self) -> None:
        return None

    def describe(self) -> dict[str, str]:
        return {"backend": self.name, "enforcement": "none"}
