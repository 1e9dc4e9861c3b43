"""Peer: plain single-process TensorFlow, one replica, a compiled `tf.function`
training step. The per-worker ceiling every distributed peer is compared with."""

from __future__ import annotations

import common


def main(argv=None):
    args = common.peer_args(__doc__, argv)
    import tensorflow as tf

    model = common.build_model(args.config)
    optimizer, loss_fn = common.make_optimizer(), common.make_loss_fn()
    images, labels = common.synthetic_batch(args.config, seed=0)

    @tf.function
    def train_step():
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                      model.trainable_variables))
        return loss

    times = common.time_steps(lambda: train_step().numpy(), args.warmup, args.steps)
    common.report(common.summarize(args.config, 1, times))


if __name__ == "__main__":
    main()
