"""Priority preemption for the pods we place: who may preempt, who may be preempted, and the
cheapest set of victims that lets a whole gang fit. Pure: dicts in, values out; the fit check is
passed in (the controller asks the allocator with the victims' claims taken out of the state).

Rules (kube-scheduler's, ``pkg/scheduler/framework/preemption/preemption.go`` and
``plugins/defaultpreemption``, widened to gangs and shared GPUs):

- A preemptor needs a PriorityClass (``spec.priorityClassName``, resolved by the server into
  ``spec.priority``), no ``preemptionPolicy: Never``, and no Kueue queue (Kueue preempts its own).
- Victims are running pods of strictly lower priority holding allocated claims. Pods that share a
  claim, and the pods of one ``fractional.dev/gang``, are one victim unit: evicted whole or not at
  all; a unit's priority is that of its most important pod.
- Cost, compared in this order: PodDisruptionBudget violations (counted as kube-scheduler's
  ``filterPodsWithPDBViolation`` does), then the victims' priorities from the highest down (one
  victim at priority 50 costs more than three at 10; fewer victims at equal priorities cost less),
  then devices disturbed, then shares of other pods left on the disturbed devices (a release that
  leaves a device wholly free undoes fragmentation).

Search: the units are grouped into steps (all units on one device; all units on one node), steps
sorted by cost; the shortest prefix whose removal lets the gang fit is found by doubling and
bisection, then victims the placement does not touch are handed back and the rest reprieved one
by one, most important first, as kube-scheduler's ``selectVictimsOnNode`` does. The cheaper of
the two orderings wins. Before any of that, the gang must fit with every candidate removed, or no
one is preempted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from driver.controller.model.objects import (
    GANG_LABEL,
    allocation_node,
    is_deleting,
    is_gated,
    is_terminated,
    object_key,
    pod_claim_refs,
)

__all__ = [
    "KUEUE_GATES",
    "KUEUE_QUEUE_LABEL",
    "Budget",
    "Choice",
    "Cost",
    "DeviceKey",
    "FitCheck",
    "Placement",
    "VictimUnit",
    "build_victim_units",
    "choose_victims",
    "count_violations",
    "device_holders",
    "label_gang",
    "parse_budget",
    "pod_priority",
    "preemption_refusal",
]

KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_GATES = frozenset({"kueue.x-k8s.io/admission", "kueue.x-k8s.io/topology", "kueue.x-k8s.io/elastic-job"})
MAX_FIT_CHECKS = 48  # allocator calls per ordering; each one is a whole gang allocation

DeviceKey = tuple[str, str, str]  # (driver, pool, device)


def pod_priority(pod: Mapping[str, Any]) -> int:
    """``spec.priority``; a pod without one has priority 0 (upstream ``corev1helpers.PodPriority``)."""
    value = (pod.get("spec") or {}).get("priority")
    return int(value) if isinstance(value, int) else 0


def preemption_refusal(pods: Sequence[Mapping[str, Any]]) -> str | None:
    """Why these gated pods may not preempt anyone, or None when they may."""
    for pod in pods:
        spec = pod.get("spec") or {}
        name = (pod.get("metadata") or {}).get("name")
        labels = (pod.get("metadata") or {}).get("labels") or {}
        if not spec.get("priorityClassName"):
            return f"pod {name} has no PriorityClass"
        if spec.get("preemptionPolicy") == "Never":
            return f"pod {name} has preemptionPolicy Never"
        if labels.get(KUEUE_QUEUE_LABEL) or any(
            g.get("name") in KUEUE_GATES for g in spec.get("schedulingGates") or ()
        ):
            return f"pod {name} is managed by Kueue, which preempts for it"
    return None


@dataclass(frozen=True, slots=True)
class VictimUnit:
    """Pods that go together: one pod, a gang, or pods sharing a claim."""

    key: str
    pods: tuple[dict[str, Any], ...]
    claims: tuple[dict[str, Any], ...]  # allocated claims released once the pods are gone
    priority: int  # the highest of its pods
    devices: frozenset[DeviceKey]
    nodes: tuple[str, ...]
    holdings: tuple[tuple[DeviceKey, int], ...] = ()  # device -> claims of this unit on it


def _claim_devices(claim: Mapping[str, Any]) -> list[DeviceKey]:
    allocation = (claim.get("status") or {}).get("allocation") or {}
    return [
        (str(r.get("driver", "")), str(r.get("pool", "")), str(r.get("device", "")))
        for r in (allocation.get("devices") or {}).get("results") or ()
        if not r.get("adminAccess")
    ]


def device_holders(claims: Iterable[Mapping[str, Any]]) -> dict[DeviceKey, int]:
    """How many allocated claims hold each device."""
    holders: dict[DeviceKey, int] = {}
    for claim in claims:
        for device in set(_claim_devices(claim)):
            holders[device] = holders.get(device, 0) + 1
    return holders


def label_gang(pod: Mapping[str, Any]) -> str | None:
    """The pod's ``fractional.dev/gang`` as "namespace/name", or None."""
    meta = pod.get("metadata") or {}
    gang = (meta.get("labels") or {}).get(GANG_LABEL)
    return f"{meta.get('namespace')}/{gang}" if gang else None


def build_victim_units(
    pods: Iterable[dict[str, Any]],
    claims: Mapping[str, dict[str, Any]],
    *,
    below_priority: int,
    gang_of: Callable[[Mapping[str, Any]], str | None] = label_gang,
) -> list[VictimUnit]:
    """Units of running pods with allocated claims, all of priority below ``below_priority``.

    ``claims``: "namespace/name" -> claim. ``gang_of``: the pod's gang, or None for a pod on its
    own (the controller passes its gang identity: PodGroup, Workload, the markers). Units holding a
    gated or terminating pod are left out: the first has not started, the second is going already
    and cannot be evicted again.
    """
    live = [p for p in pods if not is_terminated(p)]
    keys = [str(object_key(p)) for p in live]
    parent = list(range(len(live)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first_of: dict[str, int] = {}
    for index, pod in enumerate(live):
        meta = pod.get("metadata") or {}
        links = [f"claim:{meta.get('namespace')}/{r.claim_name}" for r in pod_claim_refs(pod) if r.claim_name]
        gang = gang_of(pod)
        if gang:
            links.append(f"gang:{gang}")
        for link in links:
            if link in first_of:
                parent[find(index)] = find(first_of[link])
            else:
                first_of[link] = index
    members: dict[int, list[int]] = {}
    for index in range(len(live)):
        members.setdefault(find(index), []).append(index)

    units: list[VictimUnit] = []
    for indexes in members.values():
        unit_pods = [live[i] for i in sorted(indexes, key=lambda i: keys[i])]
        if any(is_gated(p) or is_deleting(p) for p in unit_pods):
            continue
        priority = max(pod_priority(p) for p in unit_pods)
        if priority >= below_priority:
            continue
        held: dict[str, dict[str, Any]] = {}
        for pod in unit_pods:
            namespace = pod["metadata"].get("namespace")
            for ref in pod_claim_refs(pod):
                claim = claims.get(f"{namespace}/{ref.claim_name}") if ref.claim_name else None
                if claim is not None and (claim.get("status") or {}).get("allocation"):
                    held[str(object_key(claim))] = claim
        if not held:
            continue
        counts: dict[DeviceKey, int] = {}
        nodes: set[str] = set()
        for claim in held.values():
            for device in set(_claim_devices(claim)):
                counts[device] = counts.get(device, 0) + 1
            node = allocation_node((claim.get("status") or {}).get("allocation"))
            if node:
                nodes.add(node)
        key = gang_of(unit_pods[0]) or str(object_key(unit_pods[0]))
        units.append(
            VictimUnit(
                key=key,
                pods=tuple(unit_pods),
                claims=tuple(held[k] for k in sorted(held)),
                priority=priority,
                devices=frozenset(counts),
                nodes=tuple(sorted(nodes)),
                holdings=tuple(sorted(counts.items())),
            )
        )
    return sorted(units, key=lambda u: u.key)


# -- PodDisruptionBudgets -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Budget:
    name: str
    namespace: str
    match_labels: tuple[tuple[str, str], ...]
    match_expressions: tuple[tuple[str, str, tuple[str, ...]], ...]
    disruptions_allowed: int
    disrupted_pods: frozenset[str] = frozenset()

    def matches(self, pod: Mapping[str, Any]) -> bool:
        """kube-scheduler skips a budget with an empty selector (it matches nothing there)."""
        meta = pod.get("metadata") or {}
        if meta.get("namespace") != self.namespace or not (self.match_labels or self.match_expressions):
            return False
        labels = meta.get("labels") or {}
        if any(labels.get(k) != v for k, v in self.match_labels):
            return False
        for key, operator, values in self.match_expressions:
            present = key in labels
            if operator == "In" and not (present and labels[key] in values):
                return False
            if operator == "NotIn" and present and labels[key] in values:
                return False
            if operator == "Exists" and not present:
                return False
            if operator == "DoesNotExist" and present:
                return False
        return True


def parse_budget(pdb: Mapping[str, Any]) -> Budget:
    """A policy/v1 PodDisruptionBudget as read; ``status.disruptionsAllowed`` as the disruption
    controller last wrote it (0 before it did, as the scheduler reads the zero value)."""
    meta = pdb.get("metadata") or {}
    selector = (pdb.get("spec") or {}).get("selector") or {}
    status = pdb.get("status") or {}
    return Budget(
        name=str(meta.get("name")),
        namespace=str(meta.get("namespace")),
        match_labels=tuple(sorted((str(k), str(v)) for k, v in (selector.get("matchLabels") or {}).items())),
        match_expressions=tuple(
            (str(e.get("key")), str(e.get("operator")), tuple(str(v) for v in e.get("values") or ()))
            for e in selector.get("matchExpressions") or ()
        ),
        disruptions_allowed=int(status.get("disruptionsAllowed") or 0),
        disrupted_pods=frozenset((status.get("disruptedPods") or {}).keys()),
    )


def count_violations(
    pods: Iterable[Mapping[str, Any]], budgets: Sequence[Budget]
) -> tuple[int, tuple[str, ...]]:
    """Pods whose eviction would exceed a budget, in order, each budget's allowance spent as it
    goes (kube-scheduler ``filterPodsWithPDBViolation``); and the budgets that would be exceeded."""
    allowed = [b.disruptions_allowed for b in budgets]
    count = 0
    exceeded: set[str] = set()
    for pod in pods:
        name = (pod.get("metadata") or {}).get("name")
        violates = False
        for index, budget in enumerate(budgets):
            if not budget.matches(pod) or name in budget.disrupted_pods:
                continue
            allowed[index] -= 1
            if allowed[index] < 0:
                violates = True
                exceeded.add(f"{budget.namespace}/{budget.name}")
        count += violates
    return count, tuple(sorted(exceeded))


# -- the search ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Placement:
    """Where the gang goes once the victims are gone (the nomination)."""

    allocations: tuple[tuple[dict[str, Any], dict[str, Any]], ...]  # (claim, status.allocation)
    pod_nodes: tuple[tuple[str, str | None], ...]  # (pod "namespace/name", node)

    def devices(self) -> frozenset[DeviceKey]:
        return frozenset(d for claim, allocation in self.allocations for d in _claim_devices(
            {"status": {"allocation": allocation}}))  # fmt: skip


FitCheck = Callable[[frozenset[str]], Placement | None]
"""``fits(removed unit keys)``: the gang's placement with those units' claims released, or None."""


@dataclass(frozen=True, slots=True, order=True)
class Cost:
    pdb_violations: int
    priorities: tuple[int, ...]  # the victims' priorities, highest first
    devices_disturbed: int
    shares_left_beside: int


@dataclass(frozen=True, slots=True)
class Choice:
    victims: tuple[VictimUnit, ...]
    placement: Placement
    cost: Cost
    budgets_exceeded: tuple[str, ...] = ()
    fit_checks: int = 0


def _cost(
    units: Iterable[VictimUnit], budgets: Sequence[Budget], holders: Mapping[DeviceKey, int]
) -> tuple[Cost, tuple[str, ...]]:
    ordered = sorted(units, key=lambda u: (u.priority, u.key))
    violations, exceeded = count_violations([p for u in ordered for p in u.pods], budgets)
    released: dict[DeviceKey, int] = {}
    for unit in ordered:
        for device, count in unit.holdings:
            released[device] = released.get(device, 0) + count
    left = sum(max(0, holders.get(d, n) - n) for d, n in released.items())
    cost = Cost(
        pdb_violations=violations,
        priorities=tuple(sorted((u.priority for u in ordered), reverse=True)),
        devices_disturbed=len(released),
        shares_left_beside=left,
    )
    return cost, exceeded


@dataclass
class _Search:
    units: dict[str, VictimUnit]
    fits: FitCheck
    budgets: Sequence[Budget]
    holders: Mapping[DeviceKey, int]
    checks: int = 0
    memo: dict[frozenset[str], Placement | None] = field(default_factory=dict)

    def fit(self, removed: frozenset[str]) -> Placement | None:
        if removed not in self.memo:
            self.checks += 1
            self.memo[removed] = self.fits(removed)
        return self.memo[removed]

    def shortest_prefix(self, steps: list[frozenset[str]]) -> tuple[frozenset[str], Placement] | None:
        prefixes: list[frozenset[str]] = []
        removed: frozenset[str] = frozenset()
        for step in steps:
            removed = removed | step
            prefixes.append(removed)
        low, high = 0, 1  # prefixes[low - 1] does not fit (none when low == 0)
        while True:
            index = min(high, len(prefixes)) - 1
            if index < 0:
                return None
            if self.fit(prefixes[index]) is not None:
                high = index
                break
            if index == len(prefixes) - 1:
                return None
            low, high = index + 1, high * 2
        while low < high:  # the first fitting prefix lies in [low, high]
            middle = (low + high) // 2
            if self.fit(prefixes[middle]) is not None:
                high = middle
            else:
                low = middle + 1
        placement = self.fit(prefixes[high])
        assert placement is not None
        return prefixes[high], placement

    def hand_back_untouched(
        self, removed: frozenset[str], placement: Placement
    ) -> tuple[frozenset[str], Placement]:
        used = placement.devices()
        kept = frozenset(k for k in removed if self.units[k].devices & used)
        if kept != removed:
            fitting = self.fit(kept)
            if fitting is not None:
                return kept, fitting
        return removed, placement

    def reprieve(
        self, removed: frozenset[str], placement: Placement, limit: int
    ) -> tuple[frozenset[str], Placement]:
        removed, placement = self.hand_back_untouched(removed, placement)
        violating = {
            u.key for u in (self.units[k] for k in removed) if count_violations(u.pods, self.budgets)[0]
        }
        order = sorted(
            removed,
            key=lambda k: (k not in violating, -self.units[k].priority, -len(self.units[k].devices), k),
        )
        for key in order:
            if key not in removed:
                continue
            if self.checks >= limit:
                break
            candidate = removed - {key}
            fitting = self.fit(candidate)
            if fitting is not None:
                removed, placement = self.hand_back_untouched(candidate, fitting)
        return removed, placement

    def step_key(self, step: frozenset[str]) -> tuple[Cost, tuple[str, ...]]:
        cost, _ = _cost((self.units[k] for k in step), self.budgets, self.holders)
        return cost, tuple(sorted(step))


def _steps(units: Sequence[VictimUnit], search: _Search, by_node: bool) -> list[frozenset[str]]:
    groups: dict[Any, set[str]] = {}
    for unit in units:
        for place in unit.nodes if by_node else unit.devices:
            groups.setdefault(place, set()).add(unit.key)
    distinct = {frozenset(g) for g in groups.values()}
    return sorted(distinct, key=search.step_key)


def choose_victims(
    units: Sequence[VictimUnit],
    *,
    fits: FitCheck,
    budgets: Sequence[Budget] = (),
    holders: Mapping[DeviceKey, int] | None = None,
    max_fit_checks: int = MAX_FIT_CHECKS,
) -> Choice | None:
    """The cheapest victims found (module docstring), or None when the gang would not fit even
    with every candidate gone, or fits with no one gone (then there is nothing to preempt)."""
    held = holders if holders is not None else device_holders(c for u in units for c in u.claims)
    search = _Search(units={u.key: u for u in units}, fits=fits, budgets=budgets, holders=held)
    everyone = frozenset(search.units)
    if not everyone or search.fit(everyone) is None:
        return None
    best: Choice | None = None
    for by_node in (False, True):
        start = search.checks
        found = search.shortest_prefix(_steps(units, search, by_node))
        if found is None:
            continue
        removed, placement = search.reprieve(*found, limit=start + max_fit_checks)
        victims = tuple(sorted((search.units[k] for k in removed), key=lambda u: (u.priority, u.key)))
        cost, exceeded = _cost(victims, budgets, held)
        if best is None or (cost, [u.key for u in victims]) < (best.cost, [u.key for u in best.victims]):
            best = Choice(victims=victims, placement=placement, cost=cost, budgets_exceeded=exceeded)
    if best is None or not best.victims:
        return None
    return Choice(
        victims=best.victims, placement=best.placement, cost=best.cost,
        budgets_exceeded=best.budgets_exceeded, fit_checks=search.checks,
    )  # fmt: skip
