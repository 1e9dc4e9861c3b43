"""The native mean kernel (csrc/core through csrc/bindings) against numpy."""

import functools

import numpy as np
import pytest

from dsgd import _core
from dsgd.param_server import mean_of

SIZES = [1, 17, 1000, _core.MIN_ELEMENTS_PER_THREAD * 2 + 5]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("num_inputs", [1, 2, 3, 5])
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("max_threads", [1, 2, 0])
def test_sum_scaled_is_bit_exact(dtype, num_inputs, size, max_threads):
    rng = np.random.default_rng(size * 10 + num_inputs)
    inputs = [rng.normal(size=size).astype(dtype) for _ in range(num_inputs)]
    for a in inputs:
        a.flags.writeable = False  # like object-store views
    scale = 1.0 / num_inputs
    out = np.empty(size, dtype)
    _core.sum_scaled(inputs, out, scale, max_threads)
    expected = functools.reduce(np.add, inputs) * dtype(scale)
    np.testing.assert_array_equal(out, expected)


def test_mean_of_matches_numpy_mean():
    rng = np.random.default_rng(0)
    shards = [rng.normal(size=1000).astype(np.float32) for _ in range(3)]
    np.testing.assert_allclose(mean_of(shards), np.mean(shards, axis=0), rtol=1e-6, atol=1e-7)


def test_bad_input_is_a_python_error():
    a = np.ones(4, np.float32)
    with pytest.raises(ValueError, match="`inputs` is empty"):
        _core.sum_scaled([], a, 1.0)
    with pytest.raises(TypeError, match="has dtype float64 but `out` has dtype float32"):
        _core.sum_scaled([np.ones(4)], a, 1.0)
    with pytest.raises(ValueError, match="has 5 elements but `out` has 4"):
        _core.sum_scaled([np.ones(5, np.float32)], a, 1.0)
    with pytest.raises(ValueError, match="not C-contiguous"):
        _core.sum_scaled([np.ones(8, np.float32)[::2]], a, 1.0)
    readonly = np.ones(4, np.float32)
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        _core.sum_scaled([a], readonly, 1.0)
    with pytest.raises(TypeError, match="not supported"):
        _core.sum_scaled([np.ones(4, np.int32)], np.ones(4, np.int32), 1.0)
    with pytest.raises(ValueError, match="shard from worker 1 is float32"):
        mean_of([a, np.ones(3, np.float32)])
