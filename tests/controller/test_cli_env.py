"""Flags' environment twins: a bad value is a configuration error naming the flag, never a traceback."""

from __future__ import annotations

import pytest

from driver.cli import main


@pytest.mark.parametrize(
    ("argv", "env", "flag"),
    [
        (["plugin", "--node-name", "n"], {"FRACTIONAL_RESYNC_SECONDS": "abc"}, "FRACTIONAL_RESYNC_SECONDS"),
        (
            ["plugin", "--node-name", "n"],
            {"FRACTIONAL_HEALTH_RESEND_SECONDS": "10s"},
            "--health-resend-seconds",
        ),
        (
            ["plugin", "--node-name", "n", "--profile", "l4-2x"],
            {"FRACTIONAL_RESYNC_SECONDS": "0"},
            "--resync-seconds",
        ),
        (["controller"], {"FRACTIONAL_LEADER_ELECT": "ture"}, "FRACTIONAL_LEADER_ELECT"),
        (["controller"], {"FRACTIONAL_LOG_LEVEL": "verbose"}, "--log-level"),
        (["controller", "--log-level", "loud"], {}, "FRACTIONAL_LOG_LEVEL"),
        (["controller"], {"FRACTIONAL_LOG_FORMAT": "xml"}, "--log-format"),
        (["controller"], {"FRACTIONAL_GANG_SOURCES": "upstream,slurm"}, "FRACTIONAL_GANG_SOURCES"),
        (["apiserver", "--kubernetes-version", "1.34"], {}, "--kubernetes-version"),
        (["controller"], {"FRACTIONAL_KUBE_API_QPS": "fast"}, "FRACTIONAL_KUBE_API_QPS"),
        (["controller"], {"FRACTIONAL_KUBE_API_BURST": "1.5"}, "FRACTIONAL_KUBE_API_BURST"),
        (["controller", "--kube-api-burst", "0"], {}, "--kube-api-burst"),
        (["controller", "--kube-api-qps", "nan"], {}, "--kube-api-qps"),
        (["controller", "--kube-api-qps", "inf"], {}, "--kube-api-qps"),
    ],
)
def test_bad_values_are_configuration_errors(
    argv: list[str],
    env: dict[str, str],
    flag: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(argv) == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize(
    ("raw", "expected"), [("true", True), ("On", True), ("0", False), ("false", False), ("", False)]
)
def test_boolean_twins(raw: str, expected: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from driver.cli import _build_parser

    monkeypatch.setenv("FRACTIONAL_LEADER_ELECT", raw)
    assert _build_parser().parse_args(["controller"]).leader_elect is expected


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        ([], None, True),  # on by default
        (["--preemption=false"], None, False),
        (["--preemption", "off"], None, False),
        (["--preemption"], "false", True),  # the flag beats its env twin
        ([], "false", False),
        ([], "1", True),
    ],
)
def test_preemption_switch(
    argv: list[str], env: str | None, expected: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from driver.cli import _build_parser, build_controller_config

    if env is not None:
        monkeypatch.setenv("FRACTIONAL_PREEMPTION", env)
    assert build_controller_config(_build_parser().parse_args(["controller", *argv])).preemption is expected


def test_a_bad_preemption_value_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from driver.cli import _build_parser

    with pytest.raises(SystemExit):
        _build_parser().parse_args(["controller", "--preemption=sometimes"])
    assert "--preemption" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        ([], {}, (50.0, 100)),  # kube-scheduler's defaults
        (["--kube-api-qps", "20", "--kube-api-burst", "40"], {}, (20.0, 40)),
        ([], {"FRACTIONAL_KUBE_API_QPS": "7.5", "FRACTIONAL_KUBE_API_BURST": "3"}, (7.5, 3)),
        (["--kube-api-qps", "10"], {"FRACTIONAL_KUBE_API_QPS": "7.5"}, (10.0, 100)),  # the flag wins
        (["--kube-api-qps", "0", "--kube-api-burst", "0"], {}, (0.0, 0)),  # no limit: burst unused
        (["--kube-api-qps", "-1"], {}, (-1.0, 100)),  # no limit either (client-go: only this; 0 is its 5)
    ],
)
def test_kube_api_rate_limit_flags(
    argv: list[str], env: dict[str, str], expected: tuple[float, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    from driver.cli import _build_parser, build_controller_config

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = build_controller_config(_build_parser().parse_args(["controller", *argv]))
    assert (config.kube_api_qps, config.kube_api_burst) == expected
