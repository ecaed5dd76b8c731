"""Container edits of the sharing backends (pure) and the HAMi host-side files."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from driver.config import PluginConfig
from driver.plugin.gpuconfig import parse_gpu_config
from driver.plugin.sharing import (
    ContainerEdits,
    HamiBackend,
    Mount,
    MpsBackend,
    NoneBackend,
    ShareSpec,
    build_sharing_backends,
)

GIB = 1024**3
CLAIM_UID = "0b6c3c8e-8d4f-4c1e-9a57-3f0a2d9c1e11"
SHARE = ShareSpec(
    claim_uid=CLAIM_UID,
    device="gpu-0",
    gpu_uuid="GPU-1f6b2a4c-0000-4000-8000-000000000001",
    ordinal=0,
    share_id="7d2f1c3e-1111-4a2b-9c3d-4e5f6a7b8c9d",
    memory_bytes=10 * GIB,
    compute_percent=25,
    whole_gpu=False,
)


def env_names(edits: ContainerEdits) -> list[str]:
    return sorted(entry.split("=", 1)[0] for entry in edits.env)


def test_mps_edits_for_a_10gib_25_percent_share(tmp_path: Path) -> None:
    backend = MpsBackend(plugin_dir=str(tmp_path))
    edits = backend.container_edits(SHARE)
    assert sorted(edits.env) == sorted(
        [
            "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps",
            f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={SHARE.gpu_uuid}=10240M",
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25",
        ]
    )
    assert edits.mounts == (
        Mount(str(tmp_path / "mps" / SHARE.gpu_uuid / "pipe"), "/tmp/nvidia-mps", ("rbind", "rw")),
    )
    assert edits.device_nodes == ()


@pytest.mark.parametrize(
    ("compute", "options", "expected"),
    [
        (0, (), None),
        (0, (("defaultActiveThreadPercentage", "40"),), "40"),
        (30, (("defaultActiveThreadPercentage", "40"),), "30"),  # the guaranteed share wins
        (0, (("defaultActiveThreadPercentage", "0"),), None),
    ],
)
def test_mps_active_thread_percentage(
    tmp_path: Path, compute: int, options: tuple[tuple[str, str], ...], expected: str | None
) -> None:
    edits = MpsBackend(plugin_dir=str(tmp_path)).container_edits(
        replace(SHARE, compute_percent=compute, backend_options=options)
    )
    values = [e.split("=", 1)[1] for e in edits.env if e.startswith("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=")]
    assert values == ([] if expected is None else [expected])


def test_mps_options_come_from_a_decoded_gpu_config(tmp_path: Path) -> None:
    config = parse_gpu_config(
        {
            "apiVersion": "fractional.dev/v1alpha1",
            "kind": "GpuConfig",
            "sharing": {"backend": "mps", "mps": {"defaultActiveThreadPercentage": 60}},
        },
        claim="team-a/c",
    )
    share = replace(SHARE, compute_percent=0, backend_options=config.backend_options("mps"))
    edits = MpsBackend(plugin_dir=str(tmp_path)).container_edits(share)
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=60" in edits.env


def test_hami_edits_for_a_10gib_25_percent_share(tmp_path: Path) -> None:
    edits = HamiBackend(plugin_dir=str(tmp_path)).container_edits(SHARE)
    assert sorted(edits.env) == sorted(
        [
            "CUDA_DEVICE_MEMORY_LIMIT_0=10240m",
            "CUDA_DEVICE_SM_LIMIT=25",
            "CUDA_DEVICE_SM_LIMIT_0=25",
            f"CUDA_DEVICE_MEMORY_SHARED_CACHE=/tmp/hami/{CLAIM_UID}.cache",
        ]
    )
    assert edits.mounts == (
        Mount(str(tmp_path / "hami" / "claims" / CLAIM_UID), "/tmp/hami", ("rbind", "rw")),
    )


def test_hami_second_gpu_uses_its_ordinal_and_no_compute_means_no_sm_limit(tmp_path: Path) -> None:
    backend = HamiBackend(plugin_dir=str(tmp_path))
    edits = backend.container_edits(replace(SHARE, ordinal=1, memory_bytes=512 * 1024**2))
    assert "CUDA_DEVICE_MEMORY_LIMIT_1=512m" in edits.env
    assert "CUDA_DEVICE_SM_LIMIT_1=25" in edits.env
    assert not any(e.startswith("CUDA_DEVICE_SM_LIMIT=") for e in edits.env)
    best_effort = backend.container_edits(replace(SHARE, compute_percent=0))
    assert env_names(best_effort) == ["CUDA_DEVICE_MEMORY_LIMIT_0", "CUDA_DEVICE_MEMORY_SHARED_CACHE"]


def test_hami_options_become_hami_core_variables(tmp_path: Path) -> None:
    config = parse_gpu_config(
        {
            "apiVersion": "fractional.dev/v1alpha1",
            "kind": "GpuConfig",
            "sharing": {
                "backend": "hami",
                "hami": {"coreUtilizationPolicy": "force", "activeOOMKiller": True, "logLevel": 2},
            },
        },
        claim="team-a/c",
    )
    edits = HamiBackend(plugin_dir=str(tmp_path)).container_edits(
        replace(SHARE, backend_options=config.backend_options("hami"))
    )
    assert {"GPU_CORE_UTILIZATION_POLICY=FORCE", "ACTIVE_OOM_KILLER=true", "LIBCUDA_LOG_LEVEL=2"} <= set(
        edits.env
    )


def test_hami_library_adds_read_only_library_and_preload_mounts(tmp_path: Path) -> None:
    library = tmp_path / "host" / "libvgpu.so"
    library.parent.mkdir()
    library.write_bytes(b"\x7fELF")
    backend = HamiBackend(plugin_dir=str(tmp_path / "plugin"), library=str(library))
    edits = backend.container_edits(SHARE)
    by_target = {m.container_path: m for m in edits.mounts}
    assert set(by_target) == {
        "/tmp/hami",
        "/usr/local/vgpu/libvgpu.so",
        "/etc/ld.so.preload",
        "/tmp/vgpulock",
    }
    assert by_target["/usr/local/vgpu/libvgpu.so"].host_path == str(library)
    assert "ro" in by_target["/usr/local/vgpu/libvgpu.so"].options
    assert "ro" in by_target["/etc/ld.so.preload"].options
    assert not any(e.startswith("LD_PRELOAD=") for e in edits.env)

    backend.acquire(SHARE)
    preload = Path(by_target["/etc/ld.so.preload"].host_path)
    assert preload.read_text() == "/usr/local/vgpu/libvgpu.so\n"
    assert Path(by_target["/tmp/hami"].host_path).is_dir()
    assert Path(by_target["/tmp/vgpulock"].host_path).is_dir()


def test_hami_removes_the_temp_file_a_kill_left(tmp_path: Path) -> None:
    hami = tmp_path / "hami"
    hami.mkdir()
    leftover, other = hami / ".ld.so.preload.k3j9x.tmp", hami / "notes.tmp"
    for path in (leftover, other):
        path.write_text("partial")
    HamiBackend(plugin_dir=str(tmp_path))
    assert not leftover.exists() and other.exists()


def test_hami_cache_dir_lives_until_the_claims_last_share(tmp_path: Path) -> None:
    backend = HamiBackend(plugin_dir=str(tmp_path))
    second = replace(SHARE, device="gpu-1", gpu_uuid="GPU-2", ordinal=1, share_id=None)
    backend.acquire(SHARE)
    backend.acquire(second)
    backend.acquire(SHARE)  # idempotent
    cache = backend.claim_cache_dir(CLAIM_UID)
    assert cache.is_dir()
    backend.release(SHARE)
    assert cache.is_dir()
    backend.release(second)
    assert not cache.exists()
    backend.release(second)  # unknown share: fine


def test_none_adds_nothing(tmp_path: Path) -> None:
    backend = NoneBackend()
    assert backend.container_edits(SHARE) == ContainerEdits()
    backend.acquire(SHARE)
    backend.release(SHARE)
    backend.close()


@pytest.mark.parametrize("name", ["mps", "hami", "none"])
def test_whole_gpu_gets_no_limits(tmp_path: Path, name: str) -> None:
    config = PluginConfig(node_name="n", profile="p", plugin_dir=str(tmp_path), hami_library="/x/libvgpu.so")
    backend = build_sharing_backends(config)[name]
    whole = replace(SHARE, share_id=None, memory_bytes=80 * GIB, compute_percent=0, whole_gpu=True)
    assert backend.container_edits(whole) == ContainerEdits()
    backend.acquire(whole)  # no daemon, no directories
    backend.release(whole)
    assert not (tmp_path / "mps").exists()
    assert not (tmp_path / "hami").exists()
    backend.close()


def test_factory_builds_the_three_backends_from_config(tmp_path: Path) -> None:
    config = PluginConfig(
        node_name="n", profile="p", plugin_dir=str(tmp_path), mps_control="/opt/bin/nvidia-cuda-mps-control"
    )
    backends = build_sharing_backends(config)
    assert sorted(backends) == ["hami", "mps", "none"]
    for name, backend in backends.items():
        assert backend.name == name
        assert backend.describe()["backend"] == name
    assert backends["mps"].describe()["control"] == "/opt/bin/nvidia-cuda-mps-control"
    for backend in backends.values():
        backend.close()
