"""The TensorFlow op library (csrc/tf_ops via dsgd/native/ops.py): exact round trips,
zero-copy reads proven by address, copies where memory is misaligned, clean errors."""

import math

import numpy as np
import pytest
import tensorflow as tf

from dsgd.native import dlpack, ops
from dsgd.comm.sharding import plan_shards
from helpers import pack

SHAPE_SETS = [
    [(5, 7), (7,), (7, 3), (3,)],
    [(1,), (64,), (3, 4, 5), (1000,)],
    [(2, 2, 2, 2), (17,)],
]
DTYPES = ["float16", "bfloat16", "float32", "float64"]


def random_flat(shapes, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=math.prod(s)).astype(np.float32).astype(dtype) for s in shapes]


def read(shards, plan):
    addresses = tf.constant([dlpack.buffer_address(a) for a in shards], tf.int64)
    sizes = tf.constant([a.nbytes for a in shards], tf.int64)
    return ops.read_shards(addresses, sizes, plan)


def aligned_empty(n, dtype, misalign_bytes=0):
    """An array whose data starts at 64-byte alignment plus `misalign_bytes`."""
    itemsize = np.dtype(dtype).itemsize
    raw = np.empty(n * itemsize + 128 + misalign_bytes, np.uint8)
    start = (-raw.__array_interface__["data"][0]) % 64 + misalign_bytes
    return raw[start:start + n * itemsize].view(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shapes", SHAPE_SETS, ids=["tiny", "mixed", "small"])
@pytest.mark.parametrize("shard_bytes", [64, 256, 4096, 10_000_000])
def test_round_trip_is_bit_exact(dtype, shapes, shard_bytes):
    plan = plan_shards(shapes, [dtype] * len(shapes), shard_bytes)
    flat = random_flat(shapes, dtype)
    shards = pack(plan, flat)  # must outlive the outputs: they may alias it
    outputs = read(shards, plan)
    for out, want, shape in zip(outputs, flat, shapes, strict=True):
        assert tuple(out.shape) == shape and out.dtype == tf.as_dtype(dtype)
        np.testing.assert_array_equal(out.numpy().reshape(-1).view(np.uint8), want.view(np.uint8))


def test_tensor_split_across_shards_and_mixed_dtypes():
    shapes, dtypes = [(300,), (5,), (40,)], ["float32", "float64", "float32"]
    plan = plan_shards(shapes, dtypes, 256)
    assert len(plan.pieces_of(0)) > 1  # split
    flat = [random_flat([s], d, seed=i)[0] for i, (s, d) in enumerate(zip(shapes, dtypes, strict=True))]
    shards = pack(plan, flat)
    for out, want in zip(read(shards, plan), flat, strict=True):
        np.testing.assert_array_equal(out.numpy().reshape(-1), want)


def test_read_inside_tf_function():
    shapes = [(6, 5), (5,)]
    plan = plan_shards(shapes, ["float32"] * 2, 10_000_000)
    flat = random_flat(shapes, "float32")
    shards = pack(plan, flat)

    @tf.function
    def double(addresses, sizes):
        return [2 * t for t in ops.read_shards(addresses, sizes, plan)]

    outs = double(tf.constant([dlpack.buffer_address(a) for a in shards], tf.int64),
                  tf.constant([a.nbytes for a in shards], tf.int64))
    for out, want in zip(outs, flat, strict=True):
        np.testing.assert_array_equal(out.numpy().reshape(-1), 2 * want)


def whole_variable_plan():
    shapes = [(16, 4), (1000,)]
    return shapes, plan_shards(shapes, ["float32"] * 2, 10_000_000)


def test_aligned_whole_variable_is_read_in_place():
    shapes, plan = whole_variable_plan()
    flat = random_flat(shapes, "float32")
    shard = aligned_empty(plan.shards[0].num_elements, np.float32)
    shard[:] = pack(plan, flat)[0]
    shard.flags.writeable = False
    outputs = read([shard], plan)
    base = dlpack.buffer_address(shard)
    for v, out in enumerate(outputs):
        (_, piece), = plan.pieces_of(v)
        assert dlpack.buffer_address(dlpack.tensor_view(out)) == base + 4 * piece.shard_offset
        np.testing.assert_array_equal(out.numpy().reshape(-1), flat[v])


def test_misaligned_memory_is_copied_not_wrapped():
    shapes, plan = whole_variable_plan()
    flat = random_flat(shapes, "float32")
    shard = aligned_empty(plan.shards[0].num_elements, np.float32, misalign_bytes=4)
    shard[:] = pack(plan, flat)[0]
    assert dlpack.buffer_address(shard) % 64 == 4
    outputs = read([shard], plan)
    base, end = dlpack.buffer_address(shard), dlpack.buffer_address(shard) + shard.nbytes
    for out, want in zip(outputs, flat, strict=True):
        address = dlpack.buffer_address(dlpack.tensor_view(out))
        assert not base <= address < end
        np.testing.assert_array_equal(out.numpy().reshape(-1), want)


@pytest.mark.cluster
@pytest.mark.usefixtures("ray_local")
def test_object_store_buffer_is_read_in_place():
    import ray

    shapes, plan = whole_variable_plan()
    flat = random_flat(shapes, "float32")
    stored = ray.get(ray.put(pack(plan, flat)[0]))  # a read-only view of shared memory
    assert not stored.flags.writeable and dlpack.buffer_address(stored) % 64 == 0
    outputs = read([stored], plan)
    (_, piece), = plan.pieces_of(1)
    assert dlpack.buffer_address(dlpack.tensor_view(outputs[1])) == dlpack.buffer_address(stored) + 4 * piece.shard_offset
    np.testing.assert_array_equal(outputs[1].numpy(), flat[1])


def test_tensor_view_shares_the_tensors_memory():
    t = tf.random.normal([1000])
    a, b = dlpack.tensor_view(t), dlpack.tensor_view(t)
    assert dlpack.buffer_address(a) == dlpack.buffer_address(b)
    np.testing.assert_array_equal(a, t.numpy())


def test_bad_input_is_a_python_error():
    shapes, plan = whole_variable_plan()
    shards = pack(plan, random_flat(shapes, "float32"))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"shard 0 holds \d+ bytes but the plan expects"):
        read([shards[0].astype(np.float64)], plan)  # wrong dtype
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"shard 0 holds \d+ bytes"):
        read([shards[0][:-1]], plan)  # wrong total size
    with pytest.raises(tf.errors.InvalidArgumentError, match="expected 1 addresses and byte sizes, got 0"):
        ops.library().dsgd_read_shards(
            addresses=tf.zeros([0], tf.int64), byte_sizes=tf.zeros([0], tf.int64), T=tf.float32, wire=tf.float32,
            num_outputs=1, shapes=[[4]], shard_elements=[4], pieces=[0, 0, 4, 0, 0])
    with pytest.raises(tf.errors.InvalidArgumentError, match="has address 0"):
        ops.library().dsgd_read_shards(
            addresses=tf.zeros([1], tf.int64), byte_sizes=tf.constant([16], tf.int64), T=tf.float32, wire=tf.float32,
            num_outputs=1, shapes=[[4]], shard_elements=[4], pieces=[0, 0, 4, 0, 0])
    with pytest.raises(tf.errors.InvalidArgumentError, match="has 4 elements but its pieces cover 3"):
        ops.library().dsgd_read_shards(
            addresses=tf.constant([dlpack.buffer_address(shards[0])], tf.int64),
            byte_sizes=tf.constant([16], tf.int64), T=tf.float32, wire=tf.float32,
            num_outputs=1, shapes=[[4]], shard_elements=[4], pieces=[0, 0, 3, 0, 0])


def test_tensorflow_version_mismatch_names_both_versions():
    with pytest.raises(ImportError, match=r"built against TensorFlow 2\.20\.0, but TensorFlow 2\.21\.0 is installed"):
        ops.check_versions("2.20.0", "2.21.0")
    assert ops.built_tf_version() == tf.__version__
    ops.check_installed_tf()  # this installation is consistent


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_finite_op_matches_is_finite(dtype):
    rng = np.random.default_rng(1)
    good = [tf.constant(rng.normal(size=s).astype(np.float32), dtype) for s in [(3, 5), (70_000,), (1,)]]
    assert bool(ops.all_finite(good))
    for bad in (np.nan, np.inf, -np.inf):
        for k in range(len(good)):
            tensors = list(good)
            flat = tensors[k].numpy().reshape(-1).astype(np.float32)
            flat[-1] = bad
            tensors[k] = tf.constant(flat.reshape(tensors[k].shape), dtype)
            assert not bool(ops.all_finite(tensors))
            assert not bool(tf.function(ops.all_finite)(tensors))  # inside a compiled step
    mixed = [good[0], tf.constant([1.0, np.nan], tf.float64 if dtype != "float64" else tf.float16)]
    assert not bool(ops.all_finite(mixed))


def test_all_finite_op_bad_input():
    with pytest.raises(ValueError, match="`tensors` is empty"):
        ops.all_finite([])
    with pytest.raises((TypeError, tf.errors.InvalidArgumentError), match="int32"):
        ops.all_finite([tf.constant([1, 2])])
