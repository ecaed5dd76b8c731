"""What fits where, computed from the allocator's view: pure, no I/O.

Owns scale-up hints (``hints``: how many nodes of which shape would let a gang fit, tried with the
allocator over template nodes) and the fragmentation measures (``fragmentation``: whole GPUs free,
memory stranded on partly used GPUs, the largest share that still fits per product).

May import: ``driver.allocator``, ``driver.inventory``, ``driver.slices`` and
``driver.controller.model``. Used by the Kueue check, the metrics, diagnosis and the decider.
"""

from __future__ import annotations

from driver.controller.sizing.fragmentation import Fragmentation, compute_fragmentation
from driver.controller.sizing.hints import Hint, NodeShape, compute_hint, render_hint

__all__ = ["Fragmentation", "Hint", "NodeShape", "compute_fragmentation", "compute_hint", "render_hint"]
