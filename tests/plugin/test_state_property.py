"""Property: whatever the interleaving of prepares, unprepares, re-allocations, full disks (injected
at the file-write layer of the checkpoint and the CDI specs), agent restarts and retries, after every
step the checkpoint file, the CDI files, the sharing backends and the answers agree, no device is
held by a claim the kubelet has released, and no GPU is past its capacity. Once the disks have room,
retries converge. (test_state_disk_full.py does each write once on a real full tmpfs.)"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import driver.plugin.cdi as cdi_module
import driver.plugin.checkpoint as checkpoint_module
from driver.errors import ClaimError
from driver.inventory.model import NodeInventory
from driver.plugin import cdi
from driver.plugin.checkpoint import ClaimPhase, FileWriteError
from driver.plugin.claims import Claim, ClaimRef, ClaimUID, parse_claim
from driver.plugin.devices import DeviceKind, PreparedDevice, published_capacity
from driver.plugin.state import DeviceState
from tests.plugin.conftest import result
from tests.plugin.test_state import Env

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Two allocations per claim (the second: where the API re-allocates it under the same UID).
ALLOCATIONS: list[tuple[list[dict[str, Any]], list[dict[str, Any]]]] = [
    (
        [result("gpu-0", share_id="a0000000-0000-4000-8000-00000000000a", memory="8Gi", compute="40")],
        [result("gpu-1", share_id="a1111111-0000-4000-8000-00000000000a", memory="4Gi", compute="10")],
    ),
    (
        [result("gpu-0", share_id="b0000000-0000-4000-8000-00000000000b", memory="8Gi", compute="40")],
        [result("gpu-0", share_id="b0000000-0000-4000-8000-00000000000b", memory="12Gi", compute="40")],
    ),
    (
        [result("gpu-0", share_id="c0000000-0000-4000-8000-00000000000c", memory="8Gi", compute="40")],
        [result("gpu-1")],
    ),
    ([result("gpu-1")], [result("gpu-0")]),
    (
        [
            result("gpu-1", share_id="e0000000-0000-4000-8000-00000000000e", memory="4Gi"),
            result("nic-0", request="net"),
        ],
        [result("nic-0", request="net")],
    ),
]
UIDS = [ClaimUID(f"00000000-0000-4000-8000-0000000000{i:02d}") for i in range(len(ALLOCATIONS))]
TARGETS = {"checkpoint": (checkpoint_module,), "cdi": (cdi_module,), "both": (checkpoint_module, cdi_module)}

claim_sets = st.sets(st.integers(0, len(UIDS) - 1), min_size=1, max_size=3)
steps = st.one_of(
    st.tuples(st.just("prepare"), claim_sets),
    st.tuples(st.just("unprepare"), claim_sets),
    st.tuples(st.just("full"), st.sampled_from(sorted(TARGETS)), st.integers(0, 3)),
    st.tuples(st.just("free")),
    st.tuples(st.just("restart")),
    st.tuples(st.just("reallocate"), st.integers(0, len(UIDS) - 1)),
)


class Disks:
    """Fault injection around the real ``write_atomically`` of the checkpoint and CDI modules: a
    full disk fails every write with ENOSPC, optionally after ``countdown`` more writes succeed."""

    def __init__(self) -> None:
        self.full: set[str] = set()
        self.countdown: dict[str, int] = {}

    def fill(self, target: str, after_writes: int) -> None:
        for module in TARGETS[target]:
            self.countdown[module.__name__] = after_writes

    def free(self) -> None:
        self.full.clear()
        self.countdown.clear()

    @contextmanager
    def injected(self) -> Iterator[None]:
        with (
            mock.patch.object(checkpoint_module, "write_atomically", self._wrap(checkpoint_module)),
            mock.patch.object(cdi_module, "write_atomically", self._wrap(cdi_module)),
        ):
            yield

    def _wrap(self, module: Any) -> Callable[..., None]:
        real, name = module.write_atomically, module.__name__

        def write(path: Path, data: bytes, **options: Any) -> None:
            remaining = self.countdown.get(name)
            if remaining is not None:
                if remaining == 0:
                    del self.countdown[name]
                    self.full.add(name)
                else:
                    self.countdown[name] = remaining - 1
            if name in self.full:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            real(path, data, **options)

        return write


class Kubelet:
    """What the kubelet knows of each claim: released (unprepared, or never prepared), prepared
    (with the devices it was answered), or unknown (its last call failed, or the claim moved)."""

    def __init__(self) -> None:
        self.view: dict[str, str] = dict.fromkeys(UIDS, "released")
        self.answers: dict[str, tuple[PreparedDevice, ...]] = {}
        self.variant: dict[str, int] = dict.fromkeys(UIDS, 0)

    def claim(self, index: int) -> Claim:
        uid = UIDS[index]
        body = {
            "metadata": {"namespace": "ns", "name": f"c{index}", "uid": uid},
            "status": {"allocation": {"devices": {"results": ALLOCATIONS[index][self.variant[uid]]}}},
        }
        return parse_claim(body, ClaimRef(namespace="ns", name=f"c{index}", uid=uid))


class Node:
    def __init__(self, root: Path, inventory: NodeInventory) -> None:
        self.env = Env(root, inventory)
        self.kubelet = Kubelet()
        self.disks = Disks()
        self.state: DeviceState | None = None
        self.restart()

    def restart(self) -> None:
        self.env.new_process()
        state = self.env.state()
        try:
            state.restore()
        except FileWriteError:
            self.state = None  # crash-looping until the disk has room
            return
        self.state = state

    def up(self) -> DeviceState | None:
        if self.state is None:
            self.restart()
        return self.state

    def prepare(self, indexes: set[int]) -> None:
        state = self.up()
        if state is None:
            return
        claims = [self.kubelet.claim(index) for index in sorted(indexes)]
        try:
            outcomes = state.prepare_many(claims)
        except FileWriteError:
            self.kubelet.view.update(dict.fromkeys((c.uid for c in claims), "unknown"))
            return
        for claim in claims:
            outcome = outcomes[claim.uid]
            if isinstance(outcome, ClaimError):
                self.kubelet.view[claim.uid] = "unknown"
            else:
                self.kubelet.view[claim.uid] = "prepared"
                self.kubelet.answers[claim.uid] = outcome

    def unprepare(self, indexes: set[int]) -> None:
        state = self.up()
        if state is None:
            return
        refs = [self.kubelet.claim(index).ref for index in sorted(indexes)]
        try:
            outcomes = state.unprepare_many(refs)
        except FileWriteError:
            self.kubelet.view.update(dict.fromkeys((ref.uid for ref in refs), "unknown"))
            return
        for ref in refs:
            self.kubelet.view[ref.uid] = (
                "unknown" if isinstance(outcomes[ref.uid], ClaimError) else "released"
            )

    def reallocate(self, index: int) -> None:
        uid = UIDS[index]
        self.kubelet.variant[uid] = 1 - self.kubelet.variant[uid]
        if self.kubelet.view[uid] == "prepared":
            self.kubelet.view[uid] = "unknown"  # the Unprepare of the old allocation was missed

    def run(self, step: tuple[Any, ...]) -> None:
        match step:
            case ("prepare", indexes):
                self.prepare(indexes)
            case ("unprepare", indexes):
                self.unprepare(indexes)
            case ("full", target, after_writes):
                self.disks.fill(target, after_writes)
            case ("free",):
                self.disks.free()
            case ("restart",):
                self.restart()
            case ("reallocate", index):
                self.reallocate(index)

    # -- what must hold after every step ------------------------------------------------------

    def check(self) -> None:
        env, kubelet = self.env, self.kubelet
        on_disk = env.on_disk()
        if self.state is not None:
            assert self.state.prepared_claims() == on_disk, "memory and checkpoint file differ"
        held = env.held()
        shares = {
            (uid, d.device, d.share_id)
            for uid, entry in on_disk.items()
            for d in entry.devices
            if d.share is not None
        }
        assert held <= shares, f"shares held without a checkpoint entry: {held - shares}"
        for path in sorted(env.cdi_root.glob("*.json")):
            cdi_class, _, uid = (
                path.name.removeprefix("k8s.fractional.dev-").removesuffix(".json").partition("_")
            )
            entry = on_disk.get(uid)
            assert entry is not None and entry.phase is ClaimPhase.COMPLETED, (
                f"{path.name} without a completed entry"
            )
            assert json.loads(path.read_text()) == render(entry.devices, cdi_class)
        for uid, entry in on_disk.items():
            if entry.phase is ClaimPhase.COMPLETED and self.state is not None:
                missing = {(uid, d.device, d.share_id) for d in entry.devices if d.share is not None} - held
                assert not missing, f"completed claim {uid} without its shares {missing}"
        for uid, view in kubelet.view.items():
            if view == "released":
                assert uid not in on_disk, f"released claim {uid} still in the checkpoint"
                assert not any(uid == holder for holder, _, _ in held), f"released claim {uid} holds a share"
                assert cdi.claim_spec_path(env.cdi_root, "gpu", uid).exists() is False
                assert cdi.claim_spec_path(env.cdi_root, "nic", uid).exists() is False
            elif view == "prepared":
                entry = on_disk.get(uid)
                assert entry is not None and entry.phase is ClaimPhase.COMPLETED, f"prepared claim {uid} lost"
                assert entry.devices == kubelet.answers[uid]
                allocated = ALLOCATIONS[UIDS.index(ClaimUID(uid))][kubelet.variant[uid]]
                assert [(d.device, d.share_id) for d in entry.devices] == [
                    (r["device"], r.get("shareID")) for r in allocated
                ], f"claim {uid} answered with stale devices"
                for kind in {str(d.kind) for d in entry.devices}:
                    assert cdi.claim_spec_path(env.cdi_root, kind, uid).exists()
        self.check_capacity(on_disk)

    def check_capacity(self, on_disk: dict[str, Any]) -> None:
        for gpu in self.env.inventory.gpus:
            capacity = published_capacity(gpu)
            held = [d for entry in on_disk.values() for d in entry.devices if d.device == gpu.name]
            if any(d.share_id is None for d in held):
                assert len(held) == 1, f"{gpu.name} exclusive and shared at once"
            shares = [d.share for d in held if d.share is not None and d.share_id is not None]
            assert sum(s.memory_bytes for s in shares) <= capacity.memory_bytes
            assert sum(s.compute_percent for s in shares) <= capacity.compute_percent

    def converge(self) -> None:
        """The disks have room again: the kubelet retries what it does not know, then releases all."""
        self.disks.free()
        state = self.up()
        assert state is not None, "the agent does not start with room on the disks"
        unknown = {UIDS.index(ClaimUID(uid)) for uid, view in self.kubelet.view.items() if view == "unknown"}
        if unknown:
            self.prepare(unknown)
            self.check()
        self.unprepare(set(range(len(UIDS))))
        self.check()
        assert set(self.kubelet.view.values()) == {"released"}
        assert self.env.on_disk() == {} and self.env.spec_files() == [] and self.env.held() == set()


def render(devices: tuple[PreparedDevice, ...], cdi_class: str) -> dict[str, Any]:
    kind = DeviceKind(cdi_class)
    return cdi.render_claim_spec(cdi_class, [(d.cdi_name, d.edits) for d in devices if d.kind is kind])


@SETTINGS
@given(script=st.lists(steps, max_size=30))
def test_state_machine_survives_full_disks_restarts_and_reallocations(
    inventory: NodeInventory, script: list[tuple[Any, ...]]
) -> None:
    with tempfile.TemporaryDirectory(prefix="fd-prop-") as root:
        node = Node(Path(root), inventory)
        with node.disks.injected():
            node.check()
            for step in script:
                node.run(step)
                node.check()
            node.converge()


def test_the_injection_reaches_both_writes(tmp_path: Path, inventory: NodeInventory) -> None:
    """Guards the property test: a full disk injected here does fail the checkpoint and CDI writes."""
    node = Node(tmp_path, inventory)
    with node.disks.injected():
        for target, failing in (("checkpoint", "checkpoint.json"), ("cdi", "k8s.fractional.dev-gpu_")):
            node.disks.fill(target, 0)
            assert node.state is not None
            try:
                node.state.prepare(node.kubelet.claim(0))
            except FileWriteError as error:
                assert failing in str(error)
            else:
                raise AssertionError(f"no write failed with a full {target} disk")
            node.disks.free()
            node.check()
