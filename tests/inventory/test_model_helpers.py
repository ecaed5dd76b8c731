"""Pure helpers of the device model: bus ids, versions, CPU lists."""

from __future__ import annotations

import pytest

from driver.inventory.model import normalize_pci_bus_id, normalize_version, parse_cpu_list


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"00000000:65:00.0", "0000:65:00.0"),
        ("00000000:1B:00.0", "0000:1b:00.0"),
        ("0000:c3:00.1", "0000:c3:00.1"),
        ("65:00.0", "0000:65:00.0"),
        (b"00000001:65:00.0\x00", "0001:65:00.0"),
    ],
)
def test_normalize_pci_bus_id(raw: str | bytes, expected: str) -> None:
    assert normalize_pci_bus_id(raw) == expected


@pytest.mark.parametrize("raw", ["", "0000:65:00", "0000:65:00.8", "100000000:65:00.0", "gpu-0"])
def test_normalize_pci_bus_id_rejects(raw: str) -> None:
    with pytest.raises(ValueError, match="PCI"):
        normalize_pci_bus_id(raw)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("12.4", "12.4.0"),
        ("550.54.15", "550.54.15"),
        ("535.104.05", "535.104.5"),
        ("9", "9.0.0"),
        ("8.0", "8.0.0"),
    ],
)
def test_normalize_version(raw: str, expected: str) -> None:
    assert normalize_version(raw) == expected


@pytest.mark.parametrize("raw", ["", "1.2.3.4", "12.x", "v12.4", "1..2"])
def test_normalize_version_rejects(raw: str) -> None:
    with pytest.raises(ValueError, match="version"):
        normalize_version(raw)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("0-3,8-11", (0, 1, 2, 3, 8, 9, 10, 11)), ("5", (5,)), ("", ()), ("3,1-2\n", (1, 2, 3))],
)
def test_parse_cpu_list(text: str, expected: tuple[int, ...]) -> None:
    assert parse_cpu_list(text) == expected


@pytest.mark.parametrize("text", ["3-1", "a-b", "1-", "-1"])
def test_parse_cpu_list_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="CPU list"):
        parse_cpu_list(text)
