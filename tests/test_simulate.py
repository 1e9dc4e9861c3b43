"""The scaling simulator (benchmarks/simulate/sim.py): its closed-form corners and
the directions every change must move it in. Pure Python, no Ray."""

import dataclasses
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks",
                                "simulate"))

import profiles  # noqa: E402
import sim  # noqa: E402

MIB = 2**20
FREE = sim.Costs(put_s=0.0, put_bw=math.inf, call_s=0.0, rpc_s=0.0, pull_s=0.0,
                 sum_bw=math.inf, mem_bw=math.inf)
COSTS = sim.Costs(put_s=0.5e-3, put_bw=2e9, call_s=0.25e-3, rpc_s=0.5e-3, pull_s=2e-3,
                  sum_bw=10e9, mem_bw=5e9, fresh_bw=30e9, apply_s=1e-3, apply_bw=4e9)
# Closed-form corners: exact re-rating (Hardware.net_quantum_s 0)
FAST = sim.Hardware(link_bw=1e15, link_latency_s=0.0, gpu=False, net_quantum_s=0.0)


def flat(mib=8.0, compute_s=0.05):
    return profiles.flat_workload(mib, 8, compute_s)


def test_free_exchange_costs_only_the_compute_and_apply():
    w = flat()
    k = dataclasses.replace(FREE, apply_s=1e-3, apply_bw=4e9)
    one = sim.simulate("dsgd", w, FAST, k, 1)
    for overlap in (False, True):
        many = sim.simulate("dsgd", w, FAST, k, 4, shard_bytes=MIB, num_ps=4, overlap=overlap)
        assert many["step_s"] == pytest.approx(one["step_s"], rel=1e-6)
    assert one["step_s"] == pytest.approx(0.05 + 1e-3 + w.grad_bytes / 4e9)


def test_link_time_is_the_busiest_nic_direction():
    # Compute-free, after the backward pass, two nodes, one PS on node 0: worker 1
    # uploads G and downloads G over its own NIC, one after the other.
    w = flat(mib=8.0, compute_s=0.0)
    rate = 100e6
    hw = sim.Hardware(link_bw=rate, link_efficiency=1.0, link_latency_s=0.0, gpu=False,
                      net_quantum_s=0.0)
    r = sim.simulate("dsgd", w, hw, FREE, 2, shard_bytes=64 * MIB, num_ps=1, overlap=False)
    assert r["step_s"] == pytest.approx(2 * w.grad_bytes / rate, rel=1e-6)


def test_a_link_never_carries_more_than_its_rate():
    """Nodes 1 -> 2, 0 -> 2 and 0 -> 3, 10 MB each at t = 0 on 100 MB/s links: node 0's
    uplink and node 2's downlink each carry two transfers, so all three move at
    50 MB/s and arrive at 0.2 s. The FIFO booking this model replaced freed node
    0's uplink at 0.1 s while the 0 -> 2 transfer waited for node 2's downlink until
    then, so its bytes and the 0 -> 3 transfer's left node 0 in [0.1, 0.2] together
    (arrivals 0.1, 0.2, 0.2): 200 MB/s on a 100 MB/s link, which the check sees."""
    rate, size = 100e6, 10e6
    fifo_booking = [(1, 2, 0.0, 0.1, size), (0, 2, 0.1, 0.2, size), (0, 3, 0.1, 0.2, size)]
    assert sim.link_overload(fifo_booking, rate) == pytest.approx(rate)

    hw = sim.Hardware(link_bw=rate, link_efficiency=1.0, link_latency_s=0.0, gpu=False)
    eng, log, arrived = sim.Engine(), [], {}
    net = sim.Network(eng, 4, hw, FREE, sim.Cores(None), log)
    for src, dst in ((1, 2), (0, 2), (0, 3)):
        net.send(0.0, src, dst, size, lambda t, key=(src, dst): arrived.__setitem__(key, t))
    eng.run()
    assert arrived == pytest.approx({(1, 2): 0.2, (0, 2): 0.2, (0, 3): 0.2})
    assert sim.link_overload(log, rate) <= 1e-6 * rate
    assert sum(m[4] for m in log) == pytest.approx(3 * size)


def test_a_share_left_unused_by_a_transfer_held_elsewhere_goes_to_the_others():
    """Max-min fairness: 0 -> 2, 1 -> 2 and 4 -> 2 share node 2's downlink (33.3 MB/s
    each); 1 -> 3 shares node 1's uplink with 1 -> 2, which node 2 holds at 33.3, so
    it gets the other 66.7 MB/s, not an equal 50: 10 MB in 0.15 s. (Equal shares of
    each link, min of the two, left 16.7 MB/s of node 1's uplink unused.)"""
    hw = sim.Hardware(link_bw=100e6, link_efficiency=1.0, link_latency_s=0.0, gpu=False,
                      net_quantum_s=0.0)
    eng, arrived, log = sim.Engine(), {}, []
    net = sim.Network(eng, 5, hw, FREE, sim.Cores(None), log)
    for src, dst in ((0, 2), (1, 2), (4, 2), (1, 3)):
        net.send(0.0, src, dst, 10e6, lambda t, key=(src, dst): arrived.__setitem__(key, t))
    eng.run()
    assert arrived == pytest.approx({(0, 2): 0.3, (1, 2): 0.3, (4, 2): 0.3, (1, 3): 0.15})
    assert sim.link_overload(log, 100e6) <= 1e-6 * 100e6


def test_a_transfer_speeds_up_when_its_link_frees():
    """0 -> 1 (10 MB) and 0 -> 2 (5 MB) share node 0's uplink at 50 MB/s each until
    the short one arrives at 0.1 s; the long one then has the link alone: 5 MB
    left at 100 MB/s, arriving at 0.15 s (plus the link latency, once)."""
    hw = sim.Hardware(link_bw=100e6, link_efficiency=1.0, link_latency_s=1e-3, gpu=False)
    eng, arrived = sim.Engine(), {}
    net = sim.Network(eng, 3, hw, FREE, sim.Cores(None))
    for dst, size in ((1, 10e6), (2, 5e6)):
        net.send(0.0, 0, dst, size, lambda t, dst=dst: arrived.__setitem__(dst, t))
    eng.run()
    assert arrived == pytest.approx({1: 0.151, 2: 0.101})


def test_incast_past_the_fan_in_shrinks_the_downlink():
    """Four 10 MB transfers into node 0 on 100 MB/s links: 0.4 s with fair sharing;
    with Hardware.incast_fan_in 2 the downlink delivers 2/4 of its rate: 0.8 s."""
    for fan_in, want in ((None, 0.4), (2, 0.8)):
        hw = sim.Hardware(link_bw=100e6, link_efficiency=1.0, link_latency_s=0.0, gpu=False,
                          incast_fan_in=fan_in)
        eng, arrived = sim.Engine(), []
        net = sim.Network(eng, 5, hw, FREE, sim.Cores(None))
        for src in range(1, 5):
            net.send(0.0, src, 0, 10e6, arrived.append)
        eng.run()
        assert arrived == pytest.approx([want] * 4)


def test_serving_pulls_queues_on_the_serving_node():
    """With the pull's cost all serving work (Costs.pull_serve_s = pull_s), the N
    workers' pulls of one PS's mean queue on its node: the step grows by about
    (N - 1) pull_s over the same cost as requester latency."""
    w = flat(mib=1.0, compute_s=0.01)
    latency = dataclasses.replace(FREE, pull_s=2e-3)
    served = dataclasses.replace(latency, pull_serve_s=2e-3)
    steps = [sim.simulate("dsgd", w, FAST, k, 8, shard_bytes=64 * MIB, num_ps=1,
                          overlap=False)["step_s"] for k in (latency, served)]
    # the PS's node pulls 7 parts (served by 7 workers: in parallel), then 7 workers
    # pull the mean from the PS's node, one after the other
    assert steps[1] - steps[0] == pytest.approx(6 * 2e-3, rel=1e-3)


@pytest.mark.parametrize("algorithm", ["dsgd", "byteps"])
def test_re_rating_on_a_grid_agrees_with_exact_re_rating(algorithm):
    """The network re-rates on a 10 µs grid (Hardware.net_quantum_s, what makes 256
    workers take seconds): ResNet-50 on V100, 16 workers at 25 Gb/s, the step within
    0.5 % of exact re-rating's."""
    w, _ = profiles.gpu_workload("resnet50", "V100")
    costs = COSTS if algorithm == "dsgd" else None
    options = {"params": sim.BytePSParams(partition_bytes=w.grad_bytes // 16)} \
        if algorithm == "byteps" else {}
    steps = [sim.simulate(algorithm, w, sim.Hardware(link_bw=25e9 / 8, net_quantum_s=q), costs,
                          16, **options)["step_s"] for q in (0.0, 10e-6)]
    assert steps[1] == pytest.approx(steps[0], rel=5e-3)


@pytest.mark.parametrize("algorithm, options", [
    ("dsgd", {"shard_bytes": 4 * MIB, "num_ps": 16}),
    ("dsgd", {"shard_bytes": 4 * MIB, "num_ps": 16, "prefetch": True}),
    ("dsgd", {"shard_bytes": MIB, "num_ps": 16, "prefetch": True,
              "deadline_min_bytes": 256 * 1024}),
    ("dsgd", {"shard_bytes": 4 * MIB, "num_ps": 4, "overlap": False}),
    ("dsgd", {"shard_bytes": MIB, "num_ps": 16, "prefetch": True, "metas_with_last": True}),
    ("dsgd", {"shard_bytes": MIB, "num_ps": 16, "prefetch": True,
              "deadline_min_bytes": 256 * 1024, "two_level": True}),
    ("dsgd", {"shard_bytes": 4 * MIB, "num_ps": 16, "two_level": True}),
    ("byteps", {}),
])
def test_no_link_carries_more_than_its_rate_in_a_whole_simulation(algorithm, options):
    log = []
    hw = sim.Hardware(link_bw=1e9, gpu=True)
    w = profiles.sleepy_workload(8, 0.005, 0.01)
    sim.simulate(algorithm, w, hw, COSTS, 16, link_log=log, **options)
    assert len(log) > 16 and sim.link_overload(log, hw.rate) <= 1e-9 * sum(m[4] for m in log)


def test_slower_links_more_workers_and_costlier_calls_never_speed_dsgd_up():
    w = profiles.sleepy_workload(8, 0.005, 0.01)
    hw = sim.Hardware(link_bw=1e9, gpu=False)
    base = sim.simulate("dsgd", w, hw, COSTS, 8, shard_bytes=4 * MIB, num_ps=8)["step_s"]
    slower = sim.simulate("dsgd", w, dataclasses.replace(hw, link_bw=0.25e9), COSTS, 8,
                          shard_bytes=4 * MIB, num_ps=8)["step_s"]
    costly = sim.simulate("dsgd", w, hw, dataclasses.replace(COSTS, call_s=5e-3), 8,
                          shard_bytes=4 * MIB, num_ps=8)["step_s"]
    more = sim.simulate("dsgd", w, hw, COSTS, 32, shard_bytes=4 * MIB, num_ps=8)["step_s"]
    assert slower > base and costly > base and more > base


def test_metas_riding_with_the_last_bucket_skip_the_gather_and_wait_for_that_bucket():
    # The what-if: no gather call on PS 0 (the meta leaves with the last bucket), and
    # the step is decided only once that bucket is summed and its answer is back.
    w = profiles.sleepy_workload(8, 0.005, 0.01)
    hw = sim.Hardware(link_bw=1e9, gpu=False)
    k = dataclasses.replace(COSTS, call_s=2e-3)
    options = {"shard_bytes": 4 * MIB, "num_ps": 8}
    gather = sim.simulate("dsgd", w, hw, k, 16, **options)["worker0_s"]
    ride = sim.simulate("dsgd", w, hw, k, 16, metas_with_last=True, **options)["worker0_s"]
    assert ride["meta_sent"] == ride["last_bucket_sent"]
    assert gather["meta_sent"] >= gather["last_bucket_sent"] + k.call_s
    assert ride["decided"] > ride["metas_gathered"] > ride["last_bucket_sent"]


def test_overlap_hides_the_exchange_behind_the_backward_pass():
    # 8 layers of 4 MiB whose backward takes 20 ms each; a link fast enough to move
    # one bucket within one layer's backward: the overlapped step pays far less of
    # the exchange than the step that sends after the backward pass.
    w = profiles.sleepy_workload(8, 0.01, 0.02)
    hw = sim.Hardware(link_bw=2e9, gpu=False)
    one = sim.simulate("dsgd", w, hw, COSTS, 1)["step_s"]
    after = sim.simulate("dsgd", w, hw, COSTS, 2, shard_bytes=4 * MIB, num_ps=2,
                         overlap=False)["step_s"]
    during = sim.simulate("dsgd", w, hw, COSTS, 2, shard_bytes=4 * MIB, num_ps=2,
                          overlap=True)["step_s"]
    assert one < during < after
    assert during - one < 0.5 * (after - one)


def test_shared_cores_slow_the_emulated_cluster():
    w = flat(mib=8.0, compute_s=0.02)
    hw = sim.Hardware(link_bw=50e6, gpu=False)
    k = dataclasses.replace(COSTS, xfer_cpu_bw=1e9)
    alone = sim.simulate("dsgd", w, hw, k, 8, shard_bytes=MIB, num_ps=8, overlap=False)
    shared = sim.simulate("dsgd", w, dataclasses.replace(hw, host_cores=2), k, 8,
                          shard_bytes=MIB, num_ps=8, overlap=False)
    assert shared["step_s"] > alone["step_s"]


def test_ring_allreduce_matches_its_closed_form():
    # One gradient, ready at once, one buffer: 2(n-1) steps of S/n plus their latency.
    w = sim.Workload("one", ((1024, 1024),), (0.0,), 0.0, update_bytes_factor=0.0)
    hw = sim.Hardware(link_bw=1e9, link_efficiency=1.0, link_latency_s=0.0)
    params = sim.RingParams(cycle_s=1e-9, hop_s=0.0)
    for n in (2, 8, 64):
        r = sim.simulate("ring", w, hw, None, n, params=params)
        assert r["buffers"] == 1
        assert r["step_s"] == pytest.approx(2 * (n - 1) / n * 4 * MIB / 1e9, rel=1e-3)


def test_the_emulated_ring_is_checked_against_the_ring_model_at_its_tcp_rate():
    # check.py's row for a Horovod run of emulated_ring.py: the compute from the run's
    # own one-rank step, the ring at the measured link rate, the host's update after it.
    import check

    cal = {"apply": {"apply_s": 0.0, "apply_bw": 2e9}}
    run = {"system": "horovod", "nodes": 4, "model": "flat", "latency_ms": 0.0,
           "model_params": {"mib": 8.0, "num_variables": 16},
           "measured_link": {"one_way_mbit": 160.0, "duplex_mbit": [150.0, 152.0, 150.0]},
           "one_rank_step_s": 0.02}
    r = check.simulate_ring_run(run, cal)
    floor = 2 * 3 / 4 * 8 * MIB / (150e6 / 8)
    assert r["buffers"] == 1
    assert r["step_s"] == pytest.approx(0.02 + floor, abs=1.5e-3)  # + Horovod's 1 ms cycle
    assert r["link_mbit"] == pytest.approx(150.0)
    assert check.label(run) == "4 nodes, flat 8 MiB / 16, Horovod ring (Gloo)"


def test_byteps_moves_each_partition_once_each_way():
    # Two nodes, one 4 MiB tensor in one partition on server 0: worker 1 pushes
    # S and pulls S through its NIC; PCIe and the summing are free here.
    w = sim.Workload("one", ((1024, 1024),), (0.0,), 0.0, update_bytes_factor=0.0)
    hw = sim.Hardware(link_bw=1e9, link_efficiency=1.0, link_latency_s=0.0, pcie_bw=1e18,
                      net_quantum_s=0.0)
    params = sim.BytePSParams(partition_bytes=8 * MIB, msg_s=0.0, sum_bw=1e18)
    r = sim.simulate("byteps", w, hw, None, 2, params=params)
    assert r["step_s"] == pytest.approx(2 * 4 * MIB / 1e9, rel=1e-6)


def test_backward_profile_runs_in_reverse():
    ready = sim.backward_profile([1.0, 2.0, 1.0], forward_s=1.0, backward_s=4.0)
    assert ready == pytest.approx([5.0, 4.0, 2.0])


def test_unknown_algorithm_is_named():
    with pytest.raises(ValueError, match="algorithm must be 'dsgd', 'ring' or 'byteps'"):
        sim.simulate("nccl", flat(), FAST, FREE, 2)


def test_cutting_the_tail_over_more_ps_keeps_the_bytes_and_spreads_the_last_bucket():
    """The what-if `tail_pieces`: the buckets whose fan-in would outlast the backward
    pass are cut into pieces on distinct PS; the gradient's bytes are unchanged, on
    the wire too, and the last bucket reaches several PS nodes' links instead of
    one's. (Not asserted: a shorter step. With 8 workers on 8 PS nodes the pieces
    land on nodes that already hold buckets: the busiest node's downlink carries
    388 MB a run instead of 294, and the step is 1.5 % longer.)"""
    w = profiles.sleepy_workload(8, 0.005, 0.01)
    hw = sim.Hardware(link_bw=0.5e9, link_latency_s=0.0, gpu=False)
    whole, _ = sim.dsgd_layout(w, 8, 4 * MIB, 8, None, True)
    cut, _ = sim.dsgd_layout(w, 8, 4 * MIB, 8, None, True, tail_pieces=4, link_bw=hw.link_bw)
    assert len(cut) > len(whole)
    assert sum(g[0] for g in cut) == pytest.approx(sum(g[0] for g in whole))
    assert len({g[1] for g in cut[len(whole) - 1:]}) > 1  # (the last bucket's pieces: several PS)
    moved = []
    for pieces in (0, 4):
        log = []
        sim.simulate("dsgd", w, hw, FREE, 8, shard_bytes=4 * MIB, num_ps=8, tail_pieces=pieces,
                     link_log=log)
        moved.append(sum(m[4] for m in log))
    assert moved[1] == pytest.approx(moved[0])


def test_deadline_buckets_are_the_codes_layout_and_shrink_toward_the_backward_end():
    """The what-if `deadline_min_bytes` runs `bucket_layout` with the workload's
    profile: the same groups, the later-made ones no larger than the early ones'
    (the sleepy model's 4 MiB layers, 1 MiB shards, 8 workers on 8 PS), the
    gradient's bytes unchanged."""
    from dsgd.comm.sharding import ReadyProfile, bucket_layout, exchange_layout, spread_plan

    w = profiles.sleepy_workload(8, 0.005, 0.01)
    hw = sim.Hardware(link_bw=0.5e9, link_latency_s=0.0, gpu=False)
    groups, num_ps = sim.dsgd_layout(w, 8, MIB, 8, None, True, link_bw=hw.link_bw,
                                     deadline_min_bytes=256 * 1024)
    plan = spread_plan(list(w.shapes), ["float32"] * len(w.shapes), MIB, 8)
    ready = tuple(max(w.ready_s[p.var_index] for p in s.pieces) for s in plan.shards)
    code = bucket_layout(exchange_layout(plan, num_ps), 256 * 1024,
                         ReadyProfile(ready, w.compute_s, hw.link_bw, 8))
    assert [(g[0], g[1]) for g in groups] == [
        (sum(plan.shards[j].nbytes for j in b), ps) for b, ps in zip(code.groups, code.ps_of_group)]
    sizes = [g[0] for g in groups]
    assert sum(sizes) == sum(s.nbytes for s in plan.shards)
    assert sizes[-1] < max(sizes)  # (the last-made bucket: small)


def test_two_level_plan_groups_consecutive_nodes_under_sub_aggregators_apart_from_the_root():
    """sim.two_level_plan: ceil(sqrt(N)) groups of consecutive nodes (10 workers: 3, 3,
    2, 2), each under a sub-aggregator on one of its own nodes that is not the bucket's
    root PS; a group's sub-aggregator changes from bucket to bucket."""
    w = profiles.sleepy_workload(8, 0.005, 0.01)
    n = 10
    groups, asked = sim.dsgd_layout(w, n, MIB, n, None, True)
    ps_node = [j % n for j in range(asked)]
    plan = sim.two_level_plan(groups, ps_node, n)
    assert len(groups) > 4
    for b, (_, root, _, _) in enumerate(groups):
        members = plan.members[b]
        assert sorted(members.values()) == [(0, 1, 2), (3, 4, 5), (6, 7), (8, 9)]
        assert plan.direct[b] == () and plan.fan_in(b) == 4
        for sub, nodes in members.items():
            assert sub != root and ps_node[sub] != ps_node[root] and ps_node[sub] in nodes
            assert all(plan.sub_of[b][u] == sub for u in nodes)
    assert len({sub for m in plan.members for sub in m}) > 4  # rotated over the groups' PS


def test_two_level_root_sums_one_partial_per_group_not_one_part_per_worker():
    """With two_level, each bucket's root PS handles ceil(sqrt(16)) = 4 calls a step
    and its node moves 4 partial sums in and 4 means out, where one level has 16
    calls, 15 parts in and 15 means out; every part and mean still crosses the
    network once per hop: 2N transfers per bucket against 2(N - 1) (so N / (N - 1) of
    one level's bytes)."""
    w = profiles.sleepy_workload(8, 0.005, 0.01)
    hw = sim.Hardware(link_bw=1e9, gpu=True)
    options = {"shard_bytes": MIB, "num_ps": 16, "prefetch": True}
    one = sim.simulate("dsgd", w, hw, COSTS, 16, **options)
    two = sim.simulate("dsgd", w, hw, COSTS, 16, two_level=True, **options)
    assert not one["two_level"] and two["two_level"]
    assert set(one["root_calls"]) == {16} and set(one["root_in"]) == set(one["root_out"]) == {15}
    assert set(two["root_calls"]) == {4} and set(two["root_in"]) == set(two["root_out"]) == {4}
    assert two["net_bytes"] == pytest.approx(one["net_bytes"] * 16 / 15, rel=1e-9)


def test_two_level_pays_its_sub_aggregators_puts_and_calls():
    """Nothing in the second level is free: with calls and pulls cheap and a put of
    20 ms, the last bucket's mean waits for two more puts (the partial sum's at its
    sub-aggregator, the mean's again there) and one more call than with one level."""
    w = profiles.sleepy_workload(8, 0.005, 0.01)
    hw = sim.Hardware(link_bw=1e9, gpu=False)
    k = dataclasses.replace(FREE, put_s=20e-3)
    options = {"shard_bytes": 4 * MIB, "num_ps": 16, "prefetch": True}
    one = sim.simulate("dsgd", w, hw, k, 16, **options)["step_s"]
    two = sim.simulate("dsgd", w, hw, k, 16, two_level=True, **options)["step_s"]
    assert two >= one + 2 * 20e-3


def test_two_level_at_four_workers_or_fewer_is_one_level():
    """At N <= 4 (sim.TWO_LEVEL_MIN_WORKERS 5) two_level changes nothing: the same
    step and marks as one level."""
    w = profiles.sleepy_workload(8, 0.005, 0.01)
    hw = sim.Hardware(link_bw=1e9, gpu=True)
    options = {"shard_bytes": MIB, "num_ps": 4, "prefetch": True}
    for n in (2, 4):
        one = sim.simulate("dsgd", w, hw, COSTS, n, **options)
        two = sim.simulate("dsgd", w, hw, COSTS, n, two_level=True, **options)
        assert not two["two_level"]
        assert (two["step_s"], two["worker0_s"], two["net_bytes"]) == \
            (one["step_s"], one["worker0_s"], one["net_bytes"])
    five = sim.simulate("dsgd", w, hw, COSTS, 5, two_level=True, **options)
    assert five["two_level"] and set(five["root_calls"]) == {3}  # groups 2, 2 and 1 (direct)
    with pytest.raises(ValueError, match="overlap"):
        sim.simulate("dsgd", w, hw, COSTS, 8, two_level=True, overlap=False)
