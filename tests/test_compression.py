"""Gradient compression (compression="fp16" | "bf16"): the PS kernel and the
read op against a numpy/ml_dtypes reference of the same rounding, bit for bit;
a real 2-worker exchange whose mean gradient is exactly that reference; an fp16
overflow reported as a non-finite gradient; and training that still converges."""

import math

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import dsgd
import tiny
from helpers import assert_replicas_identical
from dsgd.native import _core, dlpack, ops
from dsgd.errors import NonFiniteError
from dsgd.comm.sharding import plan_shards
from helpers import pack

WIRE = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16}
FORMAT = {"fp16": "f16", "bf16": "bf16"}


def reference_mean(per_worker: list[np.ndarray], compression: str) -> np.ndarray:
    """What the exchange computes: each worker's float32 gradient rounded to 16 bits,
    widened and summed left to right in float32, scaled once, rounded to 16 bits,
    widened again by the reader."""
    wire = WIRE[compression]
    total = per_worker[0].astype(wire).astype(np.float32)
    for g in per_worker[1:]:
        total = total + g.astype(wire).astype(np.float32)
    return (total * np.float32(1 / len(per_worker))).astype(wire).astype(np.float32)


def wide_range(n: int, seed: int) -> np.ndarray:
    """Magnitudes from 1e-9 (fp16 subnormals, flushes) to 1e4, both signs."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * 10.0 ** rng.uniform(-9, 4, n)).astype(np.float32)


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
@pytest.mark.parametrize("num_inputs", [1, 2, 3])
@pytest.mark.parametrize("n", [7, 4099, 2_000_003])  # inline, blocked, several threads
def test_ps_kernel_matches_numpy_bit_for_bit(compression, num_inputs, n):
    wire = WIRE[compression]
    inputs = [wide_range(n, seed).astype(wire).view(np.uint16) for seed in range(num_inputs)]
    if n > 3:
        inputs[0][:3] = np.array([np.inf, -np.inf, np.nan], np.float32).astype(wire).view(np.uint16)
    out = np.empty(n, np.uint16)
    _core.sum_scaled_16(inputs, out, 1 / num_inputs, FORMAT[compression])
    total = inputs[0].view(wire).astype(np.float32)
    for a in inputs[1:]:
        total = total + a.view(wire).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        want = (total * np.float32(1 / num_inputs)).astype(wire)
    got = out.view(wire).astype(np.float32)
    nan = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(out[~nan], want.view(np.uint16)[~nan])


def test_bf16_casts_round_to_nearest_even_like_ml_dtypes():
    x = wide_range(100_000, 1)
    x[:4] = [np.inf, -np.inf, 3.3961776e38, 1.0 + 2.0 ** -8]  # overflow to inf; a tie to even
    bits = np.empty(x.size, np.uint16)
    _core.cast_f32_to_bf16(x, bits)
    np.testing.assert_array_equal(bits, x.astype(ml_dtypes.bfloat16).view(np.uint16))
    back = np.empty(x.size, np.float32)
    _core.cast_bf16_to_f32(bits, back)
    np.testing.assert_array_equal(back, bits.view(ml_dtypes.bfloat16).astype(np.float32))


def test_kernel_errors_name_the_argument():
    a = np.zeros(4, np.uint16)
    with pytest.raises(ValueError, match="format must be f16 or bf16; got f8"):
        _core.sum_scaled_16([a], np.zeros(4, np.uint16), 1.0, "f8")
    with pytest.raises(TypeError, match=r"inputs\[0\] has 4-byte elements"):
        _core.sum_scaled_16([np.zeros(4, np.float32)], np.zeros(4, np.uint16), 1.0, "f16")
    with pytest.raises(ValueError, match="`out` is read-only"):
        out = np.zeros(4, np.uint16)
        out.flags.writeable = False
        _core.sum_scaled_16([a], out, 1.0, "bf16")


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_plan_halves_float32_shards_only(compression):
    shapes, dtypes = [(300,), (5,), (40, 3)], ["float32", "float64", "float32"]
    plain = plan_shards(shapes, dtypes, 256)
    packed = plan_shards(shapes, dtypes, 256, compression=compression)
    assert packed.dtypes == plain.dtypes  # the variables' own
    wire = dsgd.constants.COMPRESSIONS[compression]
    # Variables are packed last first; a 256-byte shard holds 64 float32, 32 float64 or
    # 128 16-bit elements, and a variable that fits one shard is never split.
    # float32: the 120 elements of variable 2 as 64 + 56, variable 0 as 4 x 64 + 44.
    assert [(s.dtype, s.num_elements) for s in plain.shards] == (
        [("float32", 64), ("float32", 56), ("float64", 5)] + [("float32", 64)] * 4
        + [("float32", 44)])
    # 16 bits: variable 2 whole, variable 0 as 128 + 128 + 44; float64 as it was.
    assert [(s.dtype, s.num_elements) for s in packed.shards] == [
        (wire, 120), ("float64", 5), (wire, 128), (wire, 128), (wire, 44)]
    # One variable per shard, so no alignment padding: exactly half the float32 bytes.
    assert sum(s.nbytes for s in packed.shards if s.dtype == wire) == 2 * 420 == \
        sum(s.nbytes for s in plain.shards if s.dtype == "float32") // 2
    assert [s.nbytes for s in packed.shards if s.dtype == "float64"] == [40]
    # Two variables in one shard: the second starts on a 64-byte boundary, which is 16
    # float32 or 32 16-bit elements: 64 + 3 x 4 bytes, 64 + 3 x 2 (not half).
    two = [(3,), (5,)], ["float32"] * 2
    assert [s.nbytes for s in plan_shards(*two, 256).shards] == [64 + 3 * 4]
    assert [s.nbytes for s in plan_shards(*two, 256, compression=compression).shards] == [64 + 3 * 2]
    with pytest.raises(ValueError, match=r"compression must be None or one of \['fp16', 'bf16'\]"):
        plan_shards(shapes, dtypes, 256, compression="int8")


def test_wire_dtypes_per_variable():
    plan = plan_shards([(3,), (0,), (2,), (4,)], ["float32", "float32", "float64", "float16"], 64,
                       compression="bf16")
    # A variable without elements has no shard: it keeps its own dtype.
    assert plan.wire_dtypes == ("bfloat16", "float32", "float64", "float16")


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_pack_and_unpack_are_the_wire_format(compression):
    shapes, dtypes = [(300,), (5,), (7, 3)], ["float32", "float64", "float32"]
    plan = plan_shards(shapes, dtypes, 256, compression=compression)
    flat = [wide_range(math.prod(s), k).astype(d) for k, (s, d) in enumerate(zip(shapes, dtypes, strict=True))]
    packed = pack(plan, flat)
    assert [a.dtype for a in packed] == [s.wire_numpy_dtype for s in plan.shards]
    for got, want, shape, dtype in zip(plan.unpack(packed), flat, shapes, dtypes, strict=True):
        assert got.shape == shape and got.dtype == np.dtype(dtype)
        if dtype == "float32":
            want = want.astype(WIRE[compression]).astype(np.float32)
        np.testing.assert_array_equal(got.reshape(-1), want)


def test_bfloat16_variables_through_the_ps_come_back_as_bfloat16():
    # The Ray Train exchange's path (dsgd/train): ml_dtypes arrays in, mean_shard, unpack.
    from dsgd.comm.means import mean_shard, split_group

    bf = ml_dtypes.bfloat16
    shapes = [(70,), (3, 2)]
    plan = plan_shards(shapes, ["bfloat16"] * 2, 64)
    workers = [[wide_range(math.prod(s), 10 * w + k).astype(bf) for k, s in enumerate(shapes)]
               for w in range(2)]
    means = []
    for shard in plan.shards:
        per_worker = [tuple(flat[p.var_index][p.var_offset:p.var_offset + p.length]
                            for p in shard.pieces) for flat in workers]
        means.append(mean_shard(shard, split_group((shard,), per_worker)[0]))
    for k, got in enumerate(plan.unpack(means)):
        want = ((workers[0][k].astype(np.float32) + workers[1][k].astype(np.float32))
                * np.float32(0.5)).astype(bf)
        assert got.dtype == bf and got.shape == shapes[k]
        np.testing.assert_array_equal(got.reshape(-1).view(np.uint16), want.reshape(-1).view(np.uint16))


def test_read_op_widens_large_shards_on_several_threads():
    n = 600_000  # 2.4 MB of float32 output: WidenToF32 splits it over threads
    plan = plan_shards([(n,)], ["float32"], 10_000_000, compression="fp16")
    values = wide_range(n, 3)
    shards = pack(plan, [values])
    addresses = tf.constant([dlpack.buffer_address(a) for a in shards], tf.int64)
    sizes = tf.constant([a.nbytes for a in shards], tf.int64)
    out = ops.read_shards(addresses, sizes, plan)[0]
    np.testing.assert_array_equal(out.numpy(), values.astype(np.float16).astype(np.float32))


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_read_op_widens_16_bit_shards_to_float32(compression):
    shapes, dtypes = [(300,), (5,), (0,), (7, 3)], ["float32", "float64", "float32", "float32"]
    plan = plan_shards(shapes, dtypes, 256, compression=compression)
    flat = [wide_range(math.prod(s), k).astype(d) for k, (s, d) in enumerate(zip(shapes, dtypes, strict=True))]
    shards = []
    for shard in plan.shards:
        out = np.zeros(shard.num_elements, shard.wire_numpy_dtype)
        for p in shard.pieces:
            piece = flat[p.var_index][p.var_offset:p.var_offset + p.length]
            if shard.dtype != dtypes[p.var_index]:
                piece = piece.astype(WIRE[compression]).view(np.uint16).view(out.dtype)
            out[p.shard_offset:p.shard_offset + p.length] = piece
        shards.append(out)
    addresses = tf.constant([dlpack.buffer_address(a) for a in shards], tf.int64)
    sizes = tf.constant([a.nbytes for a in shards], tf.int64)
    for out, want, shape, dtype in zip(ops.read_shards(addresses, sizes, plan), flat, shapes, dtypes, strict=True):
        assert tuple(out.shape) == shape and out.dtype == tf.as_dtype(dtype)
        if dtype == "float32":
            want = want.astype(WIRE[compression]).astype(np.float32)
        np.testing.assert_array_equal(out.numpy().reshape(-1), want)


# -- on a real cluster --------------------------------------------------------------------------

N = 300  # elements of the probe's first variable; split over several shards and PS


class Probe(dsgd.Model):
    """loss = sum(w * c): the gradient is exactly c, a wide-range vector that is a
    pure function of (worker, step); SGD with learning rate 1 subtracts it exactly."""

    def __init__(self, worker_index, scale=1.0, fill=None):
        import keras

        self.worker, self.step, self.scale, self.fill = worker_index, 0, scale, fill
        self.w = keras.Variable(np.zeros(N, np.float32), name="w")
        self.b = keras.Variable(np.zeros((4, 3), np.float32), name="b")
        self.optimizer = keras.optimizers.SGD(learning_rate=1.0)

    def get_variables(self):
        return [self.w, self.b]

    def get_loss(self, batch):
        return tf.reduce_sum(self.w * batch[0]) + tf.reduce_sum(self.b * batch[1])

    def get_optimizer(self):
        return self.optimizer

    def reset(self, scale=1.0, fill=None):
        """Back to step 0 with zero weights and another gradient scale or fill."""
        self.step, self.scale, self.fill = 0, scale, fill
        self.w.assign(np.zeros(N, np.float32))
        self.b.assign(np.zeros((4, 3), np.float32))

    def get_batch(self):
        if self.fill is not None:
            return np.full(N, self.fill, np.float32), np.full((4, 3), self.fill, np.float32)
        batch = probe_gradients(self.worker, self.step, self.scale)
        self.step += 1
        return batch


def probe_gradients(worker: int, step: int, scale: float = 1.0):
    return (wide_range(N, 100 * step + worker) * np.float32(scale),
            wide_range(12, 100 * step + worker + 50).reshape(4, 3) * np.float32(scale))


@pytest.fixture(scope="module")
def probe(request, ray_local):
    """One Probe instance per compression (`request.param`) for the module: 2 workers,
    256-byte shards over 2 PS, on_nonfinite="skip". Tests parametrize it
    indirectly, so pytest runs each compression's tests together and holds one
    instance (2 of the cluster's 4 CPUs) at a time."""
    with dsgd.DistributedSGD(lambda w, d: Probe(w), num_workers=2, devices_per_worker=1,
                             gpu=False, grad_shard_bytes=256, num_ps=2,
                             compression=request.param, on_nonfinite="skip") as sgd:
        yield sgd


def reset(sgd, scale=1.0, fill=None):
    """The shared probe back to step 0 and zero weights, with another gradient scale
    or fill. Plain SGD holds no state but its iteration count, which no test reads."""
    sgd.foreach_model(lambda m: m.reset(scale, fill))
    return sgd


@pytest.mark.cluster
@pytest.mark.parametrize("probe", ["fp16", "bf16"], indirect=True)
def test_the_exchange_applies_exactly_the_rounded_mean(probe):
    sgd, compression = reset(probe), probe.config.compression
    assert len(sgd.plan.shards) > 2 and len(sgd.ps_actors) == 2
    expected = [np.zeros(N, np.float32), np.zeros((4, 3), np.float32)]
    for step in range(2):
        sgd.step()
        grads = [probe_gradients(w, step) for w in range(2)]
        for k in range(2):
            mean = reference_mean([g[k].reshape(-1) for g in grads], compression)
            plain = (grads[0][k].reshape(-1) + grads[1][k].reshape(-1)) * np.float32(0.5)
            assert not np.array_equal(mean, plain)  # the rounding shows: the test can tell
            expected[k] = expected[k] - mean.reshape(expected[k].shape)
    for weights in sgd.foreach_model(lambda m: [m.w.numpy(), m.b.numpy()]):
        for got, want in zip(weights, expected, strict=True):
            np.testing.assert_array_equal(got, want)


@pytest.mark.cluster
@pytest.mark.parametrize("probe", ["fp16"], indirect=True)
def test_an_fp16_overflow_is_a_nonfinite_gradient(probe):
    # 1e6 overflows float16 (max 65504) but is finite in float32 and bfloat16.
    sgd = reset(probe, scale=1e6)
    skipped = sgd.skipped_steps
    stats = sgd.step(fetch_stats=True)
    assert stats["skipped"] and sgd.skipped_steps == skipped + 1
    assert all(np.all(m == 0) for m in sgd.foreach_model(lambda m: m.w.numpy()))


@pytest.mark.cluster
@pytest.mark.parametrize("probe", ["bf16"], indirect=True)
def test_a_bf16_overflow_is_a_nonfinite_gradient(probe):
    # 3.4e38 is a finite float32 that rounds up to bfloat16's Inf.
    assert np.isfinite(np.float32(3.4e38))
    assert np.isinf(np.float32(3.4e38).astype(ml_dtypes.bfloat16).astype(np.float32))
    sgd = reset(probe, fill=3.4e38)
    assert sgd.step(fetch_stats=True)["skipped"]
    assert all(np.all(m == 0) for m in sgd.foreach_model(lambda m: m.w.numpy()))


# -- training a model with compression -----------------------------------------------------

BATCH, LR, MOMENTUM = 16, 0.1, 0.9  # tiny.make_optimizer("sgdm")
U = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}  # unit round-off of the 16-bit type
# A rounding's absolute error below the type's normal range: half the subnormal spacing.
SUBNORMAL = {"fp16": 2.0 ** -25, "bf16": 2.0 ** -134}
EPS32 = 2.0 ** -24  # float32's unit round-off


class Scaled(tiny.TinyModel):
    """tiny's model (SGD with momentum, batches of BATCH) whose targets are
    multiplied by `scale` (1: tiny's own)."""

    def __init__(self, worker_index, device_index):
        super().__init__(worker_index, device_index, 1, BATCH)
        self.scale = 1.0

    def get_batch(self):
        x, y = super().get_batch()
        return x, y * np.float32(self.scale)


@pytest.fixture(scope="class")
def trained(request, ray_local):
    """2 workers of Scaled with compression `request.param`, on_nonfinite="raise"."""
    with dsgd.DistributedSGD(Scaled, num_workers=2, devices_per_worker=1, gpu=False,
                             compression=request.param) as sgd:
        yield sgd


def worker_gradients(weights, batch_index: int) -> list[list[np.ndarray]]:
    """Each worker's float32 gradient of its mean loss at `weights`, in-process."""
    model = tiny.make_keras_model()
    model.set_weights(weights)
    grads = []
    for w in range(2):
        x, y = tiny.make_batch(w, batch_index, BATCH)
        with tf.GradientTape() as tape:
            loss = tiny.mse(model, x, y)
        grads.append([g.numpy() for g in tape.gradient(loss, model.trainable_variables)])
    return grads


@pytest.mark.cluster
class TestTraining:
    STEPS = 30

    @pytest.mark.parametrize("trained", ["fp16", pytest.param("bf16", marks=pytest.mark.slow)],
                             indirect=True)
    def test_every_step_applies_the_mean_gradient_to_16_bit_rounding_and_converges(self,
                                                                                   trained):
        """Step by step, the mean gradient the workers applied (recovered from the
        weights and momenta before and after) is the mean of the two workers'
        float32 gradients (computed in-process at the weights before) to within
        the exchange's roundings: each worker's gradient to 16 bits (relative error
        at most u, halved by the mean), the float32 sum, the mean to 16 bits (u),
        and the float32 round-off of recovering it. Per element, with s the mean of
        the two gradients' magnitudes:
        |applied - mean| <= (2u + u^2 + 10 eps32) s + 3 subnormal + 4 eps32 (m|v| + |v'|) / lr."""
        sgd, compression = trained, trained.config.compression
        assert {s.dtype for s in sgd.plan.shards} == {dsgd.constants.COMPRESSIONS[compression]}
        u, m, lr = U[compression], np.float64(np.float32(MOMENTUM)), np.float64(np.float32(LR))
        first = sgd.for_model(lambda model: model.steps)  # the replicas' next batch

        def state():
            return sgd.for_model(lambda model: (model.get_weights(), [
                np.array(v.numpy()) for v in model.optimizer.momentums]))

        weights, momenta = state()
        losses, largest = [], 0.0
        for t in range(self.STEPS):
            grads = worker_gradients(weights, first + t)
            losses.append(sgd.step(fetch_stats=True)["loss"])
            after, momenta_after = state()
            for k, (g0, g1) in enumerate(zip(*grads, strict=True)):
                v, v_after = momenta[k].astype(np.float64), momenta_after[k].astype(np.float64)
                applied = (m * v - v_after) / lr  # v' = m v - lr g, and w' = w + v'
                np.testing.assert_array_equal(after[k], weights[k] + momenta_after[k])
                mean = (g0.astype(np.float64) + g1) / 2
                s = (np.abs(g0.astype(np.float64)) + np.abs(g1)) / 2
                bound = ((2 * u + u * u + 10 * EPS32) * s + 3 * SUBNORMAL[compression]
                         + 4 * EPS32 * (m * np.abs(v) + np.abs(v_after)) / lr)
                error = np.abs(applied - mean)
                assert np.all(error <= bound), (t, k, float(np.max(error / bound)))
                largest = max(largest, float(np.max(error / (s + 1e-30))))
            weights, momenta = after, momenta_after
        # The rounding shows (uncompressed, the error is float32 round-off, < 1e-4 u):
        # the test can tell.
        assert largest > u / 2, largest
        # ... and the model still learns.
        assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5])

    @pytest.mark.parametrize("trained", ["fp16"], indirect=True)
    def test_an_fp16_overflow_raises_naming_bf16(self, trained):
        # Targets of 1e7 make gradients beyond float16's 65504, finite in float32.
        sgd = trained
        before, step = sgd.get_weights(), sgd.steps_done
        sgd.foreach_model(lambda model: setattr(model, "scale", 1e7))
        try:
            with pytest.raises(NonFiniteError, match=rf"step {step + 1}: non-finite gradient .* "
                                                     r"no weights were changed.* beyond float16's "
                                                     r"range .*'bf16'"):
                sgd.step()
        finally:
            sgd.foreach_model(lambda model: setattr(model, "scale", 1.0))
        for got, want in zip(assert_replicas_identical(sgd), before, strict=True):
            np.testing.assert_array_equal(got, want)
        assert sgd.steps_done == step
        sgd.step()  # and it trains on
        assert sgd.steps_done == step + 1


def test_compression_arguments_are_checked_before_any_actor():
    with pytest.raises(ValueError, match=r"compression must be None or one of \['fp16', 'bf16'\], got 'fp8'"):
        dsgd.DistributedSGD(tiny.creator(1, 4), 2, 1, gpu=False, compression="fp8")
    with pytest.raises(ValueError, match=r"compression must be None or one of .* got \['fp16'\]"):
        dsgd.DistributedSGD(tiny.creator(1, 4), 2, 1, gpu=False, compression=["fp16"])
    with pytest.raises(ValueError, match="compression='fp16' needs strategy='ps'"):
        dsgd.DistributedSGD(tiny.creator(1, 4), 2, 1, gpu=False, strategy="simple",
                            compression="fp16")
