"""tests/token_match.py: the near-tie rule the hybrid token tests use."""

from __future__ import annotations

import pytest

from token_match import TIE_NATS, assert_equal_up_to_a_near_tie


def test_equal_sequences_pass_and_a_near_tie_may_part():
    want = [[5, 6, 7, 8], [1, 2, 3]]
    gaps = [[1.0, 0.01, 2.0, 2.0], [3.0, 3.0, 3.0]]
    assert_equal_up_to_a_near_tie(want, want, gaps)
    assert_equal_up_to_a_near_tie([[5, 9, 1, 1], [1, 2, 3]], want, gaps)  # parts at a 0.01-nat tie


@pytest.mark.parametrize("got", [[[5, 6, 9, 8], [1, 2, 3]],   # parts where the gap is 2 nats
                                 [[5, 6, 7, 8], [4, 2, 3]],   # parts at the first token
                                 [[5, 6, 7], [1, 2, 3]]])     # shorter
def test_a_clear_difference_fails(got):
    want = [[5, 6, 7, 8], [1, 2, 3]]
    gaps = [[1.0, 0.01, 2.0, 2.0], [3.0, 3.0, 3.0]]
    with pytest.raises(AssertionError):
        assert_equal_up_to_a_near_tie(got, want, gaps)
    assert TIE_NATS == 0.05
