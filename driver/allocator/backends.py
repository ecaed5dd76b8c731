"""Sharing backends in placement: which backend each share runs under, and which shares
may live on one GPU. Pure.

The node agent enforces a share with a sharing backend: the node's ``--sharing`` unless an opaque
``GpuConfig`` (``parameters.sharing.backend``) of the claim or its class picks another. The last
config entry that applies to a request, class entries first, wins as a whole
(``driver.plugin.gpuconfig.resolve_share_configs``); an entry without a backend means the node's.

A share's backend is kept here as given (``None``: the node's default). The node's default is read
from the device attribute ``sharing`` and the backends it can run from ``sharingBackends`` (a comma
separated list), when the agent publishes them. Mixing rules (``check_backend_compatible`` in the
agent): the same backend always mixes, ``hami`` and ``none`` mix, ``mps`` mixes with nothing else
(an MPS GPU runs in EXCLUSIVE_PROCESS mode). When the node's default is not published, a default
share and a share naming a backend never meet on one device: the default might be the one that
does not mix.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from driver.errors import AllocationError

__all__ = [
    "BACKENDS",
    "SHARING_ATTRIBUTE",
    "SHARING_BACKENDS_ATTRIBUTE",
    "Backends",
    "allocation_backends",
    "backend_for",
    "backends_compatible",
    "check_no_claim_backend",
    "config_backend",
    "device_default_backend",
    "device_runs_backend",
    "request_backends",
]

BACKENDS = ("mps", "hami", "none")
SHARING_ATTRIBUTE = "sharing"  # the node's --sharing, in the driver's domain
SHARING_BACKENDS_ATTRIBUTE = "sharingBackends"  # "mps,hami,none": what the node can run
_SOURCES = ("FromClass", "FromClaim")

Backends = tuple[tuple[str, str | None], ...]  # (driver, backend or None for the node's) per driver


def config_backend(parameters: object) -> str | None:
    """``parameters.sharing.backend`` of one opaque config, or None (the node's). Lenient: the agent
    decodes strictly and fails a bad config at prepare; a value we do not know counts as the node's."""
    if not isinstance(parameters, Mapping):
        return None
    sharing = parameters.get("sharing")
    backend = sharing.get("backend") if isinstance(sharing, Mapping) else None
    return backend if isinstance(backend, str) and backend in BACKENDS else None


def _applies(requests: Sequence[str], request: str) -> bool:
    if not requests:
        return True
    return request in requests or request.split("/", 1)[0] in requests


def _resolve(entries: Iterable[tuple[Sequence[str], Mapping[str, Any]]], request: str) -> Backends:
    """The backend per driver for ``request`` from config entries in precedence order (last wins)."""
    found: dict[str, str | None] = {}
    for requests, config in entries:
        opaque = config.get("opaque")
        if not isinstance(opaque, Mapping) or not _applies(requests, request):
            continue
        driver = opaque.get("driver")
        if isinstance(driver, str):
            found[driver] = config_backend(opaque.get("parameters"))
    return tuple(sorted(found.items()))


def _requests_of(config: Mapping[str, Any]) -> tuple[str, ...]:
    raw = config.get("requests") or ()
    return tuple(str(r) for r in raw) if isinstance(raw, list | tuple) else ()


def request_backends(
    request: str, class_spec: Mapping[str, Any], claim_configs: Sequence[Mapping[str, Any]]
) -> Backends:
    """A pending request's backends: its class's ``spec.config`` (which applies to every request of
    that class), then the claim's ``spec.devices.config`` entries naming it."""
    entries: list[tuple[Sequence[str], Mapping[str, Any]]] = [
        ((), c) for c in class_spec.get("config") or () if isinstance(c, Mapping)
    ]
    entries += [(_requests_of(c), c) for c in claim_configs if isinstance(c, Mapping)]
    return _resolve(entries, request)


def allocation_backends(allocation: Mapping[str, Any], request: str) -> Backends:
    """An allocated result's backends, from ``status.allocation.devices.config`` (class entries first)."""
    configs = [c for c in (allocation.get("devices") or {}).get("config") or () if isinstance(c, Mapping)]
    ordered = sorted(
        configs, key=lambda c: _SOURCES.index(c["source"]) if c.get("source") in _SOURCES else len(_SOURCES)
    )
    return _resolve(((_requests_of(c), c) for c in ordered), request)


def backend_for(backends: Backends, driver: str) -> str | None:
    return next((backend for name, backend in backends if name == driver), None)


def _attribute(attributes: Mapping[str, tuple[str, Any]], driver: str, name: str) -> str | None:
    found = attributes.get(name) or attributes.get(f"{driver}/{name}")
    if found is None or found[0] != "string" or not isinstance(found[1], str):
        return None
    return found[1]


def device_default_backend(attributes: Mapping[str, tuple[str, Any]], driver: str) -> str | None:
    """The node's ``--sharing`` as the device publishes it, or None when it does not."""
    value = _attribute(attributes, driver, SHARING_ATTRIBUTE)
    return value if value in BACKENDS else None


def device_runs_backend(attributes: Mapping[str, tuple[str, Any]], driver: str, backend: str | None) -> bool:
    """Whether the device's node can run ``backend`` (None: its default, which it always can). A node
    that does not publish its backends is taken to run all of them."""
    listed = _attribute(attributes, driver, SHARING_BACKENDS_ATTRIBUTE)
    effective = backend or device_default_backend(attributes, driver)
    if listed is None or effective is None:
        return True
    return effective in {part.strip() for part in listed.split(",")}


def backends_compatible(first: str | None, second: str | None, default: str | None) -> bool:
    """Whether a share under ``first`` may live on a GPU beside one under ``second`` (None: the node's
    ``default``, itself None when not published)."""
    if first == second:
        return True
    one, other = first or default, second or default
    if one is None or other is None:
        return False  # one of them is the node's unknown default: it might be mps
    return one == other or "mps" not in (one, other)


def check_no_claim_backend(claim: Mapping[str, Any], *, driver: str) -> None:
    """Raise AllocationError naming the field when the claim's own config picks a sharing backend
    for ``driver`` (used where tenants may not override the backend; class config may)."""
    metadata = claim.get("metadata") or {}
    key = f"{metadata.get('namespace', '')}/{metadata.get('name', '')}"
    for index, config in enumerate(((claim.get("spec") or {}).get("devices") or {}).get("config") or ()):
        opaque = config.get("opaque") if isinstance(config, Mapping) else None
        if not isinstance(opaque, Mapping) or opaque.get("driver") != driver:
            continue
        parameters = opaque.get("parameters")
        sharing = parameters.get("sharing") if isinstance(parameters, Mapping) else None
        if isinstance(sharing, Mapping) and "backend" in sharing:
            raise AllocationError(
                f"ResourceClaim {key}: spec.devices.config[{index}].opaque.parameters.sharing.backend: "
                f"set to {str(sharing['backend'])[:16]!r}, but this cluster does not let claims choose the "
                "sharing backend (sharing.allowClaimBackendOverride is false); remove it: the node's "
                "--sharing or the DeviceClass's config decides"
            )
