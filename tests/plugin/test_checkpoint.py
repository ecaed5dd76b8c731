"""The checkpoint: round trip, checksum, boot id, corrupt files set aside."""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from driver.errors import ConfigError
from driver.plugin.checkpoint import (
    API_VERSION,
    Checkpoint,
    CheckpointCorruptError,
    CheckpointStore,
    ClaimPhase,
    PreparedClaim,
    parse_checkpoint,
    read_boot_id,
    read_checkpoint,
    render_checkpoint,
)
from driver.plugin.checkpoint import _checksum as checksum_of
from driver.plugin.devices import DeviceKind, PreparedDevice
from driver.plugin.sharing.base import ContainerEdits, ShareSpec

UID = "1d2c3b4a-0000-4000-8000-00000000000a"


def prepared(phase: ClaimPhase = ClaimPhase.COMPLETED, boot_id: str = "boot-1") -> PreparedClaim:
    share = ShareSpec(
        claim_uid=UID,
        device="gpu-0",
        gpu_uuid="GPU-1",
        ordinal=0,
        share_id="abcd",
        memory_bytes=1 << 30,
        compute_percent=10,
        whole_gpu=False,
        backend_options=(("a", "b"),),
    )
    device = PreparedDevice(
        kind=DeviceKind.GPU,
        request_names=("gpu",),
        pool="node-a",
        device="gpu-0",
        share_id="abcd",
        cdi_name=f"{UID}-gpu-0-abcd",
        cdi_device_ids=(f"k8s.fractional.dev/gpu={UID}-gpu-0-abcd",),
        edits=ContainerEdits(env=("A=1",)),
        share=share,
        backend="none",
    )
    return PreparedClaim(uid=UID, namespace="ns", name="c", phase=phase, boot_id=boot_id, devices=(device,))


def corrupt_count() -> float:
    return REGISTRY.get_sample_value("fractional_plugin_checkpoint_corrupt_total") or 0.0


def test_round_trip(tmp_path: Path) -> None:
    checkpoint = Checkpoint().with_claim(prepared())
    data = render_checkpoint(checkpoint, "boot-1")
    parsed = parse_checkpoint(data, tmp_path / "checkpoint.json")
    assert parsed.claims == checkpoint.claims and parsed.boot_id == "boot-1"
    body = json.loads(data)
    assert body["apiVersion"] == "checkpoint.fractional.dev/v2" and body["checksum"].startswith("sha256:")
    assert parsed.without(UID).claims == {}


def test_missing_file_reads_empty(tmp_path: Path) -> None:
    assert read_checkpoint(tmp_path / "nope.json").claims == {}


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda text: text[: len(text) // 2], "not JSON"),
        (lambda text: text.replace('"name":"c"', '"name":"d"'), "checksum"),
        (
            lambda text: text.replace("checkpoint.fractional.dev/v2", "checkpoint.fractional.dev/v9"),
            "apiVersion",
        ),
        (lambda text: "[]", "not a JSON object"),
    ],
)
def test_corruption_is_detected(tmp_path: Path, mutate, match: str) -> None:
    text = render_checkpoint(Checkpoint().with_claim(prepared()), "boot-1").decode()
    with pytest.raises(CheckpointCorruptError, match=match):
        parse_checkpoint(mutate(text).encode(), tmp_path / "checkpoint.json")


def test_store_sets_a_corrupt_file_aside(tmp_path: Path) -> None:
    (tmp_path / "checkpoint.json").write_text('{"apiVersion": "checkpoint.fractional.dev/v1", "kind": ')
    before = corrupt_count()
    store = CheckpointStore(tmp_path, boot_id="boot-1")
    assert store.load().claims == {}
    assert corrupt_count() == before + 1
    (aside,) = tmp_path.glob("checkpoint.json.corrupt-*")
    assert aside.read_text().startswith('{"apiVersion"')
    store.update(lambda checkpoint: checkpoint.with_claim(prepared()))
    assert CheckpointStore(tmp_path, boot_id="boot-1", cache=False).load().claims[UID] == prepared()
    assert oct((tmp_path / "checkpoint.json").stat().st_mode & 0o777) == "0o600"


def test_phase_and_boot_id() -> None:
    assert prepared().is_current("boot-1")
    assert not prepared().is_current("boot-2")
    assert not prepared(ClaimPhase.STARTED).is_current("boot-1")


def test_read_boot_id(tmp_path: Path) -> None:
    (tmp_path / "boot_id").write_text("1234-abcd\n")
    assert read_boot_id(tmp_path / "boot_id") == "1234-abcd"
    assert read_boot_id(tmp_path / "missing") == ""
    assert read_boot_id()  # the real kernel file


def test_concurrent_transactions_all_reach_the_file(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, boot_id="boot-1")
    uids = [f"{i:08d}-0000-4000-8000-000000000000" for i in range(40)]

    def add(uid: str) -> None:
        with store.transaction() as tx:
            tx.commit(tx.checkpoint.with_claim(replace(prepared(), uid=uid)))

    threads = [threading.Thread(target=add, args=(uid,)) for uid in uids]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    on_disk = read_checkpoint(tmp_path / "checkpoint.json")
    assert sorted(on_disk.claims) == uids
    with store.transaction() as tx:  # a read-only transaction writes nothing
        assert len(tx.checkpoint.claims) == 40
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.json"]


def _as_v1(checkpoint: Checkpoint, boot_id: str) -> bytes:
    """A checkpoint as agents before v2 wrote it (same layout, apiVersion v1, no share.claimKey)."""
    body = json.loads(render_checkpoint(checkpoint, boot_id))
    del body["checksum"]
    body["apiVersion"] = "checkpoint.fractional.dev/v1"
    for claim in body["preparedClaims"].values():
        for device in claim["devices"]:
            (device.get("share") or {}).pop("claimKey", None)
    body["checksum"] = checksum_of(body)
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def test_v1_checkpoint_is_migrated(tmp_path: Path) -> None:
    (tmp_path / "checkpoint.json").write_bytes(_as_v1(Checkpoint().with_claim(prepared()), "boot-1"))
    before = corrupt_count()
    store = CheckpointStore(tmp_path, boot_id="boot-1")
    assert store.load().claims == {UID: prepared()}  # read, not set aside
    assert corrupt_count() == before and not list(tmp_path.glob("checkpoint.json.corrupt-*"))
    store.update(lambda checkpoint: checkpoint)
    assert json.loads((tmp_path / "checkpoint.json").read_bytes())["apiVersion"] == API_VERSION


def test_v1_cannot_hold_a_v2_phase(tmp_path: Path) -> None:
    data = _as_v1(Checkpoint().with_claim(prepared(ClaimPhase.RECOVERED)), "boot-1")
    with pytest.raises(CheckpointCorruptError, match="RecoveredFromCDI"):
        parse_checkpoint(data, tmp_path / "checkpoint.json")


def test_checkpoint_path_that_is_a_directory_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "checkpoint.json").mkdir()
    with pytest.raises(ConfigError, match=r"checkpoint.json is a directory"):
        CheckpointStore(tmp_path, boot_id="boot-1").load()
    assert (tmp_path / "checkpoint.json").is_dir()  # an operator's mistake is not moved away


def test_corrupt_file_is_replaced_by_what_recover_rebuilds(tmp_path: Path) -> None:
    (tmp_path / "checkpoint.json").write_bytes(b"\0" * 100)
    rebuilt = Checkpoint().with_claim(prepared(ClaimPhase.RECOVERED))
    store = CheckpointStore(tmp_path, boot_id="boot-1", recover=lambda: rebuilt)
    assert store.load().claims == rebuilt.claims
    # Written at once: another reader (a restarted agent) finds the rebuilt guard.
    assert read_checkpoint(tmp_path / "checkpoint.json").claims == rebuilt.claims


def test_a_failed_write_drops_every_change_not_in_the_file(tmp_path: Path, monkeypatch) -> None:
    """Group commit: B commits on top of A's change while A's write is under way; A's write fails.
    Neither change may stay in memory, and B's transaction fails too (its change built on A's)."""
    import driver.plugin.checkpoint as checkpoint_module
    from driver.plugin.checkpoint import FileWriteError
    from tests.plugin.conftest import wait_for

    real_write = checkpoint_module.write_atomically
    writing, proceed = threading.Event(), threading.Event()
    writes = iter(range(1_000))

    def first_write_fails(path: Path, data: bytes, **options: object) -> None:
        if next(writes) == 0:
            writing.set()
            proceed.wait(10)
            raise OSError(28, "No space left on device")
        real_write(path, data, **options)  # type: ignore[arg-type]

    monkeypatch.setattr(checkpoint_module, "write_atomically", first_write_fails)
    store = CheckpointStore(tmp_path, boot_id="boot-1")
    first, second = replace(prepared(), uid="a" * 8), replace(prepared(), uid="b" * 8)
    errors: dict[str, BaseException] = {}

    def add(claim: PreparedClaim) -> None:
        try:
            store.update(lambda checkpoint: checkpoint.with_claim(claim))
        except FileWriteError as error:
            errors[claim.uid] = error

    threads = [threading.Thread(target=add, args=(first,))]
    threads[0].start()
    assert writing.wait(10)
    threads.append(threading.Thread(target=add, args=(second,)))
    threads[1].start()
    wait_for(lambda: second.uid in store.load().claims, what="the second change in memory")
    proceed.set()
    for thread in threads:
        thread.join(10)
    assert sorted(errors) == [first.uid, second.uid]
    assert "No space left on device" in str(errors[second.uid])
    assert store.load().claims == {}
    assert not (tmp_path / "checkpoint.json").exists()
    store.update(lambda checkpoint: checkpoint.with_claim(second))  # the retry
    assert sorted(read_checkpoint(tmp_path / "checkpoint.json").claims) == [second.uid]
