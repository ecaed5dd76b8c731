"""``DeviceState``: recorded effects, idempotency, undo, exclusivity, reboots, concurrency."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from driver.errors import ClaimError
from driver.inventory.model import NodeInventory
from driver.plugin import cdi
from driver.plugin.checkpoint import ClaimPhase, read_checkpoint
from driver.plugin.claims import Claim, ClaimRef, ClaimUID, parse_claim
from driver.plugin.devices import PrepareSettings
from driver.plugin.sharing.base import ContainerEdits, ShareSpec
from driver.plugin.state import DeviceState
from tests.plugin.conftest import NODE, new_share_id, result


class RecordingBackend:
    """A sharing backend double that records acquire/release and can be told to fail."""

    def __init__(self, name: str = "none") -> None:
        self.name = name
        self.calls: list[tuple[str, str, str]] = []
        self.held: set[tuple[str, str, str | None]] = set()  # (claim UID, device, share id) acquired
        self.fail_acquire: str | None = None
        self._lock = threading.Lock()

    def container_edits(self, share: ShareSpec) -> ContainerEdits:
        return ContainerEdits(env=(f"BACKEND_{self.name.upper()}=1",))

    def acquire(self, share: ShareSpec) -> None:
        with self._lock:
            self.calls.append(("acquire", share.claim_uid, share.device))
        if self.fail_acquire:
            raise ClaimError(claim=share.claim, field="sharing", problem=self.fail_acquire)
        with self._lock:
            self.held.add((share.claim_uid, share.device, share.share_id))

    def release(self, share: ShareSpec) -> None:
        with self._lock:
            self.calls.append(("release", share.claim_uid, share.device))
            self.held.discard((share.claim_uid, share.device, share.share_id))

    def close(self) -> None:
        pass

    def describe(self) -> dict[str, str]:
        return {"name": self.name}

    def count(self, call: str, claim_uid: str | None = None) -> int:
        return sum(1 for c in self.calls if c[0] == call and (claim_uid is None or c[1] == claim_uid))


class Env:
    def __init__(self, tmp_path: Path, inventory: NodeInventory) -> None:
        self.cdi_root = tmp_path / "cdi"
        self.plugin_dir = tmp_path / "plugin"
        self.inventory = inventory
        self.backends = {"none": RecordingBackend("none"), "mps": RecordingBackend("mps")}
        self.effects: list[tuple[str, str]] = []

    def state(
        self, boot_id: str = "boot-1", *, on_effect: Callable[[str, str], None] | None = None, **kwargs: Any
    ) -> DeviceState:
        def hook(effect: str, uid: str) -> None:
            self.effects.append((effect, uid))
            if on_effect is not None:
                on_effect(effect, uid)

        return DeviceState(
            inventory=self.inventory,
            settings=PrepareSettings(default_backend="none", backends=self.backends),
            cdi_root=self.cdi_root,
            plugin_dir=self.plugin_dir,
            boot_id=boot_id,
            effect_hook=hook,
            **kwargs,
        )

    def new_process(self) -> None:
        """What an agent restart does to the sharing backends: their holds are gone."""
        self.backends = {name: RecordingBackend(name) for name in self.backends}

    def held(self) -> set[tuple[str, str, str | None]]:
        return set().union(*(backend.held for backend in self.backends.values()))

    def on_disk(self) -> dict[str, Any]:
        """The checkpoint file's claims (what a restarted agent reads)."""
        return dict(read_checkpoint(self.plugin_dir / "checkpoint.json").claims)

    def spec_files(self) -> list[str]:
        return sorted(p.name for p in self.cdi_root.glob("*.json")) if self.cdi_root.exists() else []


@pytest.fixture
def env(tmp_path: Path, inventory: NodeInventory) -> Env:
    return Env(tmp_path, inventory)


_counter = iter(range(10_000))


def claim(results: list[dict[str, Any]], *, config: list[Any] | None = None) -> Claim:
    uid = f"00000000-0000-4000-8000-{next(_counter):012d}"
    devices: dict[str, Any] = {"results": results}
    if config:
        devices["config"] = config
    body = {
        "metadata": {"namespace": "ns", "name": f"c{uid[-4:]}", "uid": uid},
        "status": {"allocation": {"devices": devices}},
    }
    return parse_claim(body, ClaimRef(namespace="ns", name=f"c{uid[-4:]}", uid=ClaimUID(uid)))


def mps_config() -> list[dict[str, Any]]:
    parameters = {"apiVersion": "fractional.dev/v1alpha1", "kind": "GpuConfig", "sharing": {"backend": "mps"}}
    return [{"source": "FromClaim", "opaque": {"driver": "fractional.dev", "parameters": parameters}}]


def test_prepare_records_effects_in_order_and_is_idempotent(
    env: Env, check_cdi: Callable[[Path], dict[str, Any]]
) -> None:
    state = env.state()
    c = claim([result("gpu-0", share_id=new_share_id(), memory="1Gi"), result("nic-0", request="net")])
    devices = state.prepare(c)
    assert [effect for effect, _ in env.effects] == [
        "checkpoint-started",
        "shares-acquired",
        "checkpoint-completed",
        "cdi-written",
    ]
    assert env.spec_files() == [
        f"k8s.fractional.dev-gpu_{c.uid}.json",
        f"k8s.fractional.dev-nic_{c.uid}.json",
    ]
    for path in env.cdi_root.glob("*.json"):
        spec = check_cdi(path)
        assert spec["cdiVersion"] == "0.5.0"  # device names start with the claim UID's digit
    assert state.prepared_claims()[c.uid].phase is ClaimPhase.COMPLETED
    assert state.prepare(c) == devices
    assert env.backends["none"].count("acquire") == 1  # the repeat found it completed
    assert len(env.effects) == 4


def test_failed_acquire_leaves_nothing_behind(env: Env) -> None:
    state = env.state()
    env.backends["none"].fail_acquire = "daemon did not start"
    c = claim([result("gpu-0", share_id=new_share_id(), memory="1Gi")])
    with pytest.raises(ClaimError, match="daemon did not start"):
        state.prepare(c)
    assert env.spec_files() == []
    assert state.prepared_claims() == {}
    assert env.backends["none"].count("release", c.uid) == 1  # undo is idempotent release


def test_exclusive_device_is_not_prepared_twice(env: Env) -> None:
    state = env.state()
    state.prepare(claim([result("gpu-0")]))
    other = claim([result("gpu-0", share_id=new_share_id(), memory="1Gi")])
    with pytest.raises(
        ClaimError, match=r"device node-a/gpu-0: already prepared for ResourceClaim .* exclusively"
    ):
        state.prepare(other)
    assert all(other.uid not in name for name in env.spec_files())
    # Shares with distinct IDs of one GPU coexist.
    state.prepare(claim([result("gpu-1", share_id=new_share_id(), memory="1Gi")]))
    state.prepare(claim([result("gpu-1", share_id=new_share_id(), memory="1Gi")]))


def test_mps_share_cannot_join_a_gpu_shared_without_mps(env: Env) -> None:
    state = env.state()
    state.prepare(claim([result("gpu-0", share_id=new_share_id(), memory="1Gi")]))
    with pytest.raises(ClaimError, match="EXCLUSIVE_PROCESS"):
        state.prepare(claim([result("gpu-0", share_id=new_share_id(), memory="1Gi")], config=mps_config()))


def test_missing_cdi_file_is_recreated_without_redoing_effects(env: Env) -> None:
    state = env.state()
    c = claim([result("gpu-0", share_id=new_share_id(), memory="1Gi")])
    devices = state.prepare(c)
    path = cdi.claim_spec_path(env.cdi_root, "gpu", c.uid)
    content = path.read_bytes()
    path.unlink()
    assert state.prepare(c) == devices
    assert path.read_bytes() == content
    assert env.backends["none"].count("acquire") == 1


def test_new_boot_redoes_effects_with_the_same_cdi_ids(env: Env) -> None:
    c = claim([result("gpu-0", share_id=new_share_id(), memory="1Gi")])
    devices = env.state("boot-1").prepare(c)
    for path in env.cdi_root.glob("*.json"):
        path.unlink()  # /var/run/cdi is tmpfs
    rebooted = env.state("boot-2")
    assert rebooted.restore() == 0  # entries of an earlier boot wait for the kubelet's Prepare
    assert rebooted.prepare(c) == devices
    assert env.backends["none"].count("acquire") == 2
    assert len(env.spec_files()) == 1
    assert rebooted.prepared_claims()[c.uid].boot_id == "boot-2"


def test_restart_in_the_same_boot_restores_shares_and_files(env: Env) -> None:
    c = claim([result("gpu-0", share_id=new_share_id(), memory="1Gi")])
    env.state().prepare(c)
    (spec,) = env.cdi_root.glob("*.json")
    spec.unlink()
    assert env.state().restore() == 1
    assert env.backends["none"].count("acquire") == 2 and spec.exists()


def test_unprepare_twice_and_unknown(env: Env) -> None:
    state = env.state()
    c = claim([result("gpu-0", share_id=new_share_id(), memory="1Gi")])
    state.prepare(c)
    state.unprepare(c.ref)
    state.unprepare(c.ref)
    state.unprepare(
        ClaimRef(namespace="ns", name="never", uid=ClaimUID("ffffffff-0000-4000-8000-000000000000"))
    )
    assert env.spec_files() == [] and state.prepared_claims() == {}
    assert env.backends["none"].count("release", c.uid) == 1
    assert [e for e, _ in env.effects][-5:] == ["cdi-removed", "shares-released", "checkpoint-removed"] + [
        "cdi-removed"
    ] * 2


def test_same_claim_concurrently_acquires_once(env: Env) -> None:
    state = env.state()
    c = claim([result("gpu-0", share_id=new_share_id(), memory="1Gi")])
    answers: list[Any] = []
    threads = [threading.Thread(target=lambda: answers.append(state.prepare(c))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(answers) == 8 and all(a == answers[0] for a in answers)
    assert env.backends["none"].count("acquire") == 1


def test_different_claims_concurrently(env: Env) -> None:
    state = env.state()
    many = [claim([result(f"gpu-{i % 2}", share_id=new_share_id(), memory="256Mi")]) for i in range(24)]
    threads = [threading.Thread(target=state.prepare, args=(c,)) for c in many]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(state.prepared_claims()) == sorted(c.uid for c in many)
    assert len(env.spec_files()) == 24


def test_rolling_update_instances_share_the_checkpoint(env: Env) -> None:
    old, new = env.state(rolling_update=True), env.state(rolling_update=True)
    c = claim([result("gpu-0", share_id=new_share_id(), memory="1Gi")])
    devices = old.prepare(c)
    assert new.prepare(c) == devices  # read from the shared file, not a cache
    new.unprepare(c.ref)
    assert old.prepared_claims() == {} and env.spec_files() == []
    assert (env.plugin_dir / "serialize.lock").exists()
    assert devices[0].pool == NODE


class SimulatedCrash(BaseException):
    """Raised by the effect hook: like a kill -9, nothing after the effect runs (no undo)."""


PREPARE_EFFECTS = ["checkpoint-started", "shares-acquired", "checkpoint-completed", "cdi-written"]
UNPREPARE_EFFECTS = ["checkpoint-unpreparing", "cdi-removed", "shares-released", "checkpoint-removed"]


def _crashing_state(env: Env, effect: str) -> DeviceState:
    def hook(name: str, uid: str) -> None:
        if name == effect:
            raise SimulatedCrash(effect)

    return DeviceState(
        inventory=env.inventory,
        settings=PrepareSettings(default_backend="none", backends=env.backends),
        cdi_root=env.cdi_root,
        plugin_dir=env.plugin_dir,
        boot_id="boot-1",
        effect_hook=hook,
    )


@pytest.mark.parametrize("effect", PREPARE_EFFECTS)
def test_crash_after_each_prepare_effect_then_restart(
    env: Env, effect: str, check_cdi: Callable[[Path], dict[str, Any]]
) -> None:
    c = claim([result("gpu-0", share_id=new_share_id(), memory="1Gi"), result("nic-0", request="net")])
    expected = env.state().prepare(c)  # what a clean run answers (same dirs: undo it first)
    env.state().unprepare(c.ref)
    with pytest.raises(SimulatedCrash):
        _crashing_state(env, effect).prepare(c)
    restarted = env.state()
    restarted.restore()
    assert restarted.prepare(c) == expected
    assert len(env.spec_files()) == 2
    for path in env.cdi_root.glob("*.json"):
        check_cdi(path)
    assert restarted.prepared_claims()[c.uid].phase is ClaimPhase.COMPLETED
    restarted.unprepare(c.ref)
    assert env.spec_files() == [] and restarted.prepared_claims() == {}


@pytest.mark.parametrize("effect", UNPREPARE_EFFECTS)
def test_crash_after_each_unprepare_effect_then_restart(env: Env, effect: str) -> None:
    c = claim([result("gpu-0", share_id=new_share_id(), memory="1Gi")])
    env.state().prepare(c)
    with pytest.raises(SimulatedCrash):
        _crashing_state(env, effect).unprepare(c.ref)
    restarted = env.state()
    restarted.restore()
    restarted.unprepare(c.ref)
    assert env.spec_files() == [] and restarted.prepared_claims() == {}
    assert env.backends["none"].count("release", c.uid) >= 1


# -- batches, a lost checkpoint, start-up hygiene ---------------------------------------------------


def test_prepare_many_isolates_each_claim(env: Env) -> None:
    state = env.state()
    first = claim([result("gpu-0")])
    conflicting = claim([result("gpu-0")])  # the same GPU exclusively, later in the same call
    unknown = claim([result("gpu-9")])
    shared = [claim([result("gpu-1", share_id=new_share_id(), memory="1Gi")]) for _ in range(3)]
    outcomes = state.prepare_many([first, conflicting, unknown, *shared, first])
    assert isinstance(outcomes[conflicting.uid], ClaimError)
    assert "already prepared for ResourceClaim" in str(outcomes[conflicting.uid])
    assert isinstance(outcomes[unknown.uid], ClaimError)
    assert all(not isinstance(outcomes[c.uid], ClaimError) for c in (first, *shared))
    assert sorted(state.prepared_claims()) == sorted(c.uid for c in (first, *shared))
    assert len(env.spec_files()) == 4
    # One write records every claim started, one every claim completed.
    assert [e for e, _ in env.effects].count("checkpoint-started") == 4


def test_prepare_many_undoes_only_the_claim_whose_acquire_failed(env: Env) -> None:
    state = env.state()
    good = claim([result("gpu-0", share_id=new_share_id(), memory="1Gi")])
    bad = claim([result("gpu-1", share_id=new_share_id(), memory="1Gi")], config=mps_config())
    env.backends["mps"].fail_acquire = "mps daemon did not start"
    outcomes = state.prepare_many([good, bad])
    assert "mps daemon did not start" in str(outcomes[bad.uid])
    assert not isinstance(outcomes[good.uid], ClaimError)
    assert sorted(state.prepared_claims()) == [good.uid]
    assert env.spec_files() == [f"k8s.fractional.dev-gpu_{good.uid}.json"]


CORRUPTIONS: dict[str, Callable[[bytes], bytes]] = {
    "truncated": lambda data: data[: len(data) // 2],
    "zeroed": lambda data: b"\0" * len(data),
    "garbage": lambda data: bytes(range(256)) * 4,
    "wrong checksum": lambda data: data.replace(b'"name":"c', b'"name":"x'),
    "unknown version": lambda data: data.replace(
        b"checkpoint.fractional.dev/v2", b"checkpoint.fractional.dev/v0"
    ),
    "empty": lambda data: b"",
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_corrupt_checkpoint_keeps_the_exclusivity_guard(env: Env, corruption: str) -> None:
    exclusive = claim([result("gpu-0")])
    share_id = new_share_id()
    shared = claim([result("gpu-1", share_id=share_id, memory="1Gi")], config=mps_config())
    env.state().prepare_many([exclusive, shared])
    path = env.plugin_dir / "checkpoint.json"
    path.write_bytes(CORRUPTIONS[corruption](path.read_bytes()))

    restarted = env.state()
    assert restarted.restore() == 2  # recovered from the CDI specs; the MPS share is held again
    recovered = restarted.prepared_claims()
    assert {uid: entry.phase for uid, entry in recovered.items()} == {
        exclusive.uid: ClaimPhase.RECOVERED,
        shared.uid: ClaimPhase.RECOVERED,
    }
    with pytest.raises(ClaimError, match=rf"already prepared for ResourceClaim with UID {exclusive.uid}"):
        restarted.prepare(claim([result("gpu-0", share_id=new_share_id(), memory="1Gi")]))
    with pytest.raises(ClaimError, match=rf"UID {shared.uid} .* with share {share_id[:8]}"):
        restarted.prepare(claim([result("gpu-1", share_id=share_id, memory="1Gi")], config=mps_config()))
    with pytest.raises(ClaimError, match="EXCLUSIVE_PROCESS"):  # the recovered backend is known
        restarted.prepare(claim([result("gpu-1", share_id=new_share_id(), memory="1Gi")]))
    # The kubelet's next Prepare of a recovered claim recomputes it, and Unprepare cleans it up.
    assert restarted.prepare(exclusive)[0].request_names == ("gpu",)
    assert restarted.prepared_claims()[exclusive.uid].phase is ClaimPhase.COMPLETED
    # Acquired by the first agent, by the restore (under the share-id prefix; backends outlive
    # agents in this test), and by the re-prepare, which lets the restore's hold go.
    restarted.prepare(shared)
    assert env.backends["mps"].count("acquire", shared.uid) == 3
    assert env.backends["mps"].count("release", shared.uid) == 1
    restarted.unprepare(shared.ref)
    restarted.unprepare(exclusive.ref)
    assert env.spec_files() == [] and restarted.prepared_claims() == {}
    assert env.backends["mps"].count("release", shared.uid) == 2


def test_cdi_specs_without_a_checkpoint_are_adopted(env: Env) -> None:
    exclusive = claim([result("gpu-0")])
    env.state().prepare(exclusive)
    (env.plugin_dir / "checkpoint.json").unlink()
    restarted = env.state()
    restarted.restore()
    assert restarted.prepared_claims()[exclusive.uid].phase is ClaimPhase.RECOVERED
    with pytest.raises(ClaimError, match="already prepared"):
        restarted.prepare(claim([result("gpu-0")]))


def test_unreadable_cdi_spec_is_skipped(env: Env) -> None:
    env.cdi_root.mkdir(parents=True)
    uid = "00000000-0000-4000-8000-999999999999"
    (env.cdi_root / f"k8s.fractional.dev-gpu_{uid}.json").write_text("{not json")
    (env.cdi_root / "k8s.fractional.dev-gpu_x.json").write_text('{"devices": [{"name": "x-gpu-7"}]}')
    state = env.state()
    state.restore()
    assert state.prepared_claims() == {}


def test_leftover_temp_files_are_removed_at_start(env: Env) -> None:
    state = env.state()
    state.prepare(claim([result("gpu-0")]))
    leftovers = [
        env.plugin_dir / ".checkpoint.json.abc123.tmp",
        env.cdi_root / ".k8s.fractional.dev-gpu_00000000-0000-4000-8000-000000000001.json.x1y2.tmp",
    ]
    kept = [env.plugin_dir / "notes.tmp", env.cdi_root / ".other-vendor.json.1.tmp"]
    for path in leftovers + kept:
        path.write_text("partial")
    env.state().restore()
    assert [path.exists() for path in leftovers] == [False, False]
    assert all(path.exists() for path in kept)


def test_cdi_root_is_created_0755_whatever_the_umask(tmp_path: Path, inventory: NodeInventory) -> None:
    env = Env(tmp_path, inventory)
    env.cdi_root = tmp_path / "run" / "cdi"
    previous = os.umask(0)
    try:
        env.state()
    finally:
        os.umask(previous)
    assert oct(env.cdi_root.stat().st_mode & 0o777) == "0o755"
    assert oct(env.cdi_root.parent.stat().st_mode & 0o777) == "0o755"


def test_backend_errors_name_the_claim(env: Env) -> None:
    state = env.state()
    env.backends["none"].fail_acquire = "no room"
    c = claim([result("gpu-0", share_id=new_share_id(), memory="1Gi")])
    with pytest.raises(ClaimError, match=rf"ResourceClaim ns/{c.ref.name} \({c.uid}\): sharing: no room"):
        state.prepare(c)


def test_unprepare_many_undoes_every_claim(env: Env) -> None:
    state = env.state()
    many = [claim([result(f"gpu-{i % 2}", share_id=new_share_id(), memory="256Mi")]) for i in range(20)]
    state.prepare_many(many)
    unknown = ClaimRef(namespace="ns", name="x", uid=ClaimUID("ffffffff-0000-4000-8000-000000000001"))
    outcomes = state.unprepare_many([c.ref for c in many] + [unknown])
    assert outcomes == {**{c.uid: True for c in many}, unknown.uid: False}
    assert state.prepared_claims() == {} and env.spec_files() == []
    assert env.backends["none"].count("release") == 20
    assert [e for e, _ in env.effects].count("checkpoint-removed") == 20


def test_checkpoint_moved_away_during_a_rolling_update_keeps_the_guard(env: Env) -> None:
    """An older agent that cannot read this checkpoint version sets the file aside; the newer one,
    which re-reads the file on every call, rebuilds the guard from the CDI specs."""
    new = env.state(rolling_update=True)
    exclusive = claim([result("gpu-0")])
    new.prepare(exclusive)
    path = env.plugin_dir / "checkpoint.json"
    path.rename(path.with_name("checkpoint.json.corrupt-1"))  # what the older agent does
    with pytest.raises(ClaimError, match=rf"already prepared for ResourceClaim with UID {exclusive.uid}"):
        new.prepare(claim([result("gpu-0")]))
    assert path.exists()


# -- entries planted where the state machine keeps its files -----------------------------------------


def test_a_spec_replaced_by_a_symlink_is_written_again_on_the_next_prepare(env: Env, tmp_path: Path) -> None:
    """While the agent runs: the kubelet's retry of a prepared claim finds a link where our spec
    was, replaces the link with our spec and leaves the link's target alone."""
    state = env.state()
    c = claim([result("gpu-0", share_id=new_share_id(), memory="1Gi")])
    state.prepare(c)
    (ours,) = env.cdi_root.glob("*.json")
    content = ours.read_bytes()
    foreign = tmp_path / "foreign.json"
    foreign.write_text('{"devices": []}\n')
    ours.unlink()
    ours.symlink_to(foreign)
    state.prepare(c)
    assert not ours.is_symlink() and ours.read_bytes() == content
    assert foreign.read_text() == '{"devices": []}\n'


@pytest.mark.timeout(30)
def test_a_fifo_as_the_checkpoint_is_set_aside_not_waited_on(env: Env) -> None:
    env.plugin_dir.mkdir(parents=True)
    os.mkfifo(env.plugin_dir / "checkpoint.json")  # reading it would block until a writer came
    state = env.state()
    c = claim([result("gpu-0", share_id=new_share_id(), memory="1Gi")])
    state.prepare(c)
    assert c.uid in env.on_disk()
    assert (env.plugin_dir / "checkpoint.json").is_file()


def test_a_symlinked_serialize_lock_creates_nothing_outside_the_plugin_dir(env: Env, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere" / "made-by-the-agent"
    outside.parent.mkdir()
    env.plugin_dir.mkdir(parents=True)
    (env.plugin_dir / "serialize.lock").symlink_to(outside)
    state = env.state(rolling_update=True)
    state.prepare(claim([result("gpu-0", share_id=new_share_id(), memory="1Gi")]))
    assert not os.path.lexists(outside)
    assert not (env.plugin_dir / "serialize.lock").is_symlink()
