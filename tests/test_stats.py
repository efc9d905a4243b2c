import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ridge.stats import percentile


@settings(derandomize=True, max_examples=200, deadline=None)
@given(
    st.lists(st.floats(min_value=-1e6, max_value=1e6, allow_nan=False), min_size=1, max_size=50),
    st.floats(min_value=0, max_value=100),
)
def test_matches_numpys_linear_percentile(values, q):
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-9, abs=1e-6)


def test_order_of_the_samples_does_not_matter_and_the_ends_are_min_and_max():
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(xs, 50) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 5.0
    assert percentile([7.0], 99) == 7.0


def test_no_samples_is_nan_and_q_out_of_range_is_an_error():
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="q must be in"):
        percentile([1.0], 101)
    with pytest.raises(ValueError, match="q must be in"):
        percentile([1.0], -1)
