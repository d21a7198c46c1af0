"""Bit tests of ancestor bitmasks: the arithmetic form (``arithmetic_bits()``, what the ONNX export
traces) equals the bitwise one over every int64, the sign bit and INT64_MIN/MAX included; Python's
own integers are the oracle."""
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from specgraph.kernels import bitmask
from specgraph.kernels.bitmask import arithmetic_bits, bit_at, low_bits, mask_to_matrix

INT64_MIN, INT64_MAX = torch.iinfo(torch.int64).min, torch.iinfo(torch.int64).max
EDGES = [INT64_MIN, INT64_MIN + 1, -(1 << 62), -2, -1, 0, 1, 1 << 62, (1 << 62) - 1, INT64_MAX - 1, INT64_MAX]
int64s = st.one_of(st.sampled_from(EDGES), st.integers(INT64_MIN, INT64_MAX))


def bit(value: int, j: int) -> bool:
    """Bit j of value's two's complement (Python's >> is arithmetic on negatives)."""
    return (value >> j) & 1 == 1


@given(st.lists(int64s, min_size=1, max_size=8))
@example(EDGES)
def test_bit_at_is_exact_in_both_forms(values):
    x = torch.tensor(values, dtype=torch.int64).unsqueeze(-1)  # [V, 1]
    j = torch.arange(64)  # [64]
    want = torch.tensor([[bit(v, k) for k in range(64)] for v in values])
    assert torch.equal(bit_at(x, j), want)
    with arithmetic_bits():
        assert torch.equal(bit_at(x, j), want)


@given(st.lists(int64s, min_size=1, max_size=8), st.integers(1, 64))
@example(EDGES, 64)
def test_mask_to_matrix_is_the_same_in_both_forms(values, n):
    mask = torch.tensor(values, dtype=torch.int64).view(1, -1)
    bitwise = mask_to_matrix(mask, n)
    with arithmetic_bits():
        arithmetic = mask_to_matrix(mask, n)
    assert arithmetic.shape == (1, len(values), n) and torch.equal(arithmetic, bitwise)
    assert bitwise[0].tolist() == [[bit(v, k) for k in range(n)] for v in values]


@given(st.lists(int64s, min_size=1, max_size=8), st.integers(1, 63))
@example(EDGES, 63)
@example(EDGES, 62)
def test_low_bits_is_the_same_in_both_forms(values, r):
    x = torch.tensor(values, dtype=torch.int64)
    want = torch.tensor([v & ((1 << r) - 1) for v in values])
    assert torch.equal(low_bits(x, r), want)
    with arithmetic_bits():
        assert torch.equal(low_bits(x, r), want)


def test_arithmetic_bits_restores_the_bitwise_form():
    """Nested and on an exception, leaving the context restores what was before."""
    assert not bitmask._ARITHMETIC
    with pytest.raises(RuntimeError), arithmetic_bits():
        with arithmetic_bits():
            assert bitmask._ARITHMETIC
        assert bitmask._ARITHMETIC
        raise RuntimeError
    assert not bitmask._ARITHMETIC
