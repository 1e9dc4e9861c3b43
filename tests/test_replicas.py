"""`Replicas` in-process (no Ray): the compiled packing and unpacking agree with
the numpy reference of the shard plan, and compute+apply equals one plain step."""

import numpy as np
import pytest

import tiny
from dsgd.worker.replicas import Replicas
from dsgd.comm.sharding import plan_shards
from helpers import pack


@pytest.mark.parametrize("shard_bytes", [64, 100, 10_000_000])
def test_compute_then_apply_matches_a_plain_step(shard_bytes):
    import tensorflow as tf

    replicas = Replicas(tiny.creator(1, 4, "sgdm"), 0, 1, False, "simple")
    info = replicas.setup()
    plan = plan_shards(info["shapes"], info["dtypes"], shard_bytes)
    replicas.configure(plan)
    initial = replicas.replicas[0].get_weights()

    losses, finite, flat_grads, metrics = replicas.compute()
    assert metrics == {}
    assert finite.numpy().tolist() == [True]
    pieces = replicas.shard_pieces(flat_grads)
    x, y = tiny.make_batch(0, 0, 4)
    reference = tiny.make_keras_model()
    reference.set_weights(initial)
    with tf.GradientTape() as tape:
        loss = tiny.mse(reference, x, y)
    grads = tape.gradient(loss, reference.trainable_variables)
    expected = pack(plan, [g.numpy().reshape(-1) for g in grads])
    assert len(pieces) == len(expected) == plan.num_shards
    for shard, got, want in zip(plan.shards, pieces, expected, strict=True):
        assert len(got) == len(shard.pieces)
        for piece, view in zip(shard.pieces, got, strict=True):
            np.testing.assert_allclose(
                view, want[piece.shard_offset:piece.shard_offset + piece.length], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(losses.numpy(), [loss.numpy()], rtol=1e-6)

    replicas.apply(expected)
    tiny.make_optimizer("sgdm").apply_gradients(zip(grads, reference.trainable_variables))
    for got, want in zip(replicas.replicas[0].get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def test_apply_rejects_wrong_shard_count():
    from dsgd.errors import DsgdError

    replicas = Replicas(tiny.creator(1, 4), 0, 1, False, "simple")
    info = replicas.setup()
    replicas.configure(plan_shards(info["shapes"], info["dtypes"], 64))
    plan = replicas.plan
    with pytest.raises(DsgdError, match=f"got 1 shards, the plan has {plan.num_shards}"):
        replicas.apply([np.zeros(16, np.float32)])
    good = pack(plan, [np.zeros(int(np.prod(s)), np.float32) for s in plan.shapes])
    with pytest.raises(DsgdError, match="shard 0 must be a 1-D contiguous float32 array, got float64"):
        replicas.apply([good[0].astype(np.float64)] + good[1:])
