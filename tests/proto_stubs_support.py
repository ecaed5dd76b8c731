"""One staleness check for committed protobuf stubs (the kubelet's protos and Kubernetes' own)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# What the generator stamps with its own version, not the protos': grpcio-tools' release (the
# oldest grpcio the services accept) and the protobuf runtime it bundles. A patch release of
# grpcio-tools on PyPI changed the first while the stubs stayed the same (1.85.1 -> 1.85.4 in one
# afternoon): a fresh install must not call committed stubs stale for that.
_STAMPS = (
    (re.compile(rb"GRPC_GENERATED_VERSION = '[^']*'"), b"GRPC_GENERATED_VERSION = '*'"),
    (re.compile(rb"# Protobuf Python Version: \S+"), b"# Protobuf Python Version: *"),
    (
        re.compile(
            rb"(ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,)\s*\d+,\s*\d+,\s*\d+,"
        ),
        rb"\1 *,",
    ),
)


def _unstamped(content: bytes) -> bytes:
    for pattern, replacement in _STAMPS:
        content = pattern.sub(replacement, content)
    return content


def assert_stubs_current(generator: str, committed: Path, tmp_path: Path, *, hint: str) -> None:
    """Run ``hack/<generator>.py``'s ``generate`` into ``tmp_path`` and compare with ``committed``."""
    spec = importlib.util.spec_from_file_location(generator, REPO_ROOT / "hack" / f"{generator}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(generator, module)
    spec.loader.exec_module(module)
    generated = module.generate(tmp_path / "proto_gen")
    fresh = {path.name: _unstamped(path.read_bytes()) for path in generated}
    held = {path.name: _unstamped(path.read_bytes()) for path in committed.iterdir() if path.is_file()}
    stale = sorted(name for name in fresh.keys() | held.keys() if fresh.get(name) != held.get(name))
    assert not stale, f"stale or extra stubs {stale}: {hint}"
