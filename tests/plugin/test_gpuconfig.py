"""Strict GpuConfig decoding, per-request resolution, backend compatibility."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from driver.errors import ClaimError
from driver.plugin.gpuconfig import (
    GpuConfig,
    HamiConfig,
    MpsConfig,
    SharingConfig,
    check_backend_compatible,
    parse_gpu_config,
    resolve_share_configs,
)

HEADER = {"apiVersion": "fractional.dev/v1alpha1", "kind": "GpuConfig"}
PREFIX = "status.allocation.devices.config[1].opaque.parameters"


def gpu_config(sharing: Any) -> dict[str, Any]:
    return {**HEADER, "sharing": sharing}


def opaque(
    parameters: Any,
    *,
    source: str = "FromClaim",
    requests: list[str] | None = None,
    driver: str = "fractional.dev",
) -> dict[str, Any]:
    entry: dict[str, Any] = {"source": source, "opaque": {"driver": driver, "parameters": parameters}}
    if requests is not None:
        entry["requests"] = requests
    return entry


def claim_with(configs: list[dict[str, Any]], requests: list[str] = ("gpu",)) -> dict[str, Any]:  # type: ignore[assignment]
    return {
        "metadata": {"namespace": "team-a", "name": "train-0", "uid": "u-1"},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": r, "driver": "fractional.dev", "pool": "node-a", "device": f"gpu-{i}"}
                        for i, r in enumerate(requests)
                    ],
                    "config": configs,
                }
            }
        },
    }


def test_a_full_config_decodes_into_frozen_values() -> None:
    config = parse_gpu_config(
        gpu_config(
            {
                "backend": "hami",
                "hami": {
                    "coreUtilizationPolicy": "disable",
                    "activeOOMKiller": False,
                    "oversubscribe": True,
                    "taskPriority": 1,
                    "logLevel": 4,
                },
            }
        ),
        claim="team-a/train-0",
    )
    assert config == GpuConfig(
        sharing=SharingConfig(
            backend="hami",
            hami=HamiConfig(
                core_utilization_policy="disable",
                active_oom_killer=False,
                oversubscribe=True,
                task_priority=1,
                log_level=4,
            ),
        )
    )
    assert config.effective_backend("mps") == "hami"
    assert config.backend_options("mps") == ()
    assert dict(config.backend_options("hami"))["oversubscribe"] == "true"
    with pytest.raises(AttributeError):
        config.sharing = SharingConfig()  # type: ignore[misc]


def test_no_sharing_section_means_the_node_default() -> None:
    config = parse_gpu_config(dict(HEADER), claim="c")
    assert config == GpuConfig()
    assert config.effective_backend("mps") == "mps"


@pytest.mark.parametrize(
    ("parameters", "field", "problem"),
    [
        (
            gpu_config({"backend": "mps", "mps": {"defaultActiveThreadPercentage": 150}}),
            "sharing.mps.defaultActiveThreadPercentage",
            "150 is outside 0..100",
        ),
        (
            gpu_config({"mps": {"defaultActiveThreadPercentage": "50"}}),
            "sharing.mps.defaultActiveThreadPercentage",
            "expected an integer, found a string",
        ),
        (
            gpu_config({"mps": {"defaultActiveThreadPercentage": True}}),
            "sharing.mps.defaultActiveThreadPercentage",
            "expected an integer, found a boolean",
        ),
        (
            gpu_config({"mps": {"defaultActiveThreadPercentage": 50.0}}),
            "sharing.mps.defaultActiveThreadPercentage",
            "expected an integer, found a number",
        ),
        (gpu_config({"backend": "mig"}), "sharing.backend", "'mig' is not one of mps, hami, none"),
        (gpu_config({"backend": "mps", "timeSlicing": {}}), "sharing.timeSlicing", "unknown field"),
        (gpu_config({"mps": {"pinnedMemory": "1Gi"}}), "sharing.mps.pinnedMemory", "unknown field"),
        (gpu_config({"hami": {"taskPriority": 2}}), "sharing.hami.taskPriority", "2 is outside 0..1"),
        (gpu_config({"hami": {"oversubscribe": "yes"}}), "sharing.hami.oversubscribe", "expected a boolean"),
        (
            gpu_config({"hami": {"coreUtilizationPolicy": "max"}}),
            "sharing.hami.coreUtilizationPolicy",
            "'max'",
        ),
        (gpu_config({"backend": "hami", "mps": {}}), "sharing.mps", "set, but"),
        (gpu_config("mps"), "sharing", "expected an object, found a string"),
        ({**HEADER, "apiVersion": "fractional.dev/v1"}, "apiVersion", "is not 'fractional.dev/v1alpha1'"),
        ({**HEADER, "kind": "MpsConfig"}, "kind", "is not 'GpuConfig'"),
        ({"kind": "GpuConfig"}, "apiVersion", "None is not"),
        ({**HEADER, "extra": 1}, "extra", "unknown field"),
        ([HEADER], "", "expected an object, found a list"),
    ],
)
def test_bad_configs_name_the_full_field_path(parameters: Any, field: str, problem: str) -> None:
    claim = claim_with([opaque(gpu_config({"backend": "none"}), source="FromClass"), opaque(parameters)])
    with pytest.raises(ClaimError) as raised:
        resolve_share_configs(claim)
    expected_field = f"{PREFIX}.{field}" if field else PREFIX
    assert raised.value.field == expected_field
    assert problem in raised.value.problem
    assert raised.value.claim == "team-a/train-0"
    assert str(raised.value).startswith(f"ResourceClaim team-a/train-0: {expected_field}: ")


def test_the_style_guide_example_message() -> None:
    claim = claim_with(
        [
            opaque(gpu_config({"backend": "mps"}), source="FromClass"),
            opaque(gpu_config({"mps": {"defaultActiveThreadPercentage": 150}})),
        ]
    )
    with pytest.raises(ClaimError) as raised:
        resolve_share_configs(claim)
    assert str(raised.value) == (
        "ResourceClaim team-a/train-0: status.allocation.devices.config[1].opaque.parameters"
        ".sharing.mps.defaultActiveThreadPercentage: 150 is outside 0..100"
    )


def test_unknown_source_is_refused() -> None:
    claim = claim_with([opaque(dict(HEADER), source="FromNode")])
    with pytest.raises(ClaimError, match=r"config\[0\]\.source: 'FromNode'"):
        resolve_share_configs(claim)


def test_class_first_claim_wins_per_request() -> None:
    mps = gpu_config({"backend": "mps", "mps": {"defaultActiveThreadPercentage": 30}})
    hami = gpu_config({"backend": "hami"})
    none = gpu_config({"backend": "none"})
    claim = claim_with(
        [
            # claim entries listed first on purpose: order within the list must not beat the source
            opaque(hami, requests=["infer"]),
            opaque(mps, source="FromClass"),
            opaque(none, requests=["train/small"]),
        ],
        requests=["train/big", "train/small", "infer", "other"],
    )
    resolved = resolve_share_configs(claim)
    backends = {request: config.sharing.backend if config else None for request, config in resolved.items()}
    assert backends == {"train/big": "mps", "train/small": "none", "infer": "hami", "other": "mps"}
    assert resolved["train/big"] == GpuConfig(
        SharingConfig(backend="mps", mps=MpsConfig(default_active_thread_percentage=30))
    )


def test_a_parent_request_name_covers_its_subrequests_and_later_entries_win() -> None:
    claim = claim_with(
        [
            opaque(gpu_config({"backend": "hami"}), requests=["train"]),
            opaque(gpu_config({"backend": "none"}), requests=["train"]),
        ],
        requests=["train/big", "eval"],
    )
    resolved = resolve_share_configs(claim)
    assert resolved["train/big"] == GpuConfig(SharingConfig(backend="none"))
    assert resolved["eval"] is None


def test_other_drivers_are_ignored_and_no_config_is_none() -> None:
    claim = claim_with([opaque({"anything": "goes"}, driver="gpu.nvidia.com")])
    claim["status"]["allocation"]["devices"]["results"].append(
        {"request": "nic", "driver": "other.dev", "pool": "p", "device": "x"}
    )
    assert resolve_share_configs(claim) == {"gpu": None}
    assert resolve_share_configs(claim_with([])) == {"gpu": None}


def test_resolution_is_pure() -> None:
    claim = claim_with([opaque(gpu_config({"backend": "mps"}))])
    before = copy.deepcopy(claim)
    assert resolve_share_configs(claim) == resolve_share_configs(claim)
    assert claim == before


@pytest.mark.parametrize(
    ("existing", "wanted", "ok"),
    [
        (None, "mps", True),
        (None, "hami", True),
        ("mps", "mps", True),
        ("hami", "hami", True),
        ("none", "none", True),
        ("hami", "none", True),
        ("none", "hami", True),
        ("mps", "hami", False),
        ("mps", "none", False),
        ("hami", "mps", False),
        ("none", "mps", False),
    ],
)
def test_backend_compatibility(existing: str | None, wanted: str, ok: bool) -> None:
    if ok:
        check_backend_compatible(existing, wanted, "gpu-3", claim="team-a/b")
        return
    with pytest.raises(ClaimError) as raised:
        check_backend_compatible(existing, wanted, "gpu-3", claim="team-a/b")
    assert raised.value.claim == "team-a/b"
    assert f"gpu-3 is already shared with backend '{existing}'" in str(raised.value)


def test_an_admin_can_forbid_claims_to_pick_their_backend() -> None:
    """--allow-claim-backend-override=false: the class's config and the node decide; a claim's own
    entry naming a backend fails the claim, naming the field, while its other options still apply."""
    hami = gpu_config({"backend": "hami"})
    from_class = claim_with([opaque(hami, source="FromClass")])
    assert resolve_share_configs(from_class, allow_claim_backend=False)["gpu"] == GpuConfig(
        SharingConfig(backend="hami")
    )
    tenant = claim_with([opaque(hami, source="FromClass"), opaque(gpu_config({"backend": "none"}))])
    allowed = resolve_share_configs(tenant)  # by default the claim wins
    assert allowed["gpu"] == GpuConfig(SharingConfig(backend="none"))
    with pytest.raises(ClaimError) as refused:
        resolve_share_configs(tenant, allow_claim_backend=False)
    assert refused.value.field == "status.allocation.devices.config[1].opaque.parameters.sharing.backend"
    assert "--allow-claim-backend-override=false" in str(refused.value)
    options_only = claim_with([opaque(gpu_config({"mps": {"defaultActiveThreadPercentage": 20}}))])
    assert resolve_share_configs(options_only, allow_claim_backend=False)["gpu"] is not None
