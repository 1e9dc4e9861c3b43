"""Training operators for the Trainer tests (pickled by value to the workers)."""

import numpy as np

import dsgd

IN, HIDDEN, CLASSES = 5, 7, 3


def classification(n: int, seed: int):
    """(x float32 [n, IN], y int64 [n]): labels from a fixed linear rule."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, IN)).astype(np.float32)
    w = np.random.default_rng(99).normal(size=(IN, CLASSES))
    return x, np.argmax(x @ w, axis=1).astype(np.int64)


def build_model(seed: int = 0):
    import keras

    init = lambda k: keras.initializers.GlorotUniform(seed=seed + k)  # noqa: E731
    return keras.Sequential([keras.Input((IN,)),
                             keras.layers.Dense(HIDDEN, activation="tanh", kernel_initializer=init(0)),
                             keras.layers.Dense(CLASSES, kernel_initializer=init(1))])


class Classifier(dsgd.TrainingOperator):
    """A small classifier on dsgd.Datasets: 64 training and 30 validation examples."""

    def setup(self, config):
        import keras

        model = build_model()
        optimizer = keras.optimizers.SGD(config.get("lr", 0.1))
        self.model_, self.optimizer_ = self.register(
            models=model, optimizers=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")])
        x, y = classification(config.get("train_n", 64), 0)
        vx, vy = classification(30, 1)
        self.register_data(train_data=dsgd.Dataset(list(zip(x, y))),
                           validation_data=dsgd.Dataset(list(zip(vx, vy)), batch_size=4))
        self.seen = 0

    def state_dict(self):
        return {"note": "classifier", "lr": self.config.get("lr", 0.1)}

    def load_state_dict(self, state):
        self.loaded = state


class TfDataClassifier(Classifier):
    """The same, fed by tf.data pipelines built in setup (each replica reads its shard)."""

    def setup(self, config):
        import tensorflow as tf

        super().setup(config)
        x, y = classification(config.get("train_n", 64), 0)
        vx, vy = classification(30, 1)
        batch = config[dsgd.BATCH_SIZE]
        self.register_data(
            train_data=tf.data.Dataset.from_tensor_slices((x, y)).batch(batch),
            validation_data=tf.data.Dataset.from_tensor_slices((vx, vy)).batch(4))


def reference(epochs: int, global_batch: int, train_n: int = 64, lr: float = 0.1):
    """Single-process Keras: the same model and data, batches in order. Returns
    (per-epoch mean loss before each update, weights, val loss, val accuracy)."""
    import keras
    import tensorflow as tf

    model = build_model()
    optimizer = keras.optimizers.SGD(lr)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x, y = classification(train_n, 0)
    epoch_losses = []
    for _ in range(epochs):
        losses = []
        for start in range(0, train_n, global_batch):
            xb, yb = x[start:start + global_batch], y[start:start + global_batch]
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(loss_fn(yb, model(xb, training=True)))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            losses.append(float(loss))
        epoch_losses.append(float(np.mean(losses)))
    vx, vy = classification(30, 1)
    logits = model(vx, training=False)
    val_loss = float(np.mean(loss_fn(vy, logits)))
    val_accuracy = float(np.mean(np.argmax(logits, axis=1) == vy))
    return epoch_losses, model.get_weights(), val_loss, val_accuracy


class Misbehave:
    """A transform that, once (marker file created exclusively), on its `at`-th
    batch SIGKILLs its worker or sleeps for an hour in it."""

    def __init__(self, action: str, marker: str, at: int):
        self.action, self.marker, self.at, self.calls = action, marker, at, 0

    def __call__(self, batch):
        import os
        import signal
        import time

        self.calls += 1
        if self.calls == self.at:
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                return batch
            if self.action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(3600)
        return batch


class FlakyData:
    """Mixin: after the operator's setup, training data whose worker is killed (or
    hangs) at its 3rd batch, once (config["action"], config["marker"])."""

    def setup(self, config):
        super().setup(config)
        x, y = classification(64, 0)
        self.register_data(train_data=dsgd.Dataset(
            list(zip(x, y)), transform=Misbehave(config["action"], config["marker"], 3)))


class FlakyClassifier(FlakyData, Classifier):
    pass


class Gan(dsgd.TrainingOperator):
    """Two models, two optimizers, one train_batch computing both losses (the
    seed's DCGAN case, tiny): a generator of 2-vectors against a discriminator."""

    def setup(self, config):
        import keras

        # Seeded: with unseeded weights a ReLU layer could start dead for every input
        # (no gradient, so a variable that does not move: test_trainer failed so once).
        init = lambda k: keras.initializers.GlorotUniform(seed=k)  # noqa: E731
        generator = keras.Sequential([keras.Input((3,)),
                                      keras.layers.Dense(8, activation="relu",
                                                         kernel_initializer=init(1)),
                                      keras.layers.Dense(2, kernel_initializer=init(2))])
        discriminator = keras.Sequential([keras.Input((2,)),
                                          keras.layers.Dense(8, activation="relu",
                                                             kernel_initializer=init(3)),
                                          keras.layers.Dense(1, kernel_initializer=init(4))])
        self.discriminator, self.generator = discriminator, generator
        self.register(models=(discriminator, generator),
                      optimizers=(keras.optimizers.Adam(1e-2), keras.optimizers.Adam(1e-2)))
        real = np.random.default_rng(0).normal(loc=2.0, size=(64, 2)).astype(np.float32)
        self.register_data(train_data=dsgd.Dataset(list(real), batch_size=8))

    def train_batch(self, batch, batch_info):
        import keras
        import tensorflow as tf

        bce = keras.losses.BinaryCrossentropy(from_logits=True)
        noise = tf.random.stateless_normal([tf.shape(batch)[0], 3],
                                           seed=tf.stack([batch_info["epoch"], batch_info["batch_idx"]]))
        fake = self.generator(noise, training=True)
        real_logits = self.discriminator(batch, training=True)
        fake_logits = self.discriminator(fake, training=True)
        loss_d = (bce(tf.ones_like(real_logits), real_logits)
                  + bce(tf.zeros_like(fake_logits), fake_logits)) / 2
        loss_g = bce(tf.ones_like(fake_logits), fake_logits)
        return {"loss": (loss_d, loss_g), "loss_d": loss_d, "loss_g": loss_g}


class ScheduledClassifier(Classifier):
    """The classifier with the scheduler `config["make_scheduler"]()` registered."""

    def setup(self, config):
        super().setup(config)
        self._registered = False  # register again, now with the scheduler
        self.register(models=self.model_, optimizers=self.optimizer_, loss=self._loss,
                      metrics=self._metrics, schedulers=config["make_scheduler"]())


def halve_after_first(epoch, lr):
    """A (count, lr) -> lr scheduler: keep the rate for count 0, halve it after."""
    return lr if epoch == 0 else lr * 0.5


def step_decay():
    return halve_after_first


def exponential_decay():
    import keras

    return keras.optimizers.schedules.ExponentialDecay(0.2, decay_steps=1, decay_rate=0.8)


def plateau():
    return dsgd.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=1, min_delta=10.0)


def scheduled_reference(epochs: int, global_batch: int, before_epoch=None, before_step=None,
                        after_epoch=None, lr: float = 0.1, train_n: int = 64):
    """`reference` with hooks that set the learning rate: before_epoch(epoch0,
    optimizer), before_step(optimizer), after_epoch(epoch0, optimizer, model)."""
    import keras
    import tensorflow as tf

    model = build_model()
    optimizer = keras.optimizers.SGD(lr)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x, y = classification(train_n, 0)
    rates = []
    for epoch in range(epochs):
        if before_epoch:
            before_epoch(epoch, optimizer)
        for start in range(0, train_n, global_batch):
            if before_step:
                before_step(optimizer)
            xb, yb = x[start:start + global_batch], y[start:start + global_batch]
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(loss_fn(yb, model(xb, training=True)))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        rates.append(float(optimizer.learning_rate.numpy()))
        if after_epoch:
            after_epoch(epoch, optimizer, model)
    return model.get_weights(), rates


def validation_loss(model) -> float:
    import keras

    vx, vy = classification(30, 1)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return float(np.mean(loss_fn(vy, model(vx, training=False))))


class CustomEpochClassifier(Classifier):
    """The classifier with its own train_epoch (train_step per batch) and validate."""

    def train_epoch(self, iterator, info):
        meters = dsgd.AverageMeterCollection()
        for batch in iterator:
            meters.update(self.train_step(batch))
        return dict(meters.summary(), epoch_seen=info["epoch"])

    def validate(self, iterator, info):
        import keras

        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
        total, n = 0.0, 0
        for x, y in iterator:
            total += float(loss_fn(y, self.model(x, training=False)))
            n += len(y)
        return {"val_loss_custom": total / max(n, 1), "num_samples": n}


class CustomEpochTfData(TfDataClassifier):
    train_epoch = CustomEpochClassifier.train_epoch


class FlakyCustomEpoch(FlakyData, CustomEpochClassifier):
    """A custom epoch whose worker is killed (or hangs) at its 3rd batch, once."""


class CustomEpochGan(Gan):
    """The tiny GAN with a custom train_epoch (the seed's multi-model way)."""

    def train_epoch(self, iterator, info):
        meters = dsgd.AverageMeterCollection()
        for batch in iterator:
            meters.update(self.train_step(batch))
        return meters.summary()


def linear_dataset(a: float, b: float, n: int, seed: int) -> list:
    """The seed's LinearDataset: y = a * x + b, x in [0, 10)."""
    x = np.random.default_rng(seed).uniform(0, 10, size=(n, 1)).astype(np.float32)
    return list(zip(x, (a * x + b).astype(np.float32)))


def step_lr(lr: float):
    """torch.optim.lr_scheduler.StepLR(step_size=5, gamma=0.9), per epoch, in Keras."""
    import keras

    return keras.optimizers.schedules.ExponentialDecay(lr, decay_steps=5, decay_rate=0.9,
                                                       staircase=True)


class SeedLinearOperator(dsgd.TrainingOperator):
    """The seed's first example (MyTrainingOperator), translated to Keras."""

    def setup(self, config):
        import keras

        train_dataset, val_dataset = linear_dataset(2, 5, 1024, 0), linear_dataset(2, 5, 256, 1)
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        optimizer = keras.optimizers.SGD(config.get("lr", 1e-4))
        criterion = keras.losses.MeanSquaredError()
        scheduler = step_lr(config.get("lr", 1e-4))
        self.model_, self.optimizer_, self.scheduler_ = self.register(
            models=model, optimizers=optimizer, loss=criterion, schedulers=scheduler)
        self.register_data(train_data=dsgd.Dataset(train_dataset),
                           validation_data=dsgd.Dataset(val_dataset))


def seed_model_creator(config):
    import keras

    return keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])


def seed_optimizer_creator(model, config):
    import keras

    return keras.optimizers.SGD(config.get("lr", 1e-4))


def seed_data_creator(config):
    return dsgd.Dataset(linear_dataset(2, 5, 1024, 0)), dsgd.Dataset(linear_dataset(2, 5, 256, 1))


def seed_loss_creator(config):
    import keras

    return keras.losses.MeanSquaredError()


def seed_scheduler_creator(optimizer, config):
    return step_lr(config.get("lr", 1e-4))


class FlakyScheduled(FlakyData, ScheduledClassifier):
    """A scheduled classifier whose worker is killed (or hangs) at its 3rd batch, once."""


class CustomValidateWithDefault(Classifier):
    """A validate override that adds a value to the default's (validate_batch + metrics)."""

    def validate(self, iterator, info):
        return dict(super().validate(iterator, info), extra=1.0)


def gan_reference(initial, epochs: int, num_replicas: int, batch: int = 8, first_epoch: int = 1):
    """`Gan` in one process: from `initial` = (discriminator weights, generator
    weights), each step the mean over `num_replicas` replicas of each replica's
    two losses (replica r's real rows are rows [r*batch, (r+1)*batch) of the
    step's num_replicas*batch; its noise is Gan.train_batch's, seeded by
    (epoch, batch_idx), the same on every replica), loss_d differentiated for the
    discriminator and loss_g for the generator, each applied by its Adam. Returns
    (discriminator weights, generator weights, per-epoch mean loss_d, mean loss_g)."""
    import keras
    import tensorflow as tf

    discriminator = keras.Sequential([keras.Input((2,)), keras.layers.Dense(8, activation="relu"),
                                      keras.layers.Dense(1)])
    generator = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(2)])
    discriminator.set_weights(initial[0])
    generator.set_weights(initial[1])
    opt_d, opt_g = keras.optimizers.Adam(1e-2), keras.optimizers.Adam(1e-2)
    bce = keras.losses.BinaryCrossentropy(from_logits=True)
    real = np.random.default_rng(0).normal(loc=2.0, size=(64, 2)).astype(np.float32)
    rows = num_replicas * batch
    losses_d, losses_g = [], []
    for epoch in range(first_epoch, first_epoch + epochs):
        epoch_d, epoch_g = [], []
        for step in range(len(real) // rows):
            noise = tf.random.stateless_normal([batch, 3], seed=tf.constant([epoch, step], tf.int64))
            with tf.GradientTape(persistent=True) as tape:
                per_d, per_g = [], []
                for r in range(num_replicas):
                    x = real[step * rows + r * batch:step * rows + (r + 1) * batch]
                    fake = generator(noise, training=True)
                    real_logits = discriminator(x, training=True)
                    fake_logits = discriminator(fake, training=True)
                    per_d.append((bce(tf.ones_like(real_logits), real_logits)
                                  + bce(tf.zeros_like(fake_logits), fake_logits)) / 2)
                    per_g.append(bce(tf.ones_like(fake_logits), fake_logits))
                loss_d, loss_g = tf.add_n(per_d) / num_replicas, tf.add_n(per_g) / num_replicas
            grads_d = tape.gradient(loss_d, discriminator.trainable_variables)
            grads_g = tape.gradient(loss_g, generator.trainable_variables)
            opt_d.apply_gradients(zip(grads_d, discriminator.trainable_variables))
            opt_g.apply_gradients(zip(grads_g, generator.trainable_variables))
            epoch_d.append(float(loss_d))
            epoch_g.append(float(loss_g))
        losses_d.append(float(np.mean(epoch_d)))
        losses_g.append(float(np.mean(epoch_g)))
    return discriminator.get_weights(), generator.get_weights(), losses_d, losses_g
