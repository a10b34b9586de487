"""``kvqbench.numerics.rtn.broadcast_shape`` (plain Python, so the dequantize paths never call
``torch.broadcast_shapes``, which imports sympy on first use) against torch's own function."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvqbench.numerics.rtn import broadcast_shape


@given(st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=4), min_size=1, max_size=4))
def test_broadcast_shape_agrees_with_torch(shapes):
    try:
        expected = tuple(torch.broadcast_shapes(*map(tuple, shapes)))
    except RuntimeError:
        expected = None
    if expected is None:  # torch refuses: so must we
        with pytest.raises(ValueError):
            broadcast_shape(*shapes)
    else:
        assert broadcast_shape(*(torch.Size(s) for s in shapes)) == expected
