"""The emulator measured against the real kube-apiserver: the differential corpus (tests/differential).

The real server's answers to every case are recorded in ``tests/data/differential/`` (by
``pytest --cluster=real --record-differential``, on the release named in the file). Here:
- on the emulator (every ``make test``), each case's answers are compared with the recording. A
  case that differs must be listed in ``departures.yaml`` with the reason it stays; a listed case
  that no longer differs must leave the list. README states the figure, checked below;
- on the real server (``--cluster=real``), each case is sent again and must still answer as
  recorded, so the recording cannot go stale against the release it names.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from driver.cluster.apiserver import APIServer
from tests.conftest import REPO_ROOT
from tests.differential.corpus import CASES
from tests.differential.engine import Case, differences, http_sender, run_case

DATA = REPO_ROOT / "tests" / "data" / "differential"
RELEASE = "1.37.2"  # the recording the emulator is measured against
RECORDING = DATA / f"real-{RELEASE}.json"
DEPARTURES = DATA / "departures.yaml"
BY_NAME = {case.name: case for case in CASES}


@functools.cache
def _recording(path: Path = RECORDING) -> dict[str, Any]:
    if not path.exists():
        return {}
    cases: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))["cases"]
    return cases


@functools.cache
def _listed() -> dict[str, dict[str, str]]:
    loaded: dict[str, dict[str, str]] = yaml.safe_load(DEPARTURES.read_text(encoding="utf-8")) or {}
    return loaded


def _departures() -> dict[str, str]:
    """Cases that still differ, each with the reason it stays."""
    return dict(_listed().get("cases") or {})


def _ignored() -> frozenset[str]:
    """Fields no comparison looks at, each with its reason in the file."""
    return frozenset(_listed().get("ignored") or {})


def _emulator_answers(case: Case) -> list[dict[str, Any]]:
    with APIServer(kubernetes_version=".".join(RELEASE.split(".")[:2])) as server:
        return run_case(case, http_sender(server.url))


def test_case_names_are_unique() -> None:
    assert len(BY_NAME) == len(CASES)


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_emulator_answers_as_the_real_apiserver(name: str) -> None:
    recorded = _recording()
    assert name in recorded, (
        f"{name}: not recorded; run pytest --cluster=real --record-differential -n0 -k differential"
    )
    found = differences(recorded[name], _emulator_answers(BY_NAME[name]), ignored=_ignored())
    departures = _departures()
    if name in departures:
        assert found, f"{name}: now answers as the real apiserver; remove it from {DEPARTURES.name}"
        return
    assert not found, f"{name} departs from kube-apiserver {RELEASE}:\n" + "\n".join(found)


def test_departures_name_cases_and_say_why() -> None:
    assert set(_listed()) <= {"ignored", "cases"}
    for name, reason in {**_departures(), **dict(_listed().get("ignored") or {})}.items():
        assert isinstance(reason, str) and len(reason.split()) >= 4, f"{name}: say why it departs"
    for name in _departures():
        assert name in BY_NAME, f"{DEPARTURES.name}: {name} is no case of the corpus"


def test_readme_states_the_measured_figure() -> None:
    identical = len(CASES) - len(_departures())
    figure = f"{identical} of {len(CASES)} cases"
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    assert figure in readme and RELEASE in readme, (
        f"README must state the figure: {figure} (kube-apiserver {RELEASE})"
    )


# -- on the real server --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fresh_recording(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """Answers gathered from the real server; written out at the end with --record-differential."""
    answers: dict[str, Any] = {}
    yield answers
    if request.config.getoption("record_differential") and answers:
        version = request.getfixturevalue("_real_control_plane").version
        merged = {**_recording(DATA / f"real-{version}.json"), **answers}
        document = {"version": version, "cases": dict(sorted(merged.items()))}
        (DATA / f"real-{version}.json").write_text(
            json.dumps(document, indent=1, sort_keys=True) + "\n", encoding="utf-8"
        )


@pytest.mark.shared
@pytest.mark.real_only
@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_real_apiserver_answers_as_recorded(name: str, api_server: Any, fresh_recording: dict[str, Any],
                                            request: pytest.FixtureRequest) -> None:  # fmt: skip
    answers = run_case(BY_NAME[name], http_sender(api_server.url, context=api_server.tls_context()))
    fresh_recording[name] = answers
    if request.config.getoption("record_differential"):
        return
    recorded = _recording(DATA / f"real-{api_server.version}.json")
    assert name in recorded, f"{name}: not recorded for {api_server.version}; add --record-differential"
    found = differences(recorded[name], answers, ("recorded", "now"))
    assert not found, f"{name}: the real apiserver no longer answers as recorded:\n" + "\n".join(found)
