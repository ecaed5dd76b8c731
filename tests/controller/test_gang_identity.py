"""Gang identity: each source read from the pod, first match wins, sizes from the pods or
the gang objects, the flag, and the served-version choice. Pure functions; no server."""

from __future__ import annotations

from typing import Any

import pytest

from driver.controller.gangs.api import choose_gang_api
from driver.controller.model.gang_identity import (
    ALL_SOURCES,
    GangSource,
    default_sources,
    gangs_of_object,
    identify,
    parse_gang_sources,
    podgroup_claim,
    resolve,
)
from driver.controller.model.objects import ClaimRef
from driver.errors import ConfigError


def pod(
    *, labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None, **spec: Any
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "p0",
            "namespace": "ml",
            "labels": labels or {},
            "annotations": annotations or {},
        },
        "spec": {"containers": [{"name": "c", "image": "x"}], **spec},
    }


PODGROUP = {
    "apiVersion": "scheduling.k8s.io/v1beta1",
    "kind": "PodGroup",
    "metadata": {"name": "train-0", "namespace": "ml", "uid": "u1"},
    "spec": {
        "schedulingPolicy": {"gang": {"minCount": 4}},
        "schedulingConstraints": {"topology": [{"key": "example.com/rack"}]},
        "resourceClaims": [{"name": "nic", "resourceClaimTemplateName": "fabric"}],
    },
    "status": {"resourceClaimStatuses": [{"name": "nic", "resourceClaimName": "train-0-nic-x"}]},
}
WORKLOAD = {
    "apiVersion": "scheduling.k8s.io/v1alpha1",
    "kind": "Workload",
    "metadata": {"name": "train", "namespace": "ml", "uid": "u2"},
    "spec": {
        "podGroups": [
            {"name": "workers", "policy": {"gang": {"minCount": 3}}},
            {"name": "aux", "policy": {"basic": {}}},
        ]
    },
}
COSCHED = {"metadata": {"name": "g", "namespace": "ml", "uid": "u3"}, "spec": {"minMember": 5}}
VOLCANO = {"metadata": {"name": "v", "namespace": "ml", "uid": "u4"}, "spec": {"minMember": 6}}
OBJECTS = {
    ("podgroups", "ml/train-0"): PODGROUP,
    ("workloads", "ml/train"): WORKLOAD,
    ("podgroups.scheduling.x-k8s.io", "ml/g"): COSCHED,
    ("podgroups.scheduling.volcano.sh", "ml/v"): VOLCANO,
}


def lookup(kind: str, key: str) -> dict[str, Any] | None:
    return OBJECTS.get((kind, key))


@pytest.mark.parametrize(
    ("the_pod", "source", "key", "min_count"),
    [
        (pod(schedulingGroup={"podGroupName": "train-0"}), GangSource.PODGROUP, "ml/podgroup:train-0", 4),
        (
            pod(workloadRef={"name": "train", "podGroup": "workers", "podGroupReplicaKey": "1"}),
            GangSource.WORKLOAD,
            "ml/workload:train:workers:1",
            3,
        ),
        (
            pod(labels={"fractional.dev/gang": "g1"}, annotations={"fractional.dev/gang-size": "2"}),
            GangSource.FRACTIONAL,
            "ml/g1",
            2,
        ),
        (pod(labels={"scheduling.x-k8s.io/pod-group": "g"}), GangSource.COSCHEDULING, "ml/coscheduling:g", 5),
        (
            pod(
                labels={"kueue.x-k8s.io/pod-group-name": "k"},
                annotations={"kueue.x-k8s.io/pod-group-total-count": "7"},
            ),
            GangSource.KUEUE,
            "ml/kueue:k",
            7,
        ),
        (
            pod(
                labels={"leaderworkerset.sigs.k8s.io/group-key": "abc"},
                annotations={"leaderworkerset.sigs.k8s.io/size": "8"},
            ),
            GangSource.LWS,
            "ml/lws:abc",
            8,
        ),
        (pod(annotations={"scheduling.k8s.io/group-name": "v"}), GangSource.VOLCANO, "ml/volcano:v", 6),
        (pod(), None, "ml/pod:p0", 1),
    ],
)
def test_each_source_names_its_gang_and_size(
    the_pod: dict[str, Any], source: GangSource | None, key: str, min_count: int
) -> None:
    ref = identify(the_pod)
    assert (ref.source, ref.key) == (source, key)
    assert resolve(ref, lookup).min_count == min_count


def test_replica_keys_are_separate_gangs_and_a_workload_event_targets_it() -> None:
    a = identify(pod(workloadRef={"name": "train", "podGroup": "workers", "podGroupReplicaKey": "0"}))
    b = identify(pod(workloadRef={"name": "train", "podGroup": "workers", "podGroupReplicaKey": "1"}))
    assert a.key != b.key
    spec = resolve(a, lookup)
    assert spec.target is not None and (spec.target["kind"], spec.target["name"]) == ("Workload", "train")
    assert gangs_of_object("workloads", WORKLOAD, [a.key, b.key, "ml/other"]) == [a.key, b.key]


def test_first_match_wins_and_sources_can_be_turned_off() -> None:
    both = pod(schedulingGroup={"podGroupName": "train-0"}, labels={"fractional.dev/gang": "mine"})
    assert identify(both).source is GangSource.PODGROUP
    assert identify(both, ALL_SOURCES - {GangSource.PODGROUP}).key == "ml/mine"
    assert identify(both, frozenset()).key == "ml/pod:p0"


def test_podgroup_spec_topology_claims_and_basic_policy() -> None:
    spec = resolve(identify(pod(schedulingGroup={"podGroupName": "train-0"})), lookup)
    assert spec.topology_key == "example.com/rack"
    assert spec.target is not None and spec.target["kind"] == "PodGroup"
    basic = resolve(identify(pod(workloadRef={"name": "train", "podGroup": "aux"})), lookup)
    assert basic.basic and basic.min_count == 1


def test_a_missing_object_waits_and_a_bad_size_is_named() -> None:
    waiting = resolve(identify(pod(schedulingGroup={"podGroupName": "later"})), lookup)
    assert waiting.min_count is None and "does not exist yet" in waiting.waiting
    bad = resolve(
        identify(
            pod(
                labels={"kueue.x-k8s.io/pod-group-name": "k"},
                annotations={"kueue.x-k8s.io/pod-group-total-count": "x"},
            )
        ),
        lookup,
    )
    assert "kueue.x-k8s.io/pod-group-total-count" in bad.invalid
    whole = resolve(identify(pod(labels={"fractional.dev/gang": "g"})), lookup)
    assert whole.whole  # our label without a size: the pods present


def test_a_pod_claim_matching_the_podgroup_claim_resolves_to_the_generated_claim() -> None:
    the_pod = pod(
        schedulingGroup={"podGroupName": "train-0"},
        resourceClaims=[
            {"name": "nic", "resourceClaimTemplateName": "fabric"},
            {"name": "own", "resourceClaimTemplateName": "fabric"},
        ],
    )
    spec = resolve(identify(the_pod), lookup)
    shared = podgroup_claim(the_pod, ClaimRef(entry="nic", claim_name=None, from_template=True), spec)
    assert shared.claim_name == "train-0-nic-x"
    own = podgroup_claim(the_pod, ClaimRef(entry="own", claim_name=None, from_template=True), spec)
    assert own.claim_name is None  # same template, another name: not the PodGroup's claim


def test_the_flag_and_the_default() -> None:
    assert parse_gang_sources("auto") is None
    assert parse_gang_sources("upstream,lws") == {GangSource.PODGROUP, GangSource.WORKLOAD, GangSource.LWS}
    with pytest.raises(ConfigError, match="--gang-sources"):
        parse_gang_sources("slurm")
    assert default_sources(["scheduling.k8s.io", "kueue.x-k8s.io"]) == {
        GangSource.PODGROUP,
        GangSource.WORKLOAD,
        GangSource.FRACTIONAL,
        GangSource.KUEUE,
    }


def _groups(*entries: tuple[str, list[str]]) -> dict[str, Any]:
    return {"groups": [{"name": g, "versions": [{"version": v} for v in vs]} for g, vs in entries]}


@pytest.mark.parametrize(
    ("versions", "served", "expected"),
    [
        (["v1", "v1alpha1"], {"v1alpha1": ["workloads"]}, "v1alpha1"),
        (["v1", "v1alpha2"], {"v1alpha2": ["workloads", "podgroups"]}, "v1alpha2"),
        (
            ["v1", "v1alpha3", "v1beta1"],
            {"v1alpha3": ["workloads", "podgroups"], "v1beta1": ["workloads", "podgroups"]},
            "v1beta1",
        ),
        (["v1"], {}, None),
    ],
)
def test_the_served_version_is_chosen_newest_shape_first(
    versions: list[str], served: dict[str, list[str]], expected: str | None
) -> None:
    lists = {
        ("scheduling.k8s.io", v): {"resources": [{"name": n} for n in names]} for v, names in served.items()
    }
    api = choose_gang_api(_groups(("scheduling.k8s.io", versions)), lists)
    assert api.version == expected


def test_why_names_a_gang_of_any_source() -> None:
    from driver.why import ClusterView, explain_pod

    lws = [
        pod(labels={"leaderworkerset.sigs.k8s.io/group-key": "abc"},
            annotations={"leaderworkerset.sigs.k8s.io/size": "3"},
            schedulingGates=[{"name": "fractional.dev/allocation"}]),
    ]  # fmt: skip
    view = ClusterView(pods=lws, claims=[], all_claims=[], slices=[], classes=[], nodes=[], events=[])
    lines = explain_pod(lws[0], view)
    assert "gang ml/lws:abc: 3 pods expected, 1 present, 1 gated" in lines
    assert "  waits for 2 more pod(s) of the gang to exist" in lines
