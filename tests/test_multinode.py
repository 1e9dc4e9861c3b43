"""Two Ray nodes with separate object stores (ray.cluster_utils.Cluster): workers
and PS actors on different nodes give the same exact result as one process."""

import numpy as np
import pytest
import ray
from ray.cluster_utils import Cluster

import dsgd
import tiny

pytestmark = [pytest.mark.multinode, pytest.mark.slow]

BATCH, STEPS = 4, 3
NODE_STORE_BYTES = 100 * 2**20


@pytest.fixture(scope="module")
def two_nodes():
    ray.shutdown()  # the shared single-node cluster; this module runs last
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "object_store_memory": NODE_STORE_BYTES, "include_dashboard": False})
    cluster.add_node(num_cpus=1, object_store_memory=NODE_STORE_BYTES)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.mark.parametrize("strategy", ["ps", "simple"])
def test_exact_across_nodes(two_nodes, strategy, tmp_path):
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    # The default layout ("ps"): one PS per node, and the gradient (360 bytes, one 10 MB
    # shard's worth) cut so that both get a share (sharding.spread_plan: halves, but a
    # variable that fits in a shard stays whole, so 220 and 140 bytes here).
    with dsgd.DistributedSGD(tiny.creator(2, BATCH, "sgdm"), 2, 2, gpu=False,
                             strategy=strategy) as sgd:
        # One CPU per node and one CPU per worker: the workers must be on different nodes.
        assert len({info["node_id"] for info in sgd.worker_info}) == 2
        if strategy == "ps":
            assert len({info["node_id"] for info in sgd.ps_info}) == 2
            shares = [sum(sgd.plan.shards[j].nbytes for j in g) for g in sgd.shard_groups]
            assert len(shares) == 2 and min(shares) > 0, shares
        initial = sgd.get_weights()
        losses = [sgd.step(fetch_stats=True)["loss"] for _ in range(STEPS)]
        final = sgd.get_weights()
        replicas = sgd.foreach_model(lambda m: m.get_weights())
        # Checkpoints travel through the driver: no shared filesystem needed.
        path = str(tmp_path / "ckpt")
        sgd.save_checkpoint(path)
        sgd.set_weights(initial)
        sgd.restore_checkpoint(path)
        restored = sgd.foreach_model(lambda m: m.get_weights())
    expected, expected_losses = tiny.reference_run(initial, 4, BATCH, STEPS, "sgdm")
    for got, want in zip(final, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    np.testing.assert_allclose(losses, expected_losses, rtol=0, atol=1e-5)
    for weights in replicas + restored:
        for a, b in zip(weights, final, strict=True):
            np.testing.assert_array_equal(a, b)


def test_node_lost_mid_training_is_recovered_exactly(two_nodes):
    """A node with a worker and a PS actor is removed between steps: both are
    replaced on a node that is left, and training ends with the weights of an
    uninterrupted run."""
    def creator(w, d):
        return tiny.StepKeyedModel(w, d, 1, BATCH)

    def run(lose_node_at=None):
        with dsgd.DistributedSGD(creator, 2, 1, gpu=False, grad_shard_bytes=128, num_ps=2,
                                 step_timeout_s=120) as sgd:
            for i in range(4):
                if i == lose_node_at:
                    head = two_nodes.head_node.node_id
                    victims = [n for n in two_nodes.list_all_nodes()
                               if n.node_id != head and n.node_id in
                               {info["node_id"] for info in sgd.worker_info}]
                    two_nodes.remove_node(victims[0])
                sgd.step()
            return sgd.get_weights(), sgd.failures, sgd.foreach_model(lambda m: m.get_weights())

    spare = two_nodes.add_node(num_cpus=1, object_store_memory=NODE_STORE_BYTES)
    two_nodes.wait_for_nodes()
    expected, _, _ = run()
    got, failures, replicas = run(lose_node_at=2)
    assert len(failures) == 1 and "died" in failures[0]["reason"], failures
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    for weights in replicas:
        for a, b in zip(weights, got, strict=True):
            np.testing.assert_array_equal(a, b)
    del spare
