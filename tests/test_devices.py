"""Which devices the replicas use: `gpu=None` (the default of the engine and the
Trainer) uses the GPUs the cluster has and says so at start."""

import logging

import pytest
import ray

import dsgd
import tiny
import trainer_ops
from dsgd.config import Config
from dsgd.engine import resources

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("ray_local")]


def test_default_on_a_cluster_without_gpus_is_cpu_and_said(caplog):
    caplog.set_level(logging.INFO, logger="dsgd")
    with dsgd.DistributedSGD(tiny.creator(1, 4), 1, 1, local=True) as sgd:
        assert sgd.config.gpu is False
        assert sgd.worker_info[0]["devices"] == ["/device:CPU:0"]
    assert "training on CPU: the cluster has no GPU (gpu=None)" in caplog.text


def test_trainer_default_is_the_engines(caplog):
    caplog.set_level(logging.INFO, logger="dsgd")
    with dsgd.Trainer(trainer_ops.Classifier, num_workers=1, local=True,
                      config={dsgd.BATCH_SIZE: 16}) as trainer:
        assert trainer.sgd.config.gpu is False
        assert trainer.sgd.for_model(lambda m: m.operator.device) == "/device:CPU:0"
    assert caplog.text.count("training on CPU") == 1  # said once, by the Trainer


def nodes_with_gpus(*gpus):
    return lambda: [{"Alive": True, "Resources": {"CPU": 8.0, "GPU": float(g)}} for g in gpus]


def test_none_follows_the_clusters_gpus(monkeypatch, caplog):
    """The decision alone (no GPU here): what a cluster with GPUs reports."""
    caplog.set_level(logging.INFO, logger="dsgd")
    monkeypatch.setattr(ray, "nodes", nodes_with_gpus(4, 4))
    assert resources.resolve_gpu(None, 4, 2) is True
    assert "training on GPUs: 4 worker(s) x 2 GPU(s) (the cluster has 8 GPU(s)" in caplog.text
    caplog.clear()
    # Too few GPUs for every worker (3 on one node fit one 2-GPU worker): CPU, said louder.
    monkeypatch.setattr(ray, "nodes", nodes_with_gpus(3, 1))
    assert resources.resolve_gpu(None, 2, 2) is False
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "the cluster has 4 GPU(s), room for 1 of the 2 worker(s) x 2 GPU(s)" in caplog.text
    caplog.clear()
    assert resources.resolve_gpu(False, 4, 2) is False  # an explicit choice stands, unsaid
    assert resources.resolve_gpu(True, 4, 2) is True
    assert caplog.text == ""


def test_config_takes_none_and_refuses_other_values():
    assert Config(tiny.creator(1, 4), 1, 1).gpu is None
    assert Config(tiny.creator(1, 4), 1, 1).with_gpu(True).gpu is True
    with pytest.raises(TypeError, match="gpu must be True or False"):
        Config(tiny.creator(1, 4), 1, 1, gpu="auto")
    with pytest.raises(ValueError, match="all_reduce_alg='nccl' needs GPU devices"):
        Config(tiny.creator(2, 4), 1, 2, all_reduce_alg="nccl").with_gpu(False)
    with pytest.raises(TypeError, match="use_gpu must be True, False or None"):
        dsgd.Trainer(trainer_ops.Classifier, use_gpu="yes")


def test_workers_are_built_with_the_decided_gpu_not_the_asked_none():
    """gpu=None decided True (a cluster with GPUs) reserves GPUs for the workers and
    must build their replicas on them: the worker actors' arguments come from the
    decided config (launch.worker_args). Before the launcher they were given the
    `gpu` argument as asked, None, and built CPU replicas on GPU reservations."""
    from dsgd.engine import launch

    asked = Config(model_creator=tiny.creator(1, 4), num_workers=2, devices_per_worker=1)
    assert asked.gpu is None
    for decided in (True, False):
        args = launch.worker_args(asked.with_gpu(decided))
        assert args[2] is decided
        options = launch.worker_options(asked.with_gpu(decided)) if not decided else None
        assert options is None or "num_gpus" not in options
