"""The opaque ``GpuConfig``: per-claim (and per-class) sharing settings, decoded strictly.

A DeviceClass or a ResourceClaim may carry, for driver ``fractional.dev``::

    {"apiVersion": "fractional.dev/v1alpha1", "kind": "GpuConfig",
     "sharing": {"backend": "mps" | "hami" | "none",
                 "mps": {"defaultActiveThreadPercentage": 0..100},
                 "hami": {"coreUtilizationPolicy": "default" | "force" | "disable",
                          "activeOOMKiller": bool, "oversubscribe": bool,
                          "taskPriority": 0..1, "logLevel": 0..4}}}

The API server copies both into ``status.allocation.devices.config`` (class entries with
``source: FromClass``, claim entries with ``FromClaim``). Decoding is pure and strict: an unknown
field, a wrong type, an out-of-range value, or a wrong ``apiVersion``/``kind`` is a ``ClaimError``
naming the full field path.

Precedence (``resolve_share_configs``): for each allocated result, the configs whose ``requests``
name its request (``req`` matches ``req`` and every ``req/<sub>``; ``req/sub`` matches only that
subrequest; an empty list matches all) apply in order, class entries first, then claim entries;
the last one wins as a whole (fields are not merged across entries).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from driver import DRIVER_NAME
from driver.errors import ClaimError
from driver.plugin.claims import bounded, quoted

__all__ = [
    "API_VERSION",
    "GpuConfig",
    "HamiConfig",
    "KIND",
    "MpsConfig",
    "SharingConfig",
    "check_backend_compatible",
    "claim_key",
    "parse_gpu_config",
    "resolve_share_configs",
]

API_VERSION = "fractional.dev/v1alpha1"
KIND = "GpuConfig"
BACKENDS = ("mps", "hami", "none")
HAMI_CORE_POLICIES = ("default", "force", "disable")
_SOURCES = ("FromClass", "FromClaim")


@dataclass(frozen=True, slots=True)
class MpsConfig:
    default_active_thread_percentage: int | None = None  # applies to shares with compute 0

    def options(self) -> tuple[tuple[str, str], ...]:
        if self.default_active_thread_percentage is None:
            return ()
        return (("defaultActiveThreadPercentage", str(self.default_active_thread_percentage)),)


@dataclass(frozen=True, slots=True)
class HamiConfig:
    core_utilization_policy: str | None = None  # GPU_CORE_UTILIZATION_POLICY
    active_oom_killer: bool | None = None  # ACTIVE_OOM_KILLER
    oversubscribe: bool | None = None  # CUDA_OVERSUBSCRIBE (spill to host memory)
    task_priority: int | None = None  # CUDA_TASK_PRIORITY, 0 (high) or 1 (low)
    log_level: int | None = None  # LIBCUDA_LOG_LEVEL 0..4

    def options(self) -> tuple[tuple[str, str], ...]:
        pairs: list[tuple[str, str]] = []
        if self.core_utilization_policy is not None:
            pairs.append(("coreUtilizationPolicy", self.core_utilization_policy))
        if self.active_oom_killer is not None:
            pairs.append(("activeOOMKiller", "true" if self.active_oom_killer else "false"))
        if self.oversubscribe is not None:
            pairs.append(("oversubscribe", "true" if self.oversubscribe else "false"))
        if self.task_priority is not None:
            pairs.append(("taskPriority", str(self.task_priority)))
        if self.log_level is not None:
            pairs.append(("logLevel", str(self.log_level)))
        return tuple(pairs)


@dataclass(frozen=True, slots=True)
class SharingConfig:
    backend: str | None = None  # None: the node's --sharing
    mps: MpsConfig | None = None
    hami: HamiConfig | None = None


@dataclass(frozen=True, slots=True)
class GpuConfig:
    sharing: SharingConfig = SharingConfig()

    def effective_backend(self, node_default: str) -> str:
        """The backend for shares under this config: the config's, else the node's ``--sharing``."""
        return self.sharing.backend or node_default

    def backend_options(self, backend: str) -> tuple[tuple[str, str], ...]:
        """``ShareSpec.backend_options`` for ``backend`` (camelCase keys, string values)."""
        if backend == "mps" and self.sharing.mps is not None:
            return self.sharing.mps.options()
        if backend == "hami" and self.sharing.hami is not None:
            return self.sharing.hami.options()
        return ()


def claim_key(claim: Mapping[str, Any]) -> str:
    metadata = claim.get("metadata") or {}
    return f"{bounded(metadata.get('namespace', ''), 63)}/{bounded(metadata.get('name', ''), 253)}"


class _Decoder:
    """Reads one JSON object strictly, naming ``path.field`` in every error."""

    def __init__(self, claim: str) -> None:
        self.claim = claim

    def fail(self, path: str, problem: str) -> ClaimError:
        return ClaimError(claim=self.claim, field=path, problem=problem)

    def mapping(self, value: object, path: str, allowed: tuple[str, ...]) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            raise self.fail(path, f"expected an object, found {_type_name(value)}")
        for key in value:
            if key not in allowed:
                raise self.fail(
                    f"{path}.{bounded(key, 64)}", f"unknown field (expected one of {', '.join(allowed)})"
                )
        return value

    def string(self, value: object, path: str, choices: tuple[str, ...]) -> str:
        if not isinstance(value, str):
            raise self.fail(path, f"expected a string, found {_type_name(value)}")
        if value not in choices:
            raise self.fail(path, f"{quoted(value)} is not one of {', '.join(choices)}")
        return value

    def integer(self, value: object, path: str, low: int, high: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(path, f"expected an integer, found {_type_name(value)}")
        if not low <= value <= high:
            raise self.fail(path, f"{bounded(value, 64)} is outside {low}..{high}")
        return value

    def boolean(self, value: object, path: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(path, f"expected a boolean, found {_type_name(value)}")
        return value


def _type_name(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, list | tuple):
        return "a list"
    return type(value).__name__


def parse_gpu_config(parameters: object, *, claim: str, path: str = "parameters") -> GpuConfig:
    """Decode one opaque ``parameters`` object; ``path`` prefixes every error's field."""
    d = _Decoder(claim)
    top = d.mapping(parameters, path, ("apiVersion", "kind", "sharing"))
    if top.get("apiVersion") != API_VERSION:
        raise d.fail(f"{path}.apiVersion", f"{quoted(top.get('apiVersion'))} is not {API_VERSION!r}")
    if top.get("kind") != KIND:
        raise d.fail(f"{path}.kind", f"{quoted(top.get('kind'))} is not {KIND!r}")
    if "sharing" not in top:
        return GpuConfig()
    spath = f"{path}.sharing"
    sharing = d.mapping(top["sharing"], spath, ("backend", "mps", "hami"))
    backend = None
    if "backend" in sharing:
        backend = d.string(sharing["backend"], f"{spath}.backend", BACKENDS)
    mps = None
    if "mps" in sharing:
        mpath = f"{spath}.mps"
        fields = d.mapping(sharing["mps"], mpath, ("defaultActiveThreadPercentage",))
        percent = None
        if "defaultActiveThreadPercentage" in fields:
            percent = d.integer(
                fields["defaultActiveThreadPercentage"], f"{mpath}.defaultActiveThreadPercentage", 0, 100
            )
        mps = MpsConfig(default_active_thread_percentage=percent)
    hami = None
    if "hami" in sharing:
        hami = _parse_hami(d, sharing["hami"], f"{spath}.hami")
    for name, given in (("mps", mps), ("hami", hami)):
        if given is not None and backend is not None and backend != name:
            raise d.fail(f"{spath}.{name}", f"set, but {spath}.backend is {quoted(backend)}")
    return GpuConfig(sharing=SharingConfig(backend=backend, mps=mps, hami=hami))


def _parse_hami(d: _Decoder, value: object, path: str) -> HamiConfig:
    fields = d.mapping(
        value, path, ("coreUtilizationPolicy", "activeOOMKiller", "oversubscribe", "taskPriority", "logLevel")
    )
    policy = oom = oversubscribe = priority = level = None
    if "coreUtilizationPolicy" in fields:
        policy = d.string(
            fields["coreUtilizationPolicy"], f"{path}.coreUtilizationPolicy", HAMI_CORE_POLICIES
        )
    if "activeOOMKiller" in fields:
        oom = d.boolean(fields["activeOOMKiller"], f"{path}.activeOOMKiller")
    if "oversubscribe" in fields:
        oversubscribe = d.boolean(fields["oversubscribe"], f"{path}.oversubscribe")
    if "taskPriority" in fields:
        priority = d.integer(fields["taskPriority"], f"{path}.taskPriority", 0, 1)
    if "logLevel" in fields:
        level = d.integer(fields["logLevel"], f"{path}.logLevel", 0, 4)
    return HamiConfig(
        core_utilization_policy=policy,
        active_oom_killer=oom,
        oversubscribe=oversubscribe,
        task_priority=priority,
        log_level=level,
    )


def _applies(requests: tuple[str, ...], request: str) -> bool:
    if not requests:
        return True
    parent = request.split("/", 1)[0]
    return request in requests or parent in requests


def resolve_share_configs(
    claim: Mapping[str, Any], *, driver: str = DRIVER_NAME, allow_claim_backend: bool = True
) -> dict[str, GpuConfig | None]:
    """Each of our allocated results' request name (``req`` or ``req/sub``) -> its effective config.

    Pure. Every config entry for ``driver`` is decoded (a bad one fails the claim even when no
    result uses it); entries for other drivers are ignored. ``None``: no config applies. Without
    ``allow_claim_backend`` (the admin's ``--allow-claim-backend-override=false``), a claim's own
    entry (``FromClaim``) that names ``sharing.backend`` fails the claim, naming that field.
    """
    key = claim_key(claim)
    devices = ((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}
    entries: list[tuple[int, tuple[str, ...], GpuConfig]] = []
    for index, entry in enumerate(devices.get("config") or ()):
        path = f"status.allocation.devices.config[{index}]"
        if not isinstance(entry, Mapping):
            raise ClaimError(claim=key, field=path, problem=f"expected an object, found {_type_name(entry)}")
        opaque = entry.get("opaque") or {}
        if not isinstance(opaque, Mapping) or opaque.get("driver") != driver:
            continue
        source = entry.get("source")
        if source not in _SOURCES:
            raise ClaimError(
                claim=key,
                field=f"{path}.source",
                problem=f"{quoted(source)} is not one of FromClass, FromClaim",
            )
        config = parse_gpu_config(opaque.get("parameters"), claim=key, path=f"{path}.opaque.parameters")
        if source == "FromClaim" and config.sharing.backend is not None and not allow_claim_backend:
            raise ClaimError(
                claim=key,
                field=f"{path}.opaque.parameters.sharing.backend",
                problem=f"set to {quoted(config.sharing.backend)}, but this node does not let claims choose "
                "the sharing backend (--allow-claim-backend-override=false): remove it; the node's "
                "--sharing or the DeviceClass's config decides",
            )
        raw_requests = entry.get("requests") or ()
        if not isinstance(raw_requests, list | tuple):
            raise ClaimError(claim=key, field=f"{path}.requests", problem="expected a list")
        requests = tuple(str(request) for request in raw_requests)
        entries.append((_SOURCES.index(source), requests, config))
    entries.sort(key=lambda item: item[0])  # stable: class entries first, each group in order
    resolved: dict[str, GpuConfig | None] = {}
    for result in devices.get("results") or ():
        if not isinstance(result, Mapping) or result.get("driver") != driver:
            continue
        request = result.get("request", "")
        effective: GpuConfig | None = None
        for _, requests, config in entries:
            if _applies(requests, request):
                effective = config
        resolved[request] = effective
    return resolved


def check_backend_compatible(existing: str | None, wanted: str, device: str, *, claim: str = "") -> None:
    """Refuse a share whose backend cannot live beside the GPU's current shares.

    ``existing`` is the backend of the shares already prepared on ``device`` (None: no shares).
    Rules: same backend is fine; ``hami`` and ``none`` mix (neither changes the device: HAMi-core
    only limits the processes it is loaded into); ``mps`` mixes with nothing else, because an MPS
    GPU runs in EXCLUSIVE_PROCESS compute mode, where a process that is not an MPS client cannot
    create a context while the MPS server holds the device.
    """
    if existing is None or existing == wanted:
        return
    if "mps" not in (existing, wanted):
        return
    raise ClaimError(
        claim=claim,
        field="sharing.backend",
        problem=(
            f"{device} is already shared with backend {existing!r}; a share with backend {wanted!r} "
            "cannot join it (an MPS GPU runs in EXCLUSIVE_PROCESS mode and accepts only MPS clients)"
        ),
    )
