"""The gang sources the controller can read, and ``--gang-sources``, the flag that picks them.

A bottom module (it imports only ``driver.errors``): the configuration checks the flag where it is
given (``driver.config``), and the controller's gang reader (``driver.controller.model.gang_identity``)
matches pods against the sources chosen. What each source reads from a pod is said there.
"""

from __future__ import annotations

from enum import StrEnum

from driver.errors import ConfigError

__all__ = [
    "ALL_SOURCES",
    "MARKER_SOURCES",
    "UPSTREAM_SOURCES",
    "GangSource",
    "parse_gang_sources",
]


class GangSource(StrEnum):
    """In the order a pod is matched against them: the first that names a gang wins."""

    PODGROUP = "podgroup"  # scheduling.k8s.io PodGroup (spec.schedulingGroup), 1.36+
    WORKLOAD = "workload"  # scheduling.k8s.io Workload (spec.workloadRef), 1.35
    FRACTIONAL = "fractional"  # our own label and size annotation
    COSCHEDULING = "coscheduling"  # the third-party markers from here on
    KUEUE = "kueue"
    LWS = "lws"
    VOLCANO = "volcano"


ALL_SOURCES = frozenset(GangSource)
UPSTREAM_SOURCES = frozenset({GangSource.PODGROUP, GangSource.WORKLOAD})
MARKER_SOURCES = frozenset({GangSource.COSCHEDULING, GangSource.KUEUE, GangSource.LWS, GangSource.VOLCANO})
_ALIASES = {"upstream": UPSTREAM_SOURCES, "markers": MARKER_SOURCES, "all": ALL_SOURCES}


def parse_gang_sources(text: str) -> frozenset[GangSource] | None:
    """``--gang-sources``: a comma list of sources and aliases (upstream, markers, all); ``auto`` or
    empty: None, the default chosen from what the cluster serves (``gang_identity.default_sources``).
    An unknown word is a ``ConfigError`` naming the flag."""
    words = [w.strip().lower() for w in text.split(",") if w.strip()]
    if not words or words == ["auto"]:
        return None
    chosen: set[GangSource] = set()
    for word in words:
        if word in _ALIASES:
            chosen |= _ALIASES[word]
            continue
        try:
            chosen.add(GangSource(word))
        except ValueError:
            names = ", ".join([*(s.value for s in GangSource), *_ALIASES, "auto"])
            raise ConfigError(
                field="--gang-sources (FRACTIONAL_GANG_SOURCES)",
                problem=f"unknown source {word!r}; expected one of {names}",
            ) from None
    return frozenset(chosen)
