"""The victim search (driver/controller/preemption/victims.py) over the real allocator: which running
lower-priority pods a gang evicts, cheapest first by that module's cost order, with gangs whole and
budgets heeded."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from driver.allocator import ClusterState
from driver.controller.model.objects import GANG_LABEL, object_key
from driver.controller.preemption.victims import (
    Budget,
    Placement,
    VictimUnit,
    build_victim_units,
    choose_victims,
    count_violations,
    parse_budget,
    pod_priority,
    preemption_refusal,
)
from tests.allocator.allocator_builders import node_slice, our_classes, share

GI = 1 << 30


def running_pod(name: str, claims: list[str], *, priority: int, gang: str | None = None,
                labels: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    meta: dict[str, Any] = {"name": name, "namespace": "default", "labels": dict(labels or {})}
    if gang:
        meta["labels"][GANG_LABEL] = gang
    return {
        "metadata": meta,
        "spec": {
            "priority": priority,
            "priorityClassName": f"p{priority}",
            "resourceClaims": [{"name": f"c{i}", "resourceClaimName": c} for i, c in enumerate(claims)],
            "containers": [{"name": "main", "image": "x"}],
        },
        "status": {"phase": "Running"},
    }


def held_share(name: str, device: str, memory_gi: int, *, node: str = "node1") -> dict[str, Any]:
    claim = share(name, memory_gi)
    claim["status"] = {
        "allocation": {
            "devices": {
                "results": [{
                    "request": "gpu", "driver": "fractional.dev", "pool": node, "device": device,
                    "shareID": str(uuid.uuid4()),
                    "consumedCapacity": {"memory": f"{memory_gi}Gi", "compute": "0"},
                }]
            },
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [node]}]}]},
        }
    }  # fmt: skip
    return claim


class World:
    """One or more 4-GPU nodes of 40 GiB GPUs, shares placed by hand, the allocator as fit check."""

    def __init__(self, nodes: tuple[str, ...] = ("node1",)) -> None:
        self.state = ClusterState()
        for device_class in our_classes():
            self.state.upsert_class(device_class)
        for node in nodes:
            self.state.upsert_node(node, {"kubernetes.io/hostname": node})
            self.state.upsert_slice(node_slice(node, gpus=4, memory_gi=40))
        self.pods: list[dict[str, Any]] = []
        self.claims: dict[str, dict[str, Any]] = {}
        self.allocate_calls = 0

    def place(self, pod: str, device: str, memory_gi: int, *, priority: int, node: str = "node1",
              gang: str | None = None, labels: dict[str, str] | None = None) -> None:  # fmt: skip
        claim = held_share(f"{pod}-claim", device, memory_gi, node=node)
        self.claims[str(object_key(claim))] = claim
        self.state.upsert_claim(claim)
        self.pods.append(running_pod(pod, [f"{pod}-claim"], priority=priority, gang=gang, labels=labels))

    def units(self, below: int) -> list[VictimUnit]:
        return build_victim_units(self.pods, self.claims, below_priority=below)

    def fits_for(self, gang_claims: list[dict[str, Any]], units: list[VictimUnit]) -> Any:
        by_key = {u.key: u for u in units}

        def fits(removed: frozenset[str]) -> Placement | None:
            released = [c for k in removed for c in by_key[k].claims]
            for claim in released:
                self.state.remove_claim(claim["metadata"]["uid"])
            try:
                self.allocate_calls += 1
                groups = [[i] for i in range(len(gang_claims))]
                result = self.state.allocate(gang_claims, policy="best-fit", pod_groups=groups)
            finally:
                for claim in released:
                    self.state.upsert_claim(claim)
            if result is None:
                return None
            return Placement(allocations=tuple(zip(gang_claims, result, strict=True)), pod_nodes=())

        return fits

    def choose(self, gang_claims: list[dict[str, Any]], *, priority: int, budgets: list[Budget] | None = None
               ) -> tuple[list[str], Any]:  # fmt: skip
        units = self.units(priority)
        choice = choose_victims(units, fits=self.fits_for(gang_claims, units), budgets=budgets or [])
        if choice is None:
            return [], None
        return sorted(str(object_key(p)).split("/")[1] for u in choice.victims for p in u.pods), choice


def whole_gpus(count: int) -> list[dict[str, Any]]:
    return [share(f"want-{i}", 40) for i in range(count)]


def test_the_cheapest_victims_are_chosen_exactly() -> None:
    world = World()
    world.place("a1", "gpu-0", 20, priority=10)
    world.place("a2", "gpu-0", 20, priority=10)
    world.place("b", "gpu-1", 20, priority=10)
    world.place("c", "gpu-2", 20, priority=50)
    world.place("d", "gpu-3", 20, priority=10)
    victims, choice = world.choose(whole_gpus(2), priority=1000)
    assert victims == ["b", "d"]  # two victims at 10, not three at 10, nor one at 50 beside one at 10
    assert choice.cost.priorities == (10, 10)
    used = {a["devices"]["results"][0]["device"] for _, a in choice.placement.allocations}
    assert used == {"gpu-1", "gpu-3"}


def test_one_higher_priority_victim_costs_more_than_several_lower_ones() -> None:
    world = World()
    world.place("low1", "gpu-0", 10, priority=5)
    world.place("low2", "gpu-0", 10, priority=5)
    world.place("low3", "gpu-0", 10, priority=5)
    world.place("mid", "gpu-1", 20, priority=50)
    world.place("high1", "gpu-2", 20, priority=2000)
    world.place("high2", "gpu-3", 20, priority=2000)
    victims, _ = world.choose(whole_gpus(1), priority=1000)
    assert victims == ["low1", "low2", "low3"]  # kube-scheduler: the lowest highest-priority first


def test_a_release_that_frees_a_whole_gpu_is_preferred() -> None:
    world = World()
    world.place("f1", "gpu-0", 30, priority=10)
    world.place("g", "gpu-0", 10, priority=100)
    world.place("f2", "gpu-1", 40, priority=10)
    world.place("h1", "gpu-2", 40, priority=2000)
    world.place("h2", "gpu-3", 40, priority=2000)
    victims, choice = world.choose([share("want", 20)], priority=1000)
    assert victims == ["f2"]  # f1 would free room too, but leave g's share beside it
    assert choice.cost.shares_left_beside == 0


def test_no_victims_of_equal_or_higher_priority() -> None:
    world = World()
    for index in range(4):
        world.place(f"same{index}", f"gpu-{index}", 40, priority=1000)
    assert world.units(1000) == []
    assert world.choose(whole_gpus(1), priority=1000) == ([], None)
    assert world.choose(whole_gpus(1), priority=1001)[0] == ["same0"]


def test_a_preemptor_that_cannot_fit_even_after_evictions_chooses_no_one() -> None:
    world = World()
    for index in range(4):
        world.place(f"low{index}", f"gpu-{index}", 20, priority=1)
    assert world.choose(whole_gpus(5), priority=1000) == ([], None)
    assert world.allocate_calls == 1  # one check with every candidate gone, nothing more


def test_a_lower_priority_gang_goes_whole() -> None:
    world = World()
    world.place("g-0", "gpu-0", 40, priority=10, gang="low")
    world.place("g-1", "gpu-1", 40, priority=10, gang="low")
    world.place("h2", "gpu-2", 40, priority=2000)
    world.place("h3", "gpu-3", 40, priority=2000)
    victims, choice = world.choose(whole_gpus(1), priority=1000)
    assert victims == ["g-0", "g-1"]  # one GPU wanted, but the gang is not split
    assert [u.key for u in choice.victims] == ["default/low"]


def test_a_gang_with_one_important_member_is_not_a_victim() -> None:
    world = World()
    world.place("g-0", "gpu-0", 40, priority=10, gang="mixed")
    world.place("g-1", "gpu-1", 40, priority=5000, gang="mixed")
    world.place("h2", "gpu-2", 40, priority=2000)
    world.place("h3", "gpu-3", 40, priority=2000)
    assert world.choose(whole_gpus(1), priority=1000) == ([], None)


def test_a_single_victim_is_preferred_over_a_gang_of_the_same_priority() -> None:
    world = World()
    world.place("g-0", "gpu-0", 40, priority=10, gang="low")
    world.place("g-1", "gpu-1", 40, priority=10, gang="low")
    world.place("solo", "gpu-2", 40, priority=10)
    world.place("h3", "gpu-3", 40, priority=2000)
    victims, _ = world.choose(whole_gpus(1), priority=1000)
    assert victims == ["solo"]


def budget(name: str, app: str, allowed: int) -> Budget:
    return parse_budget({
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": app}}},
        "status": {"disruptionsAllowed": allowed},
    })  # fmt: skip


def test_a_pod_disruption_budget_steers_the_choice() -> None:
    world = World()
    world.place("x", "gpu-0", 40, priority=10, labels={"app": "x"})
    world.place("y", "gpu-1", 40, priority=10, labels={"app": "y"})
    world.place("h2", "gpu-2", 40, priority=2000)
    world.place("h3", "gpu-3", 40, priority=2000)
    assert world.choose(whole_gpus(1), priority=1000)[0] == ["x"]  # the tie goes to the first name
    victims, choice = world.choose(whole_gpus(1), priority=1000, budgets=[budget("keep-x", "x", 0)])
    assert victims == ["y"]
    assert choice.cost.pdb_violations == 0 and choice.budgets_exceeded == ()


def test_a_budget_that_cannot_be_avoided_is_named() -> None:
    world = World()
    world.place("x", "gpu-0", 40, priority=10, labels={"app": "x"})
    for index in range(1, 4):
        world.place(f"h{index}", f"gpu-{index}", 40, priority=2000)
    victims, choice = world.choose(whole_gpus(1), priority=1000, budgets=[budget("keep-x", "x", 0)])
    assert victims == ["x"]
    assert choice.cost.pdb_violations == 1 and choice.budgets_exceeded == ("default/keep-x",)


def test_victims_across_nodes_for_a_gang_of_whole_nodes() -> None:
    world = World(nodes=("node1", "node2", "node3"))
    for index in range(4):
        world.place(f"n1-{index}", f"gpu-{index}", 20, priority=10, node="node1")
        world.place(f"n2-{index}", f"gpu-{index}", 20, priority=30, node="node2")
        world.place(f"n3-{index}", f"gpu-{index}", 20, priority=10, node="node3")
    gang = [share(f"want-{i}", 40) for i in range(8)]
    units = world.units(1000)
    by_key = {u.key: u for u in units}
    groups = [list(range(4)), list(range(4, 8))]  # two pods of four GPUs each

    def fits(removed: frozenset[str]) -> Placement | None:
        released = [c for k in removed for c in by_key[k].claims]
        for claim in released:
            world.state.remove_claim(claim["metadata"]["uid"])
        try:
            result = world.state.allocate(gang, policy="best-fit", pod_groups=groups)
        finally:
            for claim in released:
                world.state.upsert_claim(claim)
        return None if result is None else Placement(tuple(zip(gang, result, strict=True)), ())

    choice = choose_victims(units, fits=fits)
    assert choice is not None
    nodes = sorted({u.nodes[0] for u in choice.victims})
    assert nodes == ["node1", "node3"] and len(choice.victims) == 8


def test_count_violations_spends_each_budget_in_order() -> None:
    pods = [running_pod(f"p{i}", [], priority=1, labels={"app": "a"}) for i in range(3)]
    assert count_violations(pods, [budget("b", "a", 1)]) == (2, ("default/b",))
    assert count_violations(pods, [budget("b", "a", 3)]) == (0, ())
    empty = parse_budget({"metadata": {"name": "e", "namespace": "default"}, "spec": {}, "status": {}})
    assert count_violations(pods, [empty]) == (0, ())  # an empty selector matches nothing here


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"spec": {"priorityClassName": None}}, "has no PriorityClass"),
        ({"spec": {"preemptionPolicy": "Never"}}, "preemptionPolicy Never"),
        ({"metadata": {"labels": {"kueue.x-k8s.io/queue-name": "q"}}}, "managed by Kueue"),
        ({"spec": {"schedulingGates": [{"name": "kueue.x-k8s.io/admission"}]}}, "managed by Kueue"),
        ({}, None),
    ],
)
def test_who_may_preempt(change: dict[str, Any], reason: str | None) -> None:
    pod = running_pod("p", [], priority=1000)
    for part, values in change.items():
        for key, value in values.items():
            if value is None:
                pod[part].pop(key, None)
            else:
                pod[part][key] = value
    refusal = preemption_refusal([pod])
    assert (refusal is None) if reason is None else (refusal is not None and reason in refusal)
    assert pod_priority({"spec": {}}) == 0


def test_gangs_as_the_controller_identifies_them_go_whole() -> None:
    """A PodGroup's pods carry no label of ours: the controller's gang identity says they belong
    together (``gang_of``), and they are one victim."""
    world = World()
    world.place("pg-0", "gpu-0", 40, priority=10)
    world.place("pg-1", "gpu-1", 40, priority=10)
    world.place("h2", "gpu-2", 40, priority=2000)
    world.place("h3", "gpu-3", 40, priority=2000)

    def gang_of(pod: Any) -> str | None:
        return "default/podgroup:train" if pod["metadata"]["name"].startswith("pg-") else None

    units = build_victim_units(world.pods, world.claims, below_priority=1000, gang_of=gang_of)
    assert [(u.key, len(u.pods)) for u in units] == [("default/podgroup:train", 2)]
    choice = choose_victims(units, fits=world.fits_for(whole_gpus(1), units))
    assert choice is not None and [p["metadata"]["name"] for u in choice.victims for p in u.pods] == [
        "pg-0",
        "pg-1",
    ]
    alone = build_victim_units(world.pods, world.claims, below_priority=1000)
    assert sorted(u.key for u in alone) == ["default/pg-0", "default/pg-1"]  # without it: two pods
