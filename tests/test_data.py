"""dsgd.Dataset and DistributedSGD.train on the local Ray cluster: coverage per
epoch, where transforms run, download concurrency, errors. (Ray Data:
test_data_ray.py; a worker killed mid-train: test_recovery.py.)"""

import glob
import os
import time

import numpy as np
import pytest

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


def test_uneven_data_oversamples_at_the_wrap():
    with dsgd.DistributedSGD(Counter, 2, 1, gpu=False) as sgd:
        reset(sgd)
        ds = dsgd.Dataset([one_hot(i) for i in range(44)], batch_size=4)  # 44 = 5.5 steps
        assert sgd.train(dataset=ds)["steps"] == 6
        expected = np.ones(N, int)
        expected[:4] += 1  # rows 44..47 wrap around to items 0..3
        expected[44:] = 0
        np.testing.assert_array_equal(counts(sgd), expected)


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
    reset(counter2x2)
    counter2x2.train(dataset=dsgd.Dataset(range(N), download_func=one_hot, batch_size=4),
                     num_steps=2)
    path = counter2x2.save_checkpoint(str(tmp_path / "ckpt"))
    with dsgd.DistributedSGD(Counter, 2, 2, gpu=False) as fresh:
        fresh.restore_checkpoint(path)
        ds = dsgd.Dataset(range(N), download_func=one_hot, batch_size=4)
        fresh.train(dataset=ds, num_steps=4)  # rows 16..47
        assert ds.position == N
        np.testing.assert_array_equal(counts(fresh), np.ones(N, int))
