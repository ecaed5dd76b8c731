"""The emulator's managedFields: which fields a write changed (``apply._changed``).

kube-apiserver gives the writer of an update every field whose value it changed. The emulator's
definition: a leaf path of the new object's FieldsV1 changed when the old object lacks it or holds
another value there (``_lookup``). Computed that way, path by path from the root, it was a third of
the emulator's time under a backlog of claim and pod writes, so ``_changed`` walks both objects
together and skips a field whose value is the same in both. These tests hold it to the definition.
"""

from __future__ import annotations

import copy
import random
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from driver.cluster.apiserver import apply
from driver.cluster.apiserver.strategy import ResourceType

POD = ResourceType("", "v1", "pods", "Pod", namespaced=True)
CLAIM = ResourceType("resource.k8s.io", "v1", "resourceclaims", "ResourceClaim", namespaced=True)

A_POD: dict[str, Any] = {
    "apiVersion": "v1", "kind": "Pod",
    "metadata": {"name": "p", "namespace": "d", "labels": {"a": "1", "b": "2"}, "annotations": {"x": "y"},
                 "finalizers": ["f1"], "resourceVersion": "5"},
    "spec": {
        "schedulingGates": [{"name": "g1"}, {"name": "g2"}],
        "containers": [{"name": "c", "image": "i", "ports": [{"containerPort": 80, "protocol": "TCP"}],
                        "env": [{"name": "A", "value": "1"}],
                        "resources": {"requests": {"cpu": "1"}, "claims": [{"name": "gpu"}]}}],
        "resourceClaims": [{"name": "gpu", "resourceClaimName": "x"}],
        "tolerations": [{"key": "k", "operator": "Exists"}], "nodeSelector": {"n": "1"},
    },
    "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False"}]},
}  # fmt: skip
A_CLAIM: dict[str, Any] = {
    "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
    "metadata": {"name": "c", "namespace": "d", "finalizers": ["a"]},
    "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
        "deviceClassName": "g", "capacity": {"requests": {"memory": "1Gi"}}}}]}},
    "status": {
        "allocation": {"devices": {"results": [{"request": "gpu", "driver": "d", "pool": "p", "device": "g0",
                                                "shareID": "s", "consumedCapacity": {"memory": "1Gi"}}]}},
        "reservedFor": [{"resource": "pods", "name": "p", "uid": "u"}],
    },
}  # fmt: skip


def _mutated(obj: dict[str, Any], rnd: random.Random) -> dict[str, Any]:
    """A few random edits: fields removed, added or replaced, list items dropped or added (a second
    item of a map list's key among them), nested."""
    obj = copy.deepcopy(obj)

    def edit(node: Any) -> None:
        if isinstance(node, dict) and node:
            key = rnd.choice(list(node))
            roll = rnd.random()
            if roll < 0.2:
                del node[key]
            elif roll < 0.35:
                node[key + "z"] = "new"
            elif roll < 0.5 or not isinstance(node[key], dict | list):
                node[key] = rnd.choice(["v", 1, True, {"q": 1}])
            else:
                edit(node[key])
        elif isinstance(node, list) and node:
            index = rnd.randrange(len(node))
            roll = rnd.random()
            if roll < 0.2:
                node.pop(index)
            elif roll < 0.3 and isinstance(node[index], dict):
                node.append({**node[index], "name": f"n{rnd.randrange(9)}"})
            elif roll < 0.4 and isinstance(node[index], dict):  # the same key again, another value
                node.append({**node[index], "extra": rnd.randrange(9)})
            elif isinstance(node[index], dict | list):
                edit(node[index])
            else:
                node[index] = "w"

    for _ in range(rnd.randint(1, 4)):
        edit(obj)
    return obj


def _by_definition(old: Any, new: Any, schema: dict[str, Any], status: bool) -> set[Any]:
    new_paths = apply._flatten(apply.fields_of(new, schema, top=True, status=status))
    old_paths = apply._flatten(apply.fields_of(old, schema, top=True, status=status))
    return {p for p in new_paths if p not in old_paths or apply._lookup(old, p) != apply._lookup(new, p)}


@settings(max_examples=500, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), which=st.sampled_from([(POD, A_POD), (CLAIM, A_CLAIM)]),
       status=st.booleans(), same=st.booleans())  # fmt: skip
def test_the_changed_fields_are_those_of_the_definition(
    seed: int, which: tuple[ResourceType, dict[str, Any]], status: bool, same: bool
) -> None:
    rnd = random.Random(seed)
    rtype, base = which
    old = _mutated(base, rnd)
    new = copy.deepcopy(old) if same else _mutated(old, rnd)
    schema = apply._root_schema(rtype)
    try:
        old_paths = apply._flatten(apply.fields_of(old, schema, top=True, status=status))
        new_fields = apply.fields_of(new, schema, top=True, status=status)
    except (TypeError, AttributeError):
        return  # a shape validation refuses before any write reaches the field manager
    changed = apply._changed(new_fields, (True, old), new, old_paths)
    assert changed == _by_definition(old, new, schema, status)
    if same:
        assert not changed


def test_a_status_write_owns_what_it_changed_and_the_spec_stays_with_its_writer() -> None:
    created = apply.record_update(CLAIM, None, {**A_CLAIM, "status": {}}, manager="kubectl")
    allocated = {**created, "status": A_CLAIM["status"]}
    written = apply.record_update(CLAIM, created, allocated, manager="controller", subresource="status")
    entries = {
        (e["manager"], e.get("subresource")): e["fieldsV1"] for e in written["metadata"]["managedFields"]
    }
    assert set(entries) == {("kubectl", None), ("controller", "status")}
    assert set(entries[("controller", "status")]["f:status"]) == {"f:allocation", "f:reservedFor"}
    assert "f:spec" in entries[("kubectl", None)] and "f:status" not in entries[("kubectl", None)]


def test_a_second_item_under_a_map_lists_key_is_compared_as_the_definition_does() -> None:
    """Lookup takes a map list's first item of a key, the FieldsV1 tree its last: an item whose key
    repeats is never skipped as unchanged just because the first one is."""
    old = copy.deepcopy(A_POD)
    new = copy.deepcopy(old)
    new["spec"]["containers"].append({**new["spec"]["containers"][0], "extra": 1})
    schema = apply._root_schema(POD)
    old_paths = apply._flatten(apply.fields_of(old, schema, top=True))
    changed = apply._changed(apply.fields_of(new, schema, top=True), (True, old), new, old_paths)
    assert (
        changed
        == _by_definition(old, new, schema, False)
        == {("f:spec", "f:containers", 'k:{"name":"c"}', "f:extra")}
    )


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), which=st.sampled_from([(POD, A_POD), (CLAIM, A_CLAIM)]),
       status=st.booleans(), same=st.booleans())  # fmt: skip
def test_both_sides_walked_together_give_the_trees_walked_apart(
    seed: int, which: tuple[ResourceType, dict[str, Any]], status: bool, same: bool
) -> None:
    """``_fields_pair`` shares the tree of a field equal on both sides (a pod's spec on a status
    write): the trees, and so the paths and the entries a write records, are those of two walks."""
    rnd = random.Random(seed)
    rtype, base = which
    old = _mutated(base, rnd)
    new = copy.deepcopy(old) if same else _mutated(old, rnd)
    schema = apply._root_schema(rtype)
    try:
        apart = (apply.fields_of(old, schema, top=True, status=status),
                 apply.fields_of(new, schema, top=True, status=status))  # fmt: skip
    except (TypeError, AttributeError):
        return
    together = apply._fields_pair(old, new, schema, top=True, status=status)
    assert together == apart
    memo: dict[int, set[Any]] = {}
    assert apply._flatten(together[1], memo=memo) == apply._flatten(apart[1])
    assert apply._flatten(together[0], memo=memo) == apply._flatten(apart[0])
