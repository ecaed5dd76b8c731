"""One staleness check for committed protobuf stubs (the kubelet's protos and Kubernetes' own)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def assert_stubs_current(generator: str, committed: Path, tmp_path: Path, *, hint: str) -> None:
    """Run ``hack/<generator>.py``'s ``generate`` into ``tmp_path`` and compare with ``committed``."""
    spec = importlib.util.spec_from_file_location(generator, REPO_ROOT / "hack" / f"{generator}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(generator, module)
    spec.loader.exec_module(module)
    generated = module.generate(tmp_path / "proto_gen")
    fresh = {path.name: path.read_bytes() for path in generated}
    held = {path.name: path.read_bytes() for path in committed.iterdir() if path.is_file()}
    stale = sorted(name for name in fresh.keys() | held.keys() if fresh.get(name) != held.get(name))
    assert not stale, f"stale or extra stubs {stale}: {hint}"
