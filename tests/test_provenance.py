"""The repository holds only what this project wrote.

Other projects' files that a generator or a test needs (Kubernetes' ``.proto`` definitions, Kueue's
and cluster-autoscaler's CRDs) are read from their published Go modules when needed
(``hack/gomodules.py``), never brought in; where a file is not published in a form we can fetch
(the CDI project's JSON schema), the project writes its own (``tests/plugin/cdi_spec_schema.py``).
A file taken from elsewhere is easy to recognise by what it carries along: its owners' notice, the
grant of its licence, or a line naming the project it came from. No tracked file may carry any of
them. This file names those phrases only as word lists, joined when the tests run, so that it does
not carry them either.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

_COP = "".join(("Co", "p"))  # the stem of both words, kept apart from what follows it in this file
_OWNER = _COP + "yright"
_TAKEN = _COP + "ied"
_SPDX_TAG = "-".join(("".join(("SP", "DX")), "License", "Identifier"))


def _words(*words: str) -> str:
    """A regular expression for these words in a row, any white space between them."""
    return r"\s+".join(re.escape(word) for word in words)


FOREIGN = {
    "an owners' notice": re.compile(
        rf"\b{_OWNER}\s+(?:\([cC]\)\s*|©\s*)?(?:(?:19|20)\d\d|[Tt]he\s+\w+(?:\s+\w+)*\s+Authors)"
    ),
    "a licence grant": re.compile(
        "|".join((
            _words("Licensed", "under", "the") + r"\s+(?:Apache|MIT|BSD|Mozilla)",
            re.escape(_SPDX_TAG),
            _words("Permission", "is", "hereby", "granted"),
            _words("GNU", "General", "Public", "License", "as", "published"),
        ))
    ),
    "a line naming its source": re.compile(
        "|".join((
            rf"\b[Cc]{_COP[1:]}ied\s+(?:unchanged|verbatim|as[\s-]is)\b",
            rf"\b[Cc]{_COP[1:]}ied\s+(?:\w+\s+){{0,2}}from\s+"
            r"(?:upstream|https?://|github|kubernetes|the\s+\w+\s+(?:project|repository))",
            r"\b(?:[Tt]aken|[Vv]endored)\s+" + _words("unchanged", "from"),
        ))
    ),
}  # fmt: skip


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


# What the patterns are for, joined from words when the tests run (see the module's docstring).
COPIED = [
    " ".join(("#", _OWNER, "2024", "The", "Kubernetes", "Authors.")),
    " ".join((_OWNER, "The", "Kubernetes", "Authors.")),
    " ".join(("//", _OWNER, "(c)", "2019", "Someone")),
    " ".join(("#", "Licensed", "under", "the", "Apache", "License,", "Version", "2.0")),
    "// " + _SPDX_TAG + ": Apache-2.0",
    " ".join((_TAKEN, "unchanged", "from", "upstream,", "at", "their", "upstream", "paths")),
    " ".join((_TAKEN.lower(), "from", "https://github.com/kubernetes-sigs/kueue")),
    " ".join((_TAKEN, "from", "kubernetes-sigs/kueue", "at", "tag", "v0.19.2")),
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
