"""all_finite: the check every step makes before a batch's gradients may reach the swarm."""
from __future__ import annotations

import math

import pytest
import torch

from averaging.pipeline.guards import all_finite


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_one_non_finite_value_in_any_tensor_is_found(bad):
    tensors = [torch.zeros(3), None, torch.ones(2, 2), torch.arange(5.0)]
    assert all_finite(tensors)
    tensors[2][1, 0] = bad
    assert not all_finite(tensors)


def test_no_tensors_missing_gradients_or_empty_tensors_count_as_finite():
    assert all_finite([]) and all_finite([None, None]) and all_finite([torch.empty(0), torch.ones(2)])
    assert not all_finite([torch.empty(0), torch.tensor([math.nan])])


def test_integer_and_half_precision_tensors_are_checked_alike():
    assert all_finite([torch.arange(4), torch.ones(3, dtype=torch.float16), torch.ones(2, dtype=torch.bfloat16)])
    assert not all_finite([torch.arange(4), torch.tensor([1.0, math.inf], dtype=torch.float16)])


def test_large_finite_values_are_finite_even_where_their_squares_overflow():
    assert all_finite([torch.tensor([1e30, -3e38]), torch.full((4,), 60000.0, dtype=torch.float16)])
    assert not all_finite([torch.tensor([1e30, math.nan]), torch.ones(3)])


def test_tensors_of_several_dtypes_are_each_checked():
    finite = [torch.ones(2), torch.ones(2, dtype=torch.float64), torch.ones(2, dtype=torch.complex64)]
    assert all_finite(finite)
    for index in range(3):
        tensors = [tensor.clone() for tensor in finite]
        tensors[index][0] = math.nan
        assert not all_finite(tensors), index
