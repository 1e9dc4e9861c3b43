"""Horovod's TF2 API in dsgd.train and its launcher: a Horovod-style script run
by `dsgd.train.run` on 2 Ray Train workers, every collective eagerly and in a
`tf.function` checked by hand, Horovod's custom loop (first-batch broadcast
inside the step) and Keras fit with the callbacks exact against one process;
a failing rank fails the launch with its traceback; errors outside a run."""

import contextlib
import io
import os
import re
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import dsgd.train as hvd
import tiny
from dsgd.errors import DsgdError
from dsgd.train import run as launcher

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS, BATCH = 3, 4


@pytest.fixture(scope="module")
def launch(tmp_path_factory, ray_local):
    """One launch of hvd_collectives.py on 2 ranks (each a Ray Train worker that
    imports TensorFlow: the launch is most of this module's time), whose rank 1
    raises once both ranks have saved what they got: (exit status, the
    launcher's stderr, each rank's saved arrays)."""
    out = tmp_path_factory.mktemp("hvd")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = launcher.main(["-np", "2", "--storage-path", str(out / "runs"),
                                os.path.join(HERE, "hvd_collectives.py"), str(out), str(STEPS),
                                str(BATCH), "--then-rank-1-fails"])
    return status, err.getvalue(), [dict(np.load(out / f"rank{r}.npz")) for r in range(2)]


@pytest.fixture
def ranks(launch):
    return launch[2]


def x_of(r):
    return np.arange(6, dtype=np.float32).reshape(2, 3) * (r + 1) + np.float32(0.1)


pytestmark = pytest.mark.cluster


def test_rank_size_and_topology(ranks):
    for r, got in enumerate(ranks):
        # rank, size, local_rank, local_size, cross_rank, cross_size, is_initialized
        assert got["shape"].tolist() == [r, 2, r, 2, 0, 1, 1]


@pytest.mark.parametrize("where", ["eager", "graph"])
def test_collectives_by_hand(ranks, where):
    x0, x1 = x_of(0), x_of(1)
    want = {
        "avg": (x0 + x1) * np.float32(0.5), "old_avg": (x0 + x1) * np.float32(0.5),
        "sum": x0 + x1, "scaled": (2 * x0 + 2 * x1) * np.float32(0.5),
        "int_sum": np.array([3, 6, 9], np.int32), "int_avg": np.array([1.5, 3.0, 4.5]),
        "grouped": (2 * x0 + 2 * x1) * np.float32(0.5),
        "sparse": np.array([[0, 0], [1.5, 1.5], [0, 0], [1.5, 1.5]], np.float32),
        "gather": np.array([[0, 0], [1, 1], [1, 1]], np.float32), "bcast": x1,
        "min": np.minimum(x0, x1), "max": np.maximum(x0, x1),
        "product": np.array([1 * 2, 2 * 4, 3 * 6], np.int32),
        "max_scaled": np.maximum(2 * x0, 2 * x1) * np.float32(0.5),
        "grouped_gather": np.array([[0, 0], [1, 1], [1, 1]], np.float32),
        "grouped_gather_ints": np.array([1, 2, 3, 2, 4, 6], np.int32),
    }
    for wire, name in ((np.float16, "fp16"), (ml_dtypes.bfloat16, "bf16")):
        # each rank's value rounded to the wire type, summed in float32, the mean rounded once
        a, b = ((x / np.float32(7.0)).astype(wire).astype(np.float32) for x in (x0, x1))
        want[name] = ((a + b) * np.float32(0.5)).astype(wire).astype(np.float32)
    for got in ranks:
        for name, value in want.items():
            array = got[f"{where}_{name}"]
            assert array.dtype == value.dtype, name
            np.testing.assert_allclose(array, value, rtol=0, atol=1e-6, err_msg=name)
        assert got["object"] == 1 and got["objects"].tolist() == [0, 1]
        assert got["object_fn"] == 1


def test_custom_loop_with_the_first_batch_broadcast_is_exact(ranks):
    """Step 0: each rank's gradient at its own initial weights, averaged, applied
    by every rank, then rank 0's model and optimizer broadcast; later steps: the
    gradient of the concatenated batches."""
    import tensorflow as tf

    def grad(model, r, t):
        with tf.GradientTape() as tape:
            loss = tiny.mse(model, *tiny.make_batch(r, t, BATCH))
        return tape.gradient(loss, model.trainable_variables)

    model, opt = tiny.make_keras_model(seed=0), tiny.make_optimizer("sgdm")
    other = tiny.make_keras_model(seed=1)
    first = [(a + b) / 2 for a, b in zip(grad(model, 0, 0), grad(other, 1, 0), strict=True)]
    opt.apply_gradients(zip(first, model.trainable_variables))
    for t in range(1, STEPS):
        mean = [(a + b) / 2 for a, b in zip(grad(model, 0, t), grad(model, 1, t), strict=True)]
        opt.apply_gradients(zip(mean, model.trainable_variables))
    for k, want in enumerate(model.get_weights()):
        np.testing.assert_allclose(ranks[0][f"loop_{k}"], want, rtol=0, atol=1e-5)
        np.testing.assert_array_equal(ranks[1][f"loop_{k}"], ranks[0][f"loop_{k}"])


def grad_at(weights, r, t):
    import tensorflow as tf

    model = tiny.make_keras_model()
    model.set_weights(weights)
    with tf.GradientTape() as tape:
        loss = tiny.mse(model, *tiny.make_batch(r, t, BATCH))
    return [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]


def test_the_tape_eagerly_and_compressed(ranks):
    """DistributedGradientTape eagerly: the mean of the two ranks' gradients at
    rank 0's weights (≤ 1e-5); with Compression.fp16 each rank's gradient rounded
    to float16, summed in float32, the mean rounded once (bit for bit)."""
    initial = tiny.make_keras_model(seed=0).get_weights()
    per_rank = [grad_at(initial, r, 0) for r in range(2)]
    for k, (a, b) in enumerate(zip(*per_rank, strict=True)):
        for got in ranks:
            np.testing.assert_allclose(got[f"tape_eager_{k}"], (a + b) / 2, rtol=0, atol=1e-5)
        a16, b16 = (x.astype(np.float16).astype(np.float32) for x in (a, b))
        want = ((a16 + b16) * np.float32(0.5)).astype(np.float16).astype(np.float32)
        for got in ranks:
            np.testing.assert_array_equal(got[f"tape_fp16_{k}"], want)


def test_backward_passes_per_step_is_exact(ranks):
    """DistributedOptimizer(backward_passes_per_step=2, average_aggregated_gradients=
    True) over 4 batches: two SGD steps, each with the mean over 2 ranks x 2
    passes of the gradients at the same weights."""
    weights = tiny.make_keras_model(seed=0).get_weights()
    for apply in range(2):
        grads = [grad_at(weights, r, 2 * apply + p) for r in range(2) for p in range(2)]
        weights = [w - np.float32(0.1) * np.mean(g, axis=0)
                   for w, g in zip(weights, zip(*grads), strict=True)]
    for k, want in enumerate(weights):
        np.testing.assert_allclose(ranks[0][f"passes_{k}"], want, rtol=0, atol=1e-5)
        np.testing.assert_array_equal(ranks[1][f"passes_{k}"], ranks[0][f"passes_{k}"])


def test_keras_fit_with_the_callbacks(ranks):
    """Ranks bit-identical after fit; MetricAverageCallback's logs are the mean of
    the ranks' own; LearningRateWarmupCallback's rate at each batch is Horovod's
    lr / size * ((epoch + (batch + 1) / steps) * (size - 1) / warmup + 1)."""
    for k in range(len(tiny.make_keras_model().get_weights())):
        np.testing.assert_array_equal(ranks[1][f"fit_{k}"], ranks[0][f"fit_{k}"])
    # MetricAverageCallback: each epoch's loss is the mean of the ranks' own losses.
    raw = (ranks[0]["fit_raw_loss"] + ranks[1]["fit_raw_loss"]) / 2
    assert not np.array_equal(ranks[0]["fit_raw_loss"], ranks[1]["fit_raw_loss"])
    for got in ranks:
        np.testing.assert_allclose(got["fit_loss"], raw, rtol=1e-6)
    steps = 4
    want = [0.2 / 2 * ((e + (b + 1) / steps) * (2 - 1) / 2 + 1) for e in range(2) for b in range(steps)]
    for got in ranks:
        np.testing.assert_allclose(got["fit_rates"], want, rtol=1e-6)


def test_a_failing_rank_fails_the_launch_with_its_traceback(launch):
    status, err, _ = launch
    assert status == 1
    assert "hvd_collectives.py failed" in err and "ValueError: rank 1 fails on purpose" in err


class FakeTrainer:
    """Stands in for DsgdTrainer: fit() runs the launcher's loop (run_script) once,
    in this process, and reports no error."""

    made: list = []

    def __init__(self, loop, train_loop_config, **kwargs):
        self.loop, self.config, self.kwargs = loop, train_loop_config, kwargs
        FakeTrainer.made.append(self)

    def fit(self):
        from types import SimpleNamespace

        self.loop(self.config)
        return SimpleNamespace(error=None)


def test_a_script_that_finishes_is_status_0(tmp_path, monkeypatch, ray_local):
    """The launcher's own path without a Ray Train run: the script runs as
    __main__ with its arguments (a leading `python` skipped); it finishing is
    exit status 0, a non-zero sys.exit is 1."""
    monkeypatch.setattr(hvd, "DsgdTrainer", FakeTrainer)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    script = tmp_path / "ok.py"
    script.write_text("import sys\nassert __name__ == '__main__'\n"
                      "open(sys.argv[1], 'w').write(' '.join(sys.argv[2:]))\n")
    done = tmp_path / "done.txt"
    assert launcher.main(["-np", "2", "python", str(script), str(done), "--flag", "1"]) == 0
    assert done.read_text() == "--flag 1"
    made = FakeTrainer.made[-1]
    assert made.kwargs["scaling_config"].num_workers == 2
    script.write_text("import sys\nsys.exit(3)\n")
    assert launcher.main(["-np", "2", str(script)]) == 1


def test_launcher_argument_errors(tmp_path, capsys):
    assert launcher.main(["-np", "0", "x.py"]) == 2
    assert "-np must be >= 1" in capsys.readouterr().err
    assert launcher.main(["-np", "2", str(tmp_path / "missing.py")]) == 2
    assert "cannot read the script" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        launcher.main(["train.py"])  # -np is required


def test_outside_a_run_every_name_says_how_to_launch():
    assert not hvd.is_initialized()
    for call in (hvd.init, hvd.size, hvd.rank, hvd.local_rank):
        with pytest.raises(DsgdError, match=r"python -m dsgd.train.run -np N"):
            call()


def test_bad_arguments_are_named():
    import keras

    with pytest.raises(ValueError, match="op=Adasum is not supported"):
        hvd.collectives._op_of(hvd.Adasum, None)
    with pytest.raises(ValueError, match="op must be dsgd.train.Average, Sum, Min, Max or Product"):
        hvd.DistributedGradientTape(None, op=7)
    with pytest.raises(ValueError, match="pass op= or the older average=, not both"):
        hvd.collectives._op_of(hvd.Sum, True)
    with pytest.raises(ValueError, match="compression must be dsgd.train.Compression"):
        hvd.DistributedGradientTape(None, compression="int8")
    with pytest.raises(TypeError, match=r"unexpected argument\(s\) \['bogus'\]"):
        hvd.DistributedGradientTape(None, bogus=1)
    hvd.DistributedGradientTape(None, device_dense="/gpu:0", sparse_as_dense=True)  # hints
    with pytest.raises(ValueError, match="DistributedOptimizer: process_set=.* dsgd has no process"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(), process_set="evens")
    # Horovod's gradient_predivide_factor: its default 1.0 (the same mean) only.
    hvd.DistributedGradientTape(None, gradient_predivide_factor=1.0)
    hvd.DistributedOptimizer(keras.optimizers.SGD(), gradient_predivide_factor=1.0,
                             process_set=hvd.global_process_set, use_locking=False,
                             device_sparse="", num_groups=0)
    for wrap in (lambda **kw: hvd.DistributedGradientTape(None, **kw),
                 lambda **kw: hvd.DistributedOptimizer(keras.optimizers.SGD(), **kw)):
        with pytest.raises(ValueError, match=r"(Tape|Optimizer): gradient_predivide_factor=2.0 "
                                             r"is not supported"):
            wrap(gradient_predivide_factor=2.0)
        with pytest.raises(TypeError, match=r"unexpected argument\(s\) \['gradient_predivide'\]"):
            wrap(gradient_predivide=1.0)
    # Each collective names a misspelt argument and a process set before it needs a run.
    import tensorflow as tf

    one = tf.constant([1.0])
    calls = {"allreduce": lambda **kw: hvd.allreduce(one, **kw),
             "grouped_allreduce": lambda **kw: hvd.grouped_allreduce([one], **kw),
             "allgather": lambda **kw: hvd.allgather(one, **kw),
             "broadcast": lambda **kw: hvd.broadcast(one, 0, **kw),
             "broadcast_variables": lambda **kw: hvd.broadcast_variables([tf.Variable(one)], 0,
                                                                         **kw),
             "broadcast_object": lambda **kw: hvd.broadcast_object({}, 0, **kw),
             "allgather_object": lambda **kw: hvd.allgather_object({}, **kw)}
    for where, call in calls.items():
        with pytest.raises(TypeError, match=rf"{where}: unexpected argument\(s\) \['avarage'\]"):
            call(avarage=True)
        with pytest.raises(ValueError, match=rf"{where}: process_set='evens' is not supported"):
            call(process_set="evens")
        # Horovod's hints pass the check; then the call needs a run, as without them.
        with pytest.raises(DsgdError, match=r"python -m dsgd.train.run -np N"):
            call(process_set=None, ignore_name_scope=True)
    # broadcast_variables takes Horovod's inplace= too (variables are always assigned in place).
    with pytest.raises(DsgdError, match=r"python -m dsgd.train.run -np N"):
        hvd.broadcast_variables([tf.Variable(one)], 0, process_set=hvd.global_process_set,
                                inplace=True)
    with pytest.raises(ValueError, match="backward_passes_per_step must be an int >= 1"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(), backward_passes_per_step=0)
    with pytest.raises(ValueError, match="initial_lr must be a positive number"):
        hvd.callbacks.LearningRateWarmupCallback(0)


# Every public name of horovod.tensorflow and horovod.tensorflow.keras 0.28.1 (read from its
# build against TF 2.21), but its internal modules and helpers: each is provided, or says
# "does not provide" with what to use instead (docs/raytrain.md lists the latter).
HOROVOD_NAMES = (
    "Adasum", "Average", "BroadcastGlobalVariablesHook", "Compression", "DistributedGradientTape",
    "DistributedOptimizer", "LocalGradientAggregationHelper", "Max", "Min",
    "PartialDistributedGradientTape", "ProcessSet", "Product", "Sum", "SyncBatchNormalization",
    "add_process_set", "allgather", "allgather_object", "allreduce", "alltoall", "barrier",
    "broadcast", "broadcast_", "broadcast_global_variables", "broadcast_object",
    "broadcast_object_fn", "broadcast_variables", "callbacks", "ccl_built", "cross_rank",
    "cross_size", "cuda_built", "ddl_built", "elastic", "gloo_built", "gloo_enabled",
    "global_process_set", "gpu_available", "grouped_allgather", "grouped_allreduce",
    "grouped_reducescatter", "init", "is_homogeneous", "is_initialized", "join", "load_model",
    "local_rank", "local_rank_op", "local_size", "local_size_op", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "process_set_included_op", "rank", "rank_op",
    "reducescatter", "remove_process_set", "rocm_built", "shutdown", "size", "size_op",
    "start_timeline", "stop_timeline")
HOROVOD_CALLBACKS = ("BestModelCheckpoint", "BroadcastGlobalVariablesCallback",
                     "LearningRateScheduleCallback", "LearningRateWarmupCallback",
                     "MetricAverageCallback")


def test_every_horovod_name_is_provided_or_says_what_to_use():
    import re

    not_provided = []
    for name in HOROVOD_NAMES:
        try:
            getattr(hvd, name)
        except AttributeError as e:
            assert re.match(rf"dsgd.train does not provide Horovod's {name}\b", str(e)), str(e)
            not_provided.append(name)
    for name in HOROVOD_CALLBACKS:
        assert isinstance(getattr(hvd.callbacks, name), type), name
    # The cheap ones are provided (without MPI, Gloo or NCCL: the "without" answers).
    assert (hvd.Min, hvd.Max, hvd.Product) == (3, 4, 5)  # Horovod's values
    assert not any(f() for f in (hvd.mpi_built, hvd.mpi_enabled, hvd.gloo_built,
                                 hvd.gloo_enabled, hvd.nccl_built, hvd.cuda_built))
    with pytest.raises(ValueError, match="does not use MPI"):
        hvd.mpi_threads_supported()
    # The rest name what to use, and docs/raytrain.md lists every one of them.
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "raytrain.md")) as f:
        page = f.read()
    missing = [n for n in not_provided if not re.search(rf"`(hvd\.)?{re.escape(n)}[`(.]", page)]
    assert not missing, f"docs/raytrain.md does not list {missing}"
    assert "broadcast_variables" in str(pytest.raises(AttributeError, getattr, hvd,
                                                      "broadcast_").value)


def test_best_model_checkpoint_keeps_the_best_and_needs_a_path(tmp_path):
    import keras

    model = tiny.make_keras_model()
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    x, y = tiny.make_batch(0, 0, 8)
    with pytest.raises(ValueError, match="no filepath"):
        model.fit(x, y, epochs=1, verbose=0, validation_data=(x, y),
                  callbacks=[hvd.callbacks.BestModelCheckpoint()])
    path = str(tmp_path / "best.keras")
    callback = hvd.callbacks.BestModelCheckpoint(filepath=path, monitor="val_loss")
    assert callback.save_best_only
    model.fit(x, y, epochs=2, verbose=0, validation_data=(x, y), callbacks=[callback])
    assert os.path.exists(path)


def test_horovod_names_not_provided_say_so():
    for name in ("alltoall", "reducescatter", "PartialDistributedGradientTape", "join", "elastic",
                 "load_model", "start_timeline"):
        with pytest.raises(AttributeError, match=rf"dsgd.train does not provide Horovod's {name}"):
            getattr(hvd, name)
    with pytest.raises(AttributeError, match="has no attribute 'allreduse'"):
        hvd.allreduse  # noqa: B018


EXAMPLES = os.path.join(os.path.dirname(HERE), "dsgd", "examples", "horovod")


@pytest.mark.slow
def test_the_command_line_shows_rank_0_output_and_fails_on_a_failing_rank(tmp_path, ray_local,
                                                                          capfd):
    """`python -m dsgd.train.run` from a shell, running the synthetic benchmark
    example (dsgd/examples/horovod): a new local Ray cluster, the script's
    arguments passed on, rank 0's lines on the terminal, exit status 0, none of
    TensorFlow's start-up probing lines (a user's shell has no
    TF_CPP_MIN_LOG_LEVEL); a script whose rank 1 raises: 1 and the error on stderr
    (the launcher in-process on the shared cluster: a second new cluster would
    only repeat the start-up)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("RAY_ADDRESS", None)
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    done = subprocess.run([sys.executable, "-m", "dsgd.train.run", "-np", "2", "--storage-path",
                           str(tmp_path / "runs"), "python",
                           os.path.join(EXAMPLES, "synthetic_benchmark.py"), "--model",
                           "MobileNetV2", "--image-size", "32", "--batch-size", "2",
                           "--num-iters", "2", "--num-batches-per-iter", "2", "--fp16-allreduce"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    shown = done.stdout + done.stderr
    assert "Model: MobileNetV2, batch size: 2, image size: 32" in shown, shown[-3000:]
    assert "Total img/sec on 2 worker(s)" in shown, shown[-3000:]
    noise = re.findall(r".*(?:Could not find cuda drivers|failed call to cuInit|oneDNN custom).*",
                       shown)
    assert not noise, noise
    bad = tmp_path / "bad.py"
    bad.write_text("import dsgd.train as hvd\nhvd.init()\n"
                   "if hvd.rank() == 1:\n    raise KeyError('rank one')\n")
    capfd.readouterr()
    status = launcher.main(["-np", "2", "--timeout", "20", "--storage-path",
                            str(tmp_path / "runs"), str(bad)])
    assert status == 1 and "KeyError: 'rank one'" in capfd.readouterr().err


@pytest.mark.slow
def test_the_horovod_examples_run_at_small_sizes(tmp_path, ray_local):
    """The custom-loop and Keras MNIST scripts through the launcher in-process (rank 0
    writes the checkpoints). The synthetic benchmark runs from a shell, rank 0's
    output on its terminal: test_the_command_line_shows_rank_0_output_and_fails_on_a_failing_rank."""
    runs = str(tmp_path / "runs")
    status = launcher.main(["-np", "2", "--storage-path", runs, os.path.join(EXAMPLES, "tf2_mnist.py"),
                            "--steps", "20", "--checkpoint-dir", str(tmp_path / "loop")])
    assert status == 0 and any(p.startswith("ckpt-1") for p in os.listdir(tmp_path / "loop"))
    status = launcher.main(["-np", "2", "--storage-path", runs,
                            os.path.join(EXAMPLES, "keras_mnist.py"), "--epochs", "2",
                            "--steps-per-epoch", "8", "--warmup-epochs", "1",
                            "--checkpoint-dir", str(tmp_path / "fit")])
    assert status == 0
    assert sorted(os.listdir(tmp_path / "fit")) == ["checkpoint-1.keras", "checkpoint-2.keras"]
