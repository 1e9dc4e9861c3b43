"""dsgd.Dataset and DistributedSGD.train on the local Ray cluster: coverage per
epoch, the shuffled order, with_batch_size, where transforms run, download
concurrency, errors, Ray Data's exact epoch; all on one shared instance. (Ray
Data's longer cases: test_data_ray.py; a worker killed mid-train:
test_recovery.py.)"""

import glob
import os
import time

import numpy as np
import pytest

import ray

import dsgd
from counting import N, Counter, counts, one_hot, reset

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("ray_local")]


@pytest.fixture(scope="module")
def counter2x2():
    with dsgd.DistributedSGD(Counter, 2, 2, gpu=False) as sgd:
        yield sgd


def test_every_item_exactly_once_per_epoch(counter2x2):
    reset(counter2x2)
    ds = dsgd.Dataset(range(N), download_func=one_hot, max_concurrency=2, batch_size=4)
    summary = counter2x2.train(dataset=ds)  # default: one epoch = 48 / (2 x 4) steps
    assert summary["steps"] == 6 and summary["num_samples"] == N
    np.testing.assert_array_equal(counts(counter2x2), np.ones(N, int))
    # ... and train() continues where it stopped: the second epoch, in two calls.
    counter2x2.train(dataset=ds, num_steps=4)
    counter2x2.train(dataset=ds, num_steps=2)
    np.testing.assert_array_equal(counts(counter2x2), np.full(N, 2))
    assert ds.position == 2 * N


def test_uneven_data_oversamples_at_the_wrap(counter2x2):
    reset(counter2x2)
    ds = dsgd.Dataset([one_hot(i) for i in range(44)], batch_size=4)  # 44 = 5.5 steps of 8
    assert counter2x2.train(dataset=ds)["steps"] == 6
    expected = np.ones(N, int)
    expected[:4] += 1  # rows 44..47 wrap around to items 0..3
    expected[44:] = 0
    np.testing.assert_array_equal(counts(counter2x2), expected)


def items_of_each_step(sgd, ds, steps: int) -> list[tuple[int, ...]]:
    """The items each of `steps` steps trained on, from the change of the counts
    (train() one step at a time)."""
    seen, before = [], counts(sgd)
    for _ in range(steps):
        sgd.train(dataset=ds, num_steps=1)
        after = counts(sgd)
        change = after - before
        assert set(np.unique(change)) <= {0, 1}  # no item twice in a step
        seen.append(tuple(np.flatnonzero(change).tolist()))
        before = after
    return seen


def test_shuffle_is_a_new_order_every_epoch_fixed_by_the_seed(counter2x2):
    """shuffle=True: every item once per epoch, in an order that is not the data's,
    differs between epochs, and is the same for another Dataset with the same
    seed (a pure function of seed and epoch); another seed, another order."""
    reset(counter2x2)
    steps = N // 8  # 2 workers x 4 rows a step: 6 steps an epoch
    shuffled = dsgd.Dataset(range(N), download_func=one_hot, batch_size=4, shuffle=True, seed=7)
    order = items_of_each_step(counter2x2, shuffled, 2 * steps)
    epochs = [order[:steps], order[steps:]]
    for epoch in epochs:
        assert sorted(i for step in epoch for i in step) == list(range(N)), "each item once"
        assert all(len(step) == 8 for step in epoch)
    in_order = [tuple(range(8 * k, 8 * k + 8)) for k in range(steps)]
    assert epochs[0] != in_order and epochs[1] != in_order and epochs[0] != epochs[1]
    # ... and not only the steps' order: the steps' item sets differ between epochs
    assert set(epochs[0]) != set(epochs[1])
    again = dsgd.Dataset(range(N), download_func=one_hot, batch_size=4, shuffle=True, seed=7)
    assert items_of_each_step(counter2x2, again, 2 * steps) == order
    other = dsgd.Dataset(range(N), download_func=one_hot, batch_size=4, shuffle=True, seed=8)
    assert items_of_each_step(counter2x2, other, steps) != epochs[0]


def test_with_batch_size_shares_the_data_and_its_position(counter2x2, tmp_path):
    """with_batch_size: a new Dataset over the same downloaded blocks (every item
    downloaded once in all) that starts at this one's position; this one keeps
    its batch size and position."""
    reset(counter2x2)

    def recorded_one_hot(i):
        (tmp_path / f"item-{i}-{time.monotonic_ns()}").touch()
        return one_hot(i)

    small = dsgd.Dataset(range(N), download_func=recorded_one_hot, batch_size=4, max_concurrency=2)
    counter2x2.train(dataset=small, num_steps=2)  # rows 0..15
    big = small.with_batch_size(8)
    assert (big.batch_size, big.position, small.batch_size) == (8, 16, 4)
    counter2x2.train(dataset=big, num_steps=2)  # 2 workers x 8 rows x 2 steps: rows 16..47
    np.testing.assert_array_equal(counts(counter2x2), np.ones(N, int))
    assert big.position == N and small.position == 16
    downloaded = sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("item-*"))
    assert downloaded == list(range(N))
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        small.with_batch_size(0)


def test_ray_data_one_epoch_covers_every_row_once(counter2x2):
    reset(counter2x2)
    ds = ray.data.range(N).map_batches(lambda b: {"x": np.eye(N, dtype=np.float32)[b["id"]]})
    summary = counter2x2.train(dataset=dsgd.Dataset(ds, batch_size=4))
    assert summary["steps"] == 6 and summary["epoch_ended"] and summary["num_samples"] == N
    np.testing.assert_array_equal(counts(counter2x2), np.ones(N, int))


def test_a_generator_streams_and_needs_num_steps(counter2x2):
    reset(counter2x2)
    ds = dsgd.Dataset((i for i in range(N)), download_func=one_hot, batch_size=4)
    with pytest.raises(ValueError, match="streaming data of unknown length .* pass num_steps"):
        counter2x2.train(dataset=ds)
    counter2x2.train(dataset=ds, num_steps=9)  # 72 rows: the 48 items, then 0..23 again
    np.testing.assert_array_equal(counts(counter2x2), np.r_[np.full(24, 2), np.ones(24, int)])


def test_transform_runs_in_the_workers(counter2x2, tmp_path):
    reset(counter2x2)

    def double_and_record(batch):
        with open(tmp_path / f"pid-{os.getpid()}", "w") as f:
            f.write("transformed")
        return batch * 2

    ds = dsgd.Dataset(range(N), download_func=one_hot, transform=double_and_record, batch_size=4)
    counter2x2.train(dataset=ds)
    pids = {int(p.rsplit("-", 1)[1]) for p in glob.glob(str(tmp_path / "pid-*"))}
    assert pids == {info["pid"] for info in counter2x2.worker_info}
    assert os.getpid() not in pids
    np.testing.assert_array_equal(counts(counter2x2), np.full(N, 2))  # the transform's x2


def test_downloads_never_exceed_max_concurrency(counter2x2, tmp_path):
    def slow_one_hot(i):
        start = time.time()
        time.sleep(0.05)
        with open(tmp_path / f"item-{i}", "w") as f:
            f.write(f"{start} {time.time()}")
        return one_hot(i)

    ds = dsgd.Dataset(range(N), download_func=slow_one_hot, max_concurrency=3, batch_size=4)
    counter2x2.train(dataset=ds)
    events = []
    for path in glob.glob(str(tmp_path / "item-*")):
        start, end = map(float, open(path).read().split())
        events += [(start, 1), (end, -1)]
    running = np.cumsum([change for _, change in sorted(events)])
    assert len(events) == 2 * N
    assert 2 <= running.max() <= 3  # parallel, and never more than max_concurrency


def test_download_and_transform_errors_name_the_item_and_rows(counter2x2):
    def broken(i):
        if i == 13:
            raise FileNotFoundError(f"s3://bucket/item-{i} is gone")
        return one_hot(i)

    with pytest.raises(dsgd.DsgdError, match=r"download_func raised on item 13 \(13\): "
                                             r"FileNotFoundError: s3://bucket/item-13 is gone"):
        counter2x2.train(dataset=dsgd.Dataset(range(N), download_func=broken, batch_size=4))

    def bad_transform(batch):
        raise KeyError("no column 'label'")

    with pytest.raises(dsgd.DsgdError, match=r"transform raised on rows 0\.\.3 of the data: "
                                             r"KeyError") as info:
        counter2x2.train(dataset=dsgd.Dataset(range(N), download_func=one_hot,
                                              transform=bad_transform, batch_size=4))
    assert "in bad_transform" in str(info.value)  # the user's own traceback


def test_bad_train_arguments(counter2x2):
    with pytest.raises(ValueError, match=r"batch_size=3 \(per worker\) does not split evenly "
                                         r"among devices_per_worker=2"):
        counter2x2.train(dataset=dsgd.Dataset(range(N), batch_size=3))
    with pytest.raises(TypeError, match="dataset must be a dsgd.Dataset .* got list"):
        counter2x2.train(dataset=[1, 2, 3])
    with pytest.raises(ValueError, match="num_steps must be a positive int or None"):
        counter2x2.train(num_steps=0)
    with pytest.raises(ValueError, match="train\\(\\) without a dataset needs num_steps"):
        counter2x2.train()


def test_a_checkpoint_keeps_the_data_position(counter2x2, tmp_path):
    reset(counter2x2)
    ds = dsgd.Dataset(range(N), download_func=one_hot, batch_size=4)
    counter2x2.train(dataset=ds, num_steps=2)
    path = counter2x2.save_checkpoint(str(tmp_path / "ckpt"))
    counter2x2.train(dataset=ds, num_steps=3)
    counter2x2.restore_checkpoint(path)
    assert ds.position == 2 * 8
    counter2x2.train(dataset=ds, num_steps=4)  # rows 16..47: the epoch's rest, once
    np.testing.assert_array_equal(counts(counter2x2), np.ones(N, int))


def test_a_restored_checkpoint_positions_the_next_dataset_of_a_new_instance(counter2x2, tmp_path):
    """The new instance runs in this process (local=True: the same driver, one
    worker of 2 replicas): from the checkpoint's weights (items 0..15 trained
    once by 4 replicas: -1/4 each) it trains rows 16..47 once, 4 rows a step
    (-1/2 each: 2 replicas)."""
    reset(counter2x2)
    counter2x2.train(dataset=dsgd.Dataset(range(N), download_func=one_hot, batch_size=4),
                     num_steps=2)
    path = counter2x2.save_checkpoint(str(tmp_path / "ckpt"))
    with dsgd.DistributedSGD(Counter, 1, 2, gpu=False, local=True) as fresh:
        fresh.restore_checkpoint(path)
        ds = dsgd.Dataset(range(N), download_func=one_hot, batch_size=4)
        fresh.train(dataset=ds, num_steps=8)  # rows 16..47
        assert ds.position == N
        np.testing.assert_array_equal(-fresh.get_weights()[0],
                                      np.r_[np.full(16, 0.25), np.full(N - 16, 0.5)])
