"""Hypothesis strategies shared by the fuzz harnesses of the file readers."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st


def json_values(nasty: list[Any]) -> st.SearchStrategy[Any]:
    """Any JSON-like value: hand-picked hostile scalars, huge or non-finite numbers, nesting."""
    scalars = st.one_of(
        st.sampled_from(nasty),
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=8),
    )
    return st.recursive(
        scalars,
        lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
        max_leaves=8,
    )
