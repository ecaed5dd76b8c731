"""The gang API (``scheduling.k8s.io`` Workload and PodGroup) as each release serves it, for the
embedded API emulator (a test double).

``--kubernetes-version`` picks the release; no alpha is carried forward (KEP-4671; kubernetes
``staging/src/k8s.io/api/scheduling/<version>/types.go`` of each release):

- 1.35: ``v1alpha1`` Workload (``spec.podGroups``, immutable); pods carry ``spec.workloadRef``;
- 1.36: ``v1alpha2`` Workload (``podGroupTemplates``, immutable) and PodGroup (spec immutable);
  pods carry ``spec.schedulingGroup``;
- 1.37: ``v1beta1`` and ``v1alpha3`` (same shapes; v1alpha3 adds CompositePodGroup): PodGroup
  ``workloadRef``, spec immutable except ``schedulingPolicy.gang.minCount``.

A PodGroup's ``gang.minCount`` is at least 1 (0 is "Required value", as Go reads an unset int).

Objects are validated with that release's official schema (``kubernetes-validate``, strict), pods
too (``ObjectValidator(schema_version=...)``). Departures: the two 1.37 versions share storage and
an object keeps the ``apiVersion`` it was written with (no conversion); the ``GenericWorkload``
gate is always on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from driver.cluster.apiserver.crd import CustomResources
from driver.cluster.apiserver.request import FieldValidation
from driver.cluster.apiserver.schema import SchemaViolation, schema_check
from driver.cluster.apiserver.store import ResourceType, Store
from driver.cluster.apiserver.validation import format_path, invalid_error, schema_file

__all__ = [
    "DEFAULT_KUBERNETES_VERSION",
    "KUBERNETES_VERSIONS",
    "SchedulingResourceType",
    "ServedResources",
    "scheduling_types",
]

Obj = dict[str, Any]
KUBERNETES_VERSIONS = ("1.35", "1.36", "1.37")
DEFAULT_KUBERNETES_VERSION = "1.37"
_GROUP = "scheduling.k8s.io"
_SERVED: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "1.35": (("v1alpha1", ("Workload",)),),
    "1.36": (("v1alpha2", ("Workload", "PodGroup")),),
    "1.37": (
        ("v1beta1", ("Workload", "PodGroup")),
        ("v1alpha3", ("Workload", "PodGroup", "CompositePodGroup")),
    ),
}


@dataclass(frozen=True, slots=True)
class SchedulingResourceType(ResourceType):
    """A ``scheduling.k8s.io`` gang kind at one release's version."""

    release: str = DEFAULT_KUBERNETES_VERSION
    status_reset_on_create: bool = False

    def validate_custom(
        self,
        obj: Obj,
        old: Obj | None,
        *,
        field_validation: FieldValidation | None = None,
        warnings: list[str] | None = None,
    ) -> Obj:
        """The release's strict schema, then the update rules (spec immutable; on 1.37 a
        PodGroup's ``gang.minCount`` may change)."""
        del field_validation, warnings  # unknown fields are refused, as with the emulator's own writes
        name = str((obj.get("metadata") or {}).get("name", ""))
        try:
            schema_check(schema_file(self), self.release)(obj, ())
        except SchemaViolation as violation:
            field = format_path(violation.path) or "<root>"
            problem = (
                f'Invalid value: unknown field "{field}"'
                if violation.kind == "unknown"
                else violation.problem
            )
            raise invalid_error(self, name, [(field, problem)]) from None
        if self.kind == "PodGroup" and (causes := _check_gang(obj)):
            raise invalid_error(self, name, causes)
        if old is not None and _spec_without_mutable(self, obj) != _spec_without_mutable(self, old):
            raise invalid_error(self, name, [("spec", "Invalid value: field is immutable")])
        return obj


def _check_gang(obj: Obj) -> list[tuple[str, str]]:
    """A gang's ``minCount`` is at least 1; 0 reads as unset (``+required``), as Go decodes it."""
    gang = ((obj.get("spec") or {}).get("schedulingPolicy") or {}).get("gang")
    if not isinstance(gang, dict):
        return []
    field = "spec.schedulingPolicy.gang.minCount"
    count = gang.get("minCount")
    if count is None or count == 0:
        return [(field, "Required value")]
    if isinstance(count, int) and count < 1:
        return [(field, f"Invalid value: {count}: must be greater than or equal to 1")]
    return []


def _spec_without_mutable(rtype: SchedulingResourceType, obj: Obj) -> Any:
    spec = dict(obj.get("spec") or {})
    if rtype.kind == "PodGroup" and rtype.release >= "1.37":
        policy = dict(spec.get("schedulingPolicy") or {})
        if isinstance(policy.get("gang"), dict):
            policy["gang"] = {k: v for k, v in policy["gang"].items() if k != "minCount"}
        spec["schedulingPolicy"] = policy
    return spec


def scheduling_types(release: str) -> tuple[SchedulingResourceType, ...]:
    """The gang kinds ``release`` serves."""
    if release not in _SERVED:
        raise ValueError(f"kubernetes version {release!r}: expected one of {', '.join(KUBERNETES_VERSIONS)}")
    types: list[SchedulingResourceType] = []
    for version, kinds in _SERVED[release]:
        for kind in kinds:
            types.append(
                SchedulingResourceType(
                    _GROUP,
                    version,
                    kind.lower() + "s",
                    kind,
                    namespaced=True,
                    status_subresource=kind != "Workload",
                    status_reset_on_create=kind != "Workload",  # status is kube-scheduler's to write
                    returns_object_on_delete=True,
                    release=release,
                )
            )
    return tuple(types)


class ServedResources(CustomResources):
    """The kinds served besides the built-in table: the release's gang kinds, then those of CRDs."""

    def __init__(self, store: Store, release: str = DEFAULT_KUBERNETES_VERSION) -> None:
        super().__init__(store)
        self.release = release
        self._scheduling = {(t.group, t.version, t.plural): t for t in scheduling_types(release)}

    def find(self, group: str, version: str, plural: str) -> ResourceType | None:
        found = self._scheduling.get((group, version, plural))
        return found if found is not None else super().find(group, version, plural)

    def types(self) -> tuple[ResourceType, ...]:
        return (*self._scheduling.values(), *super().types())
