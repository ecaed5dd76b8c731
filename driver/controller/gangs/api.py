"""Which gang API the server serves: ``scheduling.k8s.io`` Workload and PodGroup change shape and
version with every release, and no alpha version is carried forward (KEP-4671; kubernetes
``staging/src/k8s.io/api/scheduling/<version>/types.go`` of each release):

- 1.35: ``v1alpha1``, Workload only (pods point at it with ``spec.workloadRef``);
- 1.36: ``v1alpha2``, Workload templates and PodGroup (pods use ``spec.schedulingGroup``);
- 1.37: ``v1beta1`` and ``v1alpha3`` (PodGroup ``workloadRef``, mutable ``minCount``).

``choose_gang_api`` is pure over the discovery documents; ``discover_gang_api`` reads them (``/apis``
and each candidate version's resource list). The controller discovers at start and on each
resync, logs the choice and exports it as ``fractional_controller_gang_api_info``; when the choice
changes it watches the new version.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kubernetes import client

from driver.controller.view.cache import Kind
from driver.kube import REQUEST_TIMEOUT_SECONDS, api_errors

__all__ = ["SCHEDULING_GROUP", "GangApi", "choose_gang_api", "discover_gang_api"]

SCHEDULING_GROUP = "scheduling.k8s.io"
PREFERRED_VERSIONS = ("v1beta1", "v1alpha3", "v1alpha2", "v1alpha1")  # newest shape first
_CRD_GROUPS = {
    Kind.COSCHEDULING_PODGROUP: "scheduling.x-k8s.io",
    Kind.VOLCANO_PODGROUP: "scheduling.volcano.sh",
}


@dataclass(frozen=True, slots=True)
class GangApi:
    """What the controller watches for gangs: ``resources`` maps a cache kind to (group, version,
    plural); ``groups`` are every API group served (a marker's group turns its source on)."""

    version: str | None  # the scheduling.k8s.io version in use; None when the server serves none
    resources: tuple[tuple[Kind, tuple[str, str, str]], ...] = ()
    groups: frozenset[str] = frozenset()

    def describe(self) -> str:
        if self.version is None:
            return "none"
        kinds = sorted(kind.value for kind, (group, _, _) in self.resources if group == SCHEDULING_GROUP)
        return f"{SCHEDULING_GROUP}/{self.version} ({', '.join(kinds)})"


def _versions(group_list: dict[str, Any]) -> dict[str, list[str]]:
    return {
        str(group.get("name")): [str(v.get("version")) for v in group.get("versions") or ()]
        for group in group_list.get("groups") or ()
    }


def choose_gang_api(
    group_list: dict[str, Any], resource_lists: dict[tuple[str, str], dict[str, Any]]
) -> GangApi:
    """``group_list``: the ``/apis`` APIGroupList; ``resource_lists``: (group, version) -> its
    APIResourceList (the candidates ``wanted_lists`` names). Pure."""
    versions = _versions(group_list)
    resources: list[tuple[Kind, tuple[str, str, str]]] = []
    chosen: str | None = None
    for version in PREFERRED_VERSIONS:
        if version not in versions.get(SCHEDULING_GROUP, ()):
            continue
        served = {
            str(r.get("name"))
            for r in (resource_lists.get((SCHEDULING_GROUP, version)) or {}).get("resources") or ()
        }
        kinds = [k for k in (Kind.WORKLOAD, Kind.PODGROUP) if k.value in served]
        if kinds:
            chosen = version
            resources += [(k, (SCHEDULING_GROUP, version, k.value)) for k in kinds]
            break
    for kind, group in _CRD_GROUPS.items():
        group_versions = versions.get(group) or []
        for version in group_versions:
            served = {
                str(r.get("name"))
                for r in (resource_lists.get((group, version)) or {}).get("resources") or ()
            }
            if "podgroups" in served:
                resources.append((kind, (group, version, "podgroups")))
                break
    return GangApi(version=chosen, resources=tuple(resources), groups=frozenset(versions))


def wanted_lists(group_list: dict[str, Any]) -> list[tuple[str, str]]:
    """The (group, version) resource lists ``choose_gang_api`` needs."""
    versions = _versions(group_list)
    wanted = [(SCHEDULING_GROUP, v) for v in PREFERRED_VERSIONS if v in versions.get(SCHEDULING_GROUP, ())]
    for group in _CRD_GROUPS.values():
        wanted += [(group, v) for v in versions.get(group) or ()]
    return wanted


def discover_gang_api(api_client: client.ApiClient) -> GangApi:
    """Read ``/apis`` and the candidate versions' resource lists; raises our errors (``kube.errors``)."""
    with api_errors("discover API groups"):
        response = client.ApisApi(api_client).get_api_versions(
            _preload_content=False, _request_timeout=REQUEST_TIMEOUT_SECONDS
        )
    group_list = json.loads(response.data)  # type: ignore[attr-defined]  # raw: _preload_content=False
    lists: dict[tuple[str, str], dict[str, Any]] = {}
    custom = client.CustomObjectsApi(api_client)
    for group, version in wanted_lists(group_list):
        with api_errors(f"discover {group}/{version}"):
            answer = custom.get_api_resources(
                group, version, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_SECONDS
            )
        lists[(group, version)] = json.loads(answer.data)  # type: ignore[attr-defined]
    return choose_gang_api(group_list, lists)
