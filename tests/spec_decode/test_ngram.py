"""The n-gram (prompt lookup) proposer on hand-made sequences, and its incremental index
against a brute-force search."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ridge.spec_decode.ngram import NgramIndex


def brute_force(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest earlier occurrence first
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_hand_made_sequences():
    index = NgramIndex(1, 3)
    assert index.propose([1, 2, 3, 4, 1, 2, 3], 4) == [4, 1, 2, 3]
    assert NgramIndex(1, 3).propose([1, 2, 3], 2) == []  # nothing earlier
    assert NgramIndex(2, 3).propose([5, 9, 5, 7, 5], 3) == []  # only 1-grams match, min is 2
    assert NgramIndex(1, 3).propose([5, 9, 5, 7, 5], 3) == [7, 5]  # the latest occurrence of (5,)
    # the longest match wins over a more recent shorter one
    assert NgramIndex(1, 3).propose([1, 2, 3, 8, 9, 3, 7, 1, 2, 3], 2) == [8, 9]


@settings(max_examples=200, derandomize=True, deadline=None)
@given(
    st.lists(st.integers(0, 4), min_size=1, max_size=60),
    st.integers(1, 5),
    st.integers(1, 3),
    st.integers(0, 3),
    st.lists(st.integers(1, 6), min_size=1, max_size=5),
)
def test_incremental_equals_brute_force(tokens, k, lo, extra, cuts):
    hi = lo + extra
    index = NgramIndex(lo, hi)
    # the sequence grows by runs (accepted drafts), the index follows it
    length = 0
    for cut in cuts + [len(tokens)]:
        length = min(len(tokens), length + cut)
        prefix = tokens[:length]
        assert index.propose(prefix, k) == brute_force(prefix, k, lo, hi)
