"""The CLI's rough edges, as a new user met them: the top-level help, help text on every flag,
exit 2 for every configuration error (an unknown profile, a file that is no kubeconfig), and no
traceback when the reader of a pipe goes away."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from driver.cli import _build_parser

REPO_ROOT = Path(__file__).resolve().parents[1]


def _fractional(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "driver", *args], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60
    )


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = _build_parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_the_top_level_help_names_every_command_in_plain_words() -> None:
    description = _build_parser().description or ""
    assert "``" not in description
    for command in _subparsers():
        assert command in description, command


@pytest.mark.parametrize("command", sorted(_subparsers()))
def test_every_flag_says_what_it_is(command: str) -> None:
    parser = _subparsers()[command]
    silent = [
        action.option_strings[-1]
        for action in parser._actions
        if action.option_strings and action.help in (None, "") and action.dest != "help"
    ]
    assert not silent, f"fractional {command}: flags without help: {silent}"


@pytest.mark.parametrize(
    "args",
    [
        ("discover", "--profile", "no-such-profile"),
        ("plan", "--profile", "no-such-profile", "--claims", "examples/plan/claims.yaml"),
    ],
    ids=["discover", "plan"],
)
def test_an_unknown_profile_is_a_configuration_error(args: tuple[str, ...]) -> None:
    done = _fractional(*args)
    assert done.returncode == 2, done.stderr
    assert "--profile (FRACTIONAL_PROFILE)" in done.stderr and "shipped: " in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "content", ["- a\n- b\n", "just-a-string\n", "clusters: 3\n"], ids=["list", "str", "junk"]
)
def test_a_file_that_is_no_kubeconfig_is_a_configuration_error(tmp_path: Path, content: str) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(content, encoding="utf-8")
    done = _fractional("status", "--kubeconfig", str(kubeconfig))
    assert done.returncode == 2, done.stderr
    assert "--kubeconfig (FRACTIONAL_KUBECONFIG)" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_reader_that_goes_away_gets_no_traceback() -> None:
    """``fractional discover -o json | head -c 10``: here the reader is gone before the first write,
    so the write fails for certain (a pipe buffer would otherwise hide it)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "driver", "discover", "--profile", "h100-8x", "-o", "json"],
            stdout=write_end, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT, timeout=60,
        )  # fmt: skip
    finally:
        os.close(write_end)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
