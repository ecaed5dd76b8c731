"""The controller's vocabulary: pure readers of the API-shaped dicts the server sends.

Owns the names the controller relies on (our gate, finalizer, gang label and annotations) and the
readers of pods, claims and nodes (``objects``), which gang a pod belongs to among every source
(``gang_identity``: PodGroup, Workload, our label, other tools' markers), and the bounded decoding
every body read from the server passes (``decode``).

May import: ``driver.errors`` and ``driver.jsondepth`` only; nothing of the controller. Every
other part of the controller (and ``driver.config``, ``fractional why``) reads these.
"""

from __future__ import annotations

from driver.controller.model.decode import bounded, decode_json
from driver.controller.model.gang_identity import GangRef, GangSource, identify, parse_gang_sources
from driver.controller.model.objects import (
    FINALIZER,
    GANG_LABEL,
    GANG_SIZE_ANNOTATION,
    GATE,
    HINT_ANNOTATION,
    GangKey,
    ObjectKey,
)

__all__ = [
    "FINALIZER",
    "GANG_LABEL",
    "GANG_SIZE_ANNOTATION",
    "GATE",
    "HINT_ANNOTATION",
    "GangKey",
    "GangRef",
    "GangSource",
    "ObjectKey",
    "bounded",
    "decode_json",
    "identify",
    "parse_gang_sources",
]
