"""driver/jsondepth.py: the depth measured before decoding equals the decoded value's depth."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from driver.jsondepth import json_depth


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


# Strings full of what the measure must not count: brackets, quotes, backslashes, escapes.
_TRICKY = st.text(alphabet=st.sampled_from(list('[]{}"\\/:,ab\n\t\u00e9\u2028\U0001f600')), max_size=12)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | _TRICKY,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(_TRICKY, children, max_size=4),
    max_leaves=40,
)


@settings(max_examples=400)
@given(_JSON, st.booleans(), st.booleans())
def test_depth_matches_the_decoded_value(value: Any, ascii_only: bool, as_bytes: bool) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only)
    raw: bytes | str = text.encode() if as_bytes else text
    assert json_depth(raw) == _depth(value)


def test_brackets_inside_strings_do_not_count() -> None:
    assert json_depth(r'{"k:{\"name\":\"main\"}": {"[[[[": "]]]]{{{{"}}') == 2
    assert json_depth('["\\\\", "[", "\\"[\\""]') == 1
    assert json_depth('"[[[["') == 0
    assert json_depth("7") == 0


def test_deep_documents_are_measured_without_recursion() -> None:
    assert json_depth("[" * 100_000 + "]" * 100_000) == 100_000
    assert json_depth('{"a":' * 5_000 + "1" + "}" * 5_000) == 5_000
