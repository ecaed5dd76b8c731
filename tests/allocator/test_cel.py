"""CEL selectors: the Kubernetes quantity and semver libraries, errors, unknown domains, projection cache."""

from __future__ import annotations

import pytest

from driver.allocator.celenv import (
    DeviceFacts,
    SelectorError,
    _run,
    compile_selector,
    evaluate_selector,
    semver_map,
)

GI = 1 << 30


def _facts(**attributes: object) -> DeviceFacts:
    attrs = {"type": "gpu", "numa": 1, "fast": True, "driverVersion": semver_map("550.54.15"), **attributes}
    return DeviceFacts(
        driver="fractional.dev",
        allow_multiple=True,
        attributes={"fractional.dev": attrs, "resource.kubernetes.io": {"pcieRoot": "pci0"}},
        capacity={"fractional.dev": {"memory": 80 * GI, "compute": 100}},
    )


TRUE_EXPRESSIONS = [
    'device.driver == "fractional.dev"',
    "device.allowMultipleAllocations",
    'device.attributes["fractional.dev"].numa == 1 && device.attributes["fractional.dev"].fast',
    'device.capacity["fractional.dev"].memory.compareTo(quantity("40Gi")) > 0',
    'device.capacity["fractional.dev"].memory.isGreaterThan(quantity("79Gi"))',
    'device.capacity["fractional.dev"].memory.isLessThan(quantity("81Gi"))',
    'device.capacity["fractional.dev"].memory == quantity("81920Mi")',
    'device.capacity["fractional.dev"].memory.sub(quantity("40Gi")).compareTo(quantity("40Gi")) == 0',
    'quantity("1Gi").add(quantity("1Gi")).asInteger() == 2147483648',
    'quantity("1Gi").add(1).asInteger() == 1073741825',
    'quantity("1.5").asApproximateFloat() == 1.5',
    'quantity("-3").sign() == -1 && quantity("0").sign() == 0',
    'quantity("10").isInteger() && !quantity("100m").isInteger()',
    'isQuantity("10Gi") && !isQuantity("ten")',
    'device.capacity["fractional.dev"].compute.compareTo(quantity("100")) == 0',
    'device.attributes["fractional.dev"].driverVersion.isGreaterThan(semver("550.0.0"))',
    'device.attributes["fractional.dev"].driverVersion.major() == 550',
    'device.attributes["fractional.dev"].driverVersion.minor() == 54',
    'device.attributes["fractional.dev"].driverVersion.patch() == 15',
    'semver("1.0.0-rc.1").isLessThan(semver("1.0.0"))',
    'semver("1.0.0-alpha").compareTo(semver("1.0.0-alpha.1")) < 0',
    'semver("1.0.0+build") == semver("1.0.0")',
    'isSemver("1.2.3") && !isSemver("1.2")',
    '!has(device.attributes["other.example.com"].model)',
    '!("other.example.com" in device.attributes)',
    'device.attributes["resource.kubernetes.io"].pcieRoot.startsWith("pci")',
    'size(device.attributes["fractional.dev"]) == 4',
    '["gpu", "nic"].exists(t, t == device.attributes["fractional.dev"].type)',
]


@pytest.mark.parametrize("expression", TRUE_EXPRESSIONS)
def test_selector_is_true(expression: str) -> None:
    selector = compile_selector(expression)
    assert evaluate_selector(selector, _facts()) is True
    assert _run(selector, None, _facts()) is True  # the projection gives the same answer as the whole device
    negated = compile_selector(f"!({expression})")
    assert evaluate_selector(negated, _facts()) is False


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ('device.attributes["fractional.dev"].model == "H200"', "no such key: model"),
        ('device.attributes["other.example.com"].model == "H200"', "no such key"),
        ("device.attributes", "not bool"),
        ('quantity("abc") == quantity("1")', "not a valid quantity"),
        ('quantity("1").compareTo(semver("1.0.0")) == 0', "no such overload"),
        ('semver("1.0") == semver("1.0.0")', "not a valid semantic version"),
    ],
)
def test_runtime_errors_are_errors_not_false(expression: str, message: str) -> None:
    with pytest.raises(SelectorError, match=message):
        evaluate_selector(compile_selector(expression), _facts())


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ('device.attributes["fractional.dev"].?model.orValue("") == "H200"', "unsupported syntax"),
        ('cel.bind(g, device.attributes["fractional.dev"], g.numa == 1)', "cel.bind is not supported"),
        ("device.driver ==", "compilation failed"),
    ],
)
def test_unsupported_syntax_fails_at_compile_time(expression: str, message: str) -> None:
    with pytest.raises(SelectorError, match=message):
        compile_selector(expression)


def test_results_are_cached_per_device_and_shared_across_identical_projections() -> None:
    selector = compile_selector('device.attributes["fractional.dev"].type == "gpu"')
    first, second = _facts(uuid="GPU-1"), _facts(uuid="GPU-2")
    assert evaluate_selector(selector, first) is True
    assert first.results == {selector.expression: True}
    assert evaluate_selector(selector, second) is True
    assert second.context is None  # answered from the projection cache: no per-device CEL context built
    different = _facts(type="nic")
    assert evaluate_selector(selector, different) is False
