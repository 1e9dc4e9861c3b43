"""The native mean kernel (csrc/core through csrc/bindings) against numpy."""

import functools

import numpy as np
import pytest

from dsgd.native import _core
from dsgd.comm.means import mean_shard
from dsgd.comm.param_server import ParameterServer
from dsgd.comm.sharding import plan_shards
from helpers import pack

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


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("num_inputs", [1, 2, 3])
@pytest.mark.parametrize("max_threads", [1, 0])
def test_large_sums_streamed_to_unaligned_out_are_bit_exact(dtype, num_inputs, max_threads):
    # Above 1 MiB per thread the kernel streams its result (non-temporal stores
    # from the first 16-byte-aligned element on): one element off alignment
    # exercises the scalar head and tail around the vector loop.
    size = 3 * 2**20 // np.dtype(dtype).itemsize + 7
    rng = np.random.default_rng(num_inputs)
    inputs = [rng.normal(size=size).astype(dtype) for _ in range(num_inputs)]
    backing = np.full(size + 1, np.nan, dtype)
    out = backing[1:]
    assert out.ctypes.data % 16 != 0
    _core.sum_scaled(inputs, out, 1.0 / num_inputs, max_threads)
    expected = functools.reduce(np.add, inputs) * dtype(1.0 / num_inputs)
    np.testing.assert_array_equal(out, expected)
    assert np.isnan(backing[0])  # nothing written before `out`


def test_mean_shard_averages_pieces_into_the_shard_layout():
    shapes = [(40,), (3,), (7,)]
    plan = plan_shards(shapes, ["float32"] * 3, 10_000_000)
    shard = plan.shards[0]
    rng = np.random.default_rng(0)
    per_worker = [[rng.normal(size=s[0]).astype(np.float32) for s in shapes] for _ in range(3)]
    pieces = [tuple(flat[p.var_index] for p in shard.pieces) for flat in per_worker]
    out = np.full(shard.num_elements, np.nan, np.float32)  # padding must be overwritten with 0
    mean_shard(shard, pieces, out=out)
    expected = pack(plan, [functools.reduce(np.add, [w[v] for w in per_worker]) * np.float32(1 / 3)
                          for v in range(3)])[0]
    np.testing.assert_array_equal(out, expected)


def test_ps_means_a_group_of_shards_in_its_scratch_buffers():
    shapes = [(300,), (5,), (200,), (7, 3)]
    plan = plan_shards(shapes, ["float32"] * 4, 1024)  # 4 shards, the 300-vector split
    assert plan.num_shards >= 3
    group = (0, 2)
    shards = tuple(plan.shards[j] for j in group)
    rng = np.random.default_rng(1)
    flats = [[rng.normal(size=int(np.prod(s))).astype(np.float32) for s in shapes] for _ in range(2)]
    # What a worker sends for the group: the pieces of shard 0, then those of shard 2.
    sent = [tuple(flat[p.var_index][p.var_offset:p.var_offset + p.length]
                  for s in shards for p in s.pieces) for flat in flats]
    ps = ParameterServer(0)
    means = ps._means(shards, sent)
    expected = pack(plan, [(a + b) * np.float32(0.5) for a, b in zip(*flats, strict=True)])
    assert len(means) == 2
    for mean, j in zip(means, group, strict=True):
        np.testing.assert_array_equal(mean, expected[j])
    again = ps._means(shards, sent)  # scratch reused, one buffer per shard of the group
    assert again[0] is means[0] and again[1] is means[1] and again[0] is not again[1]
    with pytest.raises(ValueError, match="worker 1 sent 1 pieces for a group of 2 shards"):
        ps._means(shards, (sent[0], sent[1][:1]))


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
    shard = plan_shards([(4,)], ["float32"], 64).shards[0]
    with pytest.raises(ValueError, match=r"piece 0 of the shard \(variable 0\): .*inputs\[1\] has 3 elements"):
        mean_shard(shard, [(a,), (np.ones(3, np.float32),)])


@pytest.mark.parametrize("sizes", [[1], [3, 0, 5], [1000, 7, 64], [_core.MIN_BYTES_PER_THREAD, 12345, 3]])
@pytest.mark.parametrize("max_threads", [1, 0])
def test_fuse_and_split_round_trip(sizes, max_threads):
    rng = np.random.default_rng(len(sizes))
    parts = [rng.integers(0, 255, size=n, dtype=np.uint8) for n in sizes]
    fused = np.empty(sum(sizes), np.uint8)
    _core.fuse(parts, fused, max_threads)
    np.testing.assert_array_equal(fused, np.concatenate(parts))
    back = [np.empty_like(p) for p in parts]
    _core.split(fused, back, max_threads)
    for a, b in zip(parts, back, strict=True):
        np.testing.assert_array_equal(a, b)


def test_fuse_mixed_dtypes_is_byte_exact():
    parts = [np.arange(5, dtype=np.float32), np.arange(3, dtype=np.float64)]
    out = np.empty(5 * 4 + 3 * 8, np.uint8)
    _core.fuse(parts, out)
    assert out.tobytes() == parts[0].tobytes() + parts[1].tobytes()


def special_floats():
    rng = np.random.default_rng(0)
    wide = rng.normal(size=20000).astype(np.float32) * np.float32(2.0) ** rng.integers(-30, 20, 20000).astype(np.float32)
    edges = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65519.99, 65520, 1e-8, 5.96e-8,
                      2.98e-8, 2.99e-8, 6.1e-5, 6.103515625e-05, -6.1e-5, 1.0, 1.0009765625,
                      1.00048828125, 1.00146484375, 3.4e38], np.float32)
    return np.concatenate([wide, edges])


def test_fp16_casts_match_numpy_bit_for_bit():
    x = special_floats()
    half = np.empty(x.shape, np.float16)
    _core.cast_f32_to_f16(x, half)
    with np.errstate(over="ignore"):  # numpy warns on its own overflow to inf
        expected = x.astype(np.float16)
    np.testing.assert_array_equal(half.view(np.uint16), expected.view(np.uint16))
    every_half = np.arange(2**16, dtype=np.uint16)
    back = np.empty(every_half.shape, np.float32)
    _core.cast_f16_to_f32(every_half, back)
    want = every_half.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(back.view(np.uint32)[~nan], want.view(np.uint32)[~nan])
    # NaN stays NaN of the same sign; with F16C the hardware quiets signalling NaNs
    # (sets the top mantissa bit) where numpy keeps their payload bit for bit.
    assert np.isnan(back[nan]).all()
    np.testing.assert_array_equal(np.signbit(back[nan]), np.signbit(want[nan]))


def test_copy_and_cast_errors():
    with pytest.raises(ValueError, match="inputs hold 8 bytes but `out` has 4"):
        _core.fuse([np.ones(2, np.float32)], np.empty(1, np.float32))
    with pytest.raises(ValueError, match="`inputs` is empty"):
        _core.fuse([], np.empty(1, np.float32))
    with pytest.raises(ValueError, match="outs hold 4 bytes but `input` has 8"):
        _core.split(np.ones(2, np.float32), [np.empty(1, np.float32)])
    with pytest.raises(ValueError, match="expected 4-byte input"):
        _core.cast_f32_to_f16(np.ones(2, np.float64), np.empty(2, np.float16))


FINITE_FORMATS = {"float16": "f16", "float32": "f32", "float64": "f64"}


@pytest.mark.parametrize("dtype", sorted(FINITE_FORMATS))
@pytest.mark.parametrize("size", [1, 7, 16_384, 16_385, 100_003])
@pytest.mark.parametrize("bad", [None, np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_all_finite_matches_numpy(dtype, size, bad, where):
    rng = np.random.default_rng(size)
    x = rng.normal(size=size).astype(dtype)
    info = np.finfo(dtype)  # extremes and subnormals are finite
    x[rng.integers(0, size, size=min(size, 3))] = [info.max, -info.max, info.smallest_subnormal][:min(size, 3)]
    if bad is not None:
        x[{"first": 0, "middle": size // 2, "last": size - 1}[where]] = bad
    x.flags.writeable = False
    assert _core.all_finite(x, FINITE_FORMATS[dtype]) == bool(np.isfinite(x).all())


def test_all_finite_bfloat16_bits():
    # bfloat16 is the high half of a float32: exponent mask 0x7f80.
    f32 = np.array([1.0, -2.5, 3e38, 1e-40], np.float32)
    bits = (f32.view(np.uint32) >> 16).astype(np.uint16)
    assert _core.all_finite(bits, "bf16")
    for bad in (np.inf, -np.inf, np.nan):
        assert not _core.all_finite(np.append(bits, np.uint16(np.float32(bad).view(np.uint32) >> 16)), "bf16")


def test_all_finite_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="format must be one of f16, bf16, f32, f64; got f8"):
        _core.all_finite(np.zeros(3, np.float32), "f8")
    with pytest.raises(ValueError, match="format f64 needs 8-byte elements, `input` has 4"):
        _core.all_finite(np.zeros(3, np.float32), "f64")
    with pytest.raises(ValueError, match="not C-contiguous"):
        _core.all_finite(np.zeros(6, np.float32)[::2], "f32")
