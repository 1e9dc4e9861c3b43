"""Bad arguments and bad models: clear errors, raised early, naming the culprit."""

import pytest
import ray

import dsgd
import tiny

GOOD = dict(model_creator=tiny.creator(1, 4), num_workers=1, devices_per_worker=1, gpu=False)


@pytest.mark.parametrize("change,error,message", [
    ({"model_creator": "not a function"}, TypeError, "model_creator must be callable"),
    ({"num_workers": 0}, ValueError, "num_workers must be a positive int, got 0"),
    ({"num_workers": 1.5}, ValueError, "num_workers must be a positive int"),
    ({"num_workers": True}, ValueError, "num_workers must be a positive int"),
    ({"devices_per_worker": -2}, ValueError, "devices_per_worker must be a positive int"),
    ({"grad_shard_bytes": 0}, ValueError, "grad_shard_bytes must be a positive int"),
    ({"num_ps": 0}, ValueError, "num_ps must be a positive int"),
    ({"strategy": "allreduce"}, ValueError, r"strategy must be one of \['simple', 'ps'\], got 'allreduce'"),
    ({"all_reduce_alg": "ring"}, ValueError, r"all_reduce_alg must be one of \['simple', 'tree', 'nccl'\]"),
    ({"all_reduce_alg": "nccl"}, ValueError, "all_reduce_alg='nccl' needs GPU devices"),
    ({"gpu": "yes"}, TypeError, "gpu must be True or False"),
    ({"step_timeout_s": 0}, ValueError, "step_timeout_s must be a positive number"),
])
def test_bad_arguments_fail_before_ray_starts(change, error, message):
    was_running = ray.is_initialized()
    with pytest.raises(error, match=message):
        dsgd.DistributedSGD(**{**GOOD, **change})
    assert ray.is_initialized() == was_running


@pytest.mark.cluster
@pytest.mark.usefixtures("ray_local")
class TestOnCluster:
    def test_gpus_that_do_not_exist_fail_fast(self):
        start = time_now()
        with pytest.raises(dsgd.ResourceError, match=r"2 GPU.*cluster has .* 0 GPU.*gpu=False"):
            dsgd.DistributedSGD(tiny.creator(2, 4), 1, 2, gpu=True)
        assert time_now() - start < 5

    def test_too_many_workers_fail_fast(self):
        with pytest.raises(dsgd.ResourceError, match=r"asked for 64 worker\(s\).*fits only 4"):
            dsgd.DistributedSGD(tiny.creator(1, 4), 64, 1, gpu=False)

    def test_model_creator_error_surfaces_with_its_traceback(self):
        def exploding_creator(worker_index, device_index):
            raise KeyError("no such dataset: imagenet-22k")

        with pytest.raises(KeyError, match="no such dataset: imagenet-22k") as info:
            dsgd.DistributedSGD(exploding_creator, 2, 1, gpu=False)
        assert "exploding_creator" in str(info.value)

    def test_model_creator_must_return_a_model(self):
        with pytest.raises(TypeError, match=r"model_creator\(0, 0\) must return a dsgd.Model, got str"):
            dsgd.DistributedSGD(lambda w, d: "model", 1, 1, gpu=False)

    def test_replicas_with_different_shapes_in_one_worker(self):
        def creator(w, d):
            return tiny.TinyModel(w, d, 2, 4) if d == 0 else WideReplica(w, d)

        with pytest.raises(dsgd.ModelMismatchError,
                           match=r"worker 0: replica 1: variable 0 .* is float32\(5, 9\) but replica 0's"):
            dsgd.DistributedSGD(creator, 1, 2, gpu=False)

    def test_workers_with_different_shapes(self):
        def creator(w, d):
            return tiny.TinyModel(w, d, 1, 4) if w == 0 else WideReplica(w, d)

        with pytest.raises(dsgd.ModelMismatchError, match=r"worker 1's replicas .* variable 0"):
            dsgd.DistributedSGD(creator, 2, 1, gpu=False)

    def test_replicas_sharing_one_model(self):
        shared = {}

        def creator(w, d):
            if "model" not in shared:
                shared["model"] = tiny.TinyModel(w, d, 2, 4)
            return shared["model"]

        with pytest.raises(dsgd.ModelMismatchError, match="shares variable 0"):
            dsgd.DistributedSGD(creator, 1, 2, gpu=False)


class WideReplica(tiny.TinyModel):
    def __init__(self, worker_index, device_index):
        import keras

        super().__init__(worker_index, device_index, 2, 4)
        self.model = keras.Sequential([keras.Input((tiny.IN,)), keras.layers.Dense(9),
                                       keras.layers.Dense(tiny.OUT)])


def time_now():
    import time

    return time.monotonic()
