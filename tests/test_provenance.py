"""The repository holds only what this project wrote.

Other projects' files that a generator or a test needs (Kubernetes' ``.proto`` definitions, Kueue's
and cluster-autoscaler's CRDs) are read from their published Go modules when needed
(``hack/gomodules.py``), never copied in; where a file is not published in a form we can fetch (the
CDI project's JSON schema), the project writes its own (``tests/plugin/cdi_spec_schema.py``). A
copied file is easy to recognise by what it carries along: its project's licence header, or a line
saying where it was copied from. No tracked file may carry either. (The patterns are spelled so
that this file does not match them.)
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

FOREIGN = {
    "a copyright line": re.compile(
        r"\bCopyrigh[t]\s+(?:\([cC]\)\s*|©\s*)?(?:(?:19|20)\d\d|[Tt]he\s+\w+(?:\s+\w+)*\s+Authors)"
    ),
    "a licence header": re.compile(
        r"Licensed\s+under\s+the\s+(?:Apache|MIT|BSD|Mozilla)|SPDX-License-Identifie[r]"
        r"|Permission\s+is\s+hereby\s+grante[d]|GNU\s+General\s+Public\s+Licens[e]\s+as\s+published"
    ),
    "a provenance line": re.compile(
        r"\b[Cc]opie[d]\s+(?:unchanged|verbatim|as[\s-]is)\b|\b[Cc]opie[d]\s+(?:\w+\s+){0,2}from\s+"
        r"(?:upstream|https?://|github|kubernetes|the\s+\w+\s+(?:project|repository))"
        r"|\b(?:[Tt]aken|[Vv]endored)\s+unchange[d]\s+from"
    ),
}


def _tracked() -> list[str]:
    result = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True, check=False)
    return [name for name in result.stdout.decode().split("\0") if name]


def test_no_tracked_file_carries_another_projects_licence_or_provenance() -> None:
    tracked = _tracked()
    if not tracked:
        pytest.skip("not a git checkout")
    found = []
    for name in tracked:
        path = REPO_ROOT / name
        if not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary (images); none of it is text to read
        text = data.decode("utf-8", errors="replace")
        for what, pattern in FOREIGN.items():
            if match := pattern.search(text):
                line = text.count("\n", 0, match.start()) + 1
                found.append(f"{name}:{line}: {what}: {match.group(0)!r}")
    assert not found, "other projects' files or text in the repository:\n" + "\n".join(found)


# Samples of what the patterns are for, cut in two so that the repository itself never holds them.
COPIED = [
    "# Copy" + "right 2024 The Kubernetes Authors.",
    "Copy" + "right The Kubernetes Authors.",
    "// Copy" + "right (c) 2019 Someone",
    "# Licensed under " + 'the Apache License, Version 2.0 (the "License");',
    "// SPDX-License-" + "Identifier: Apache-2.0",
    "Copied " + "unchanged from upstream, at their upstream paths",
    "copied " + "from https://github.com/kubernetes-sigs/kueue",
    "Copied " + "from kubernetes-sigs/kueue at tag v0.19.2",
]


@pytest.mark.parametrize("text", COPIED)
def test_the_patterns_find_what_they_are_for(text: str) -> None:
    assert any(pattern.search(text) for pattern in FOREIGN.values()), text


@pytest.mark.parametrize(
    "text",
    [
        "copyright: Path | None = None",  # the busybox image keeps Debian's copyright file for it
        "the others are copied as read",
        "json.dumps(marker); copied = position = end",
    ],
)
def test_the_patterns_leave_our_own_words_alone(text: str) -> None:
    assert not any(pattern.search(text) for pattern in FOREIGN.values()), text
