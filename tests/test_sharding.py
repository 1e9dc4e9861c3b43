"""The shard plan (pure Python): fusing, splitting, order, balance, round trips."""

import math

import numpy as np
import pytest

from dsgd.comm.sharding import (assign_shards, exchange_layout, group_shards, plan_shards,
                                 whole_plan)
from helpers import pack

SHAPES = [(5, 7), (7,), (7, 3), (3,)]  # tiny.py's variables: 140, 28, 84, 12 bytes


def random_flat(shapes, dtypes, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=math.prod(s)).astype(d) for s, d in zip(shapes, dtypes, strict=True)]


MIXED = ["float32", "float64", "float64", "float32"]


@pytest.mark.parametrize("shard_bytes,dtypes", [
    (b, d) for d in (["float32"] * 4, MIXED) for b in (4, 8, 12, 64, 100, 140, 264, 10_000_000)
    if b >= max(np.dtype(t).itemsize for t in d)])
def test_round_trip_is_bit_exact(shard_bytes, dtypes):
    plan = plan_shards(SHAPES, dtypes, shard_bytes)
    flat = random_flat(SHAPES, dtypes)
    shards = pack(plan, flat)
    assert [s.nbytes for s in plan.shards] == [a.nbytes for a in shards]
    assert all(a.nbytes <= shard_bytes for a in shards)
    assert all(a.dtype == np.dtype(s.dtype) for a, s in zip(shards, plan.shards, strict=True))
    back = plan.unpack(shards)
    for original, restored, shape in zip(flat, back, SHAPES, strict=True):
        assert restored.shape == shape
        assert restored.dtype == original.dtype
        np.testing.assert_array_equal(restored.reshape(-1), original)


def test_small_tensors_are_fused_in_reverse_order():
    plan = plan_shards(SHAPES, ["float32"] * 4, 10_000_000, align_bytes=4)
    assert plan.num_shards == 1
    assert [p.var_index for p in plan.shards[0].pieces] == [3, 2, 1, 0]
    assert [p.shard_offset for p in plan.shards[0].pieces] == [0, 3, 24, 31]


def test_large_tensor_is_split_and_shards_are_full():
    plan = plan_shards(SHAPES, ["float32"] * 4, 64, align_bytes=4)  # 16 elements per shard
    assert [s.num_elements for s in plan.shards] == [16, 16, 16, 16, 2]
    kernel = plan.pieces_of(0)  # 35 elements over four shards, after 3 + 21 + 7 others
    assert [(j, p.var_offset, p.length) for j, p in kernel] == [
        (1, 0, 1), (2, 1, 16), (3, 17, 16), (4, 33, 2)]
    assert {p.var_index for p in plan.shards[0].pieces} == {3, 2}  # bias fused with a kernel slice


def test_pieces_start_64_byte_aligned_and_padding_is_zero():
    plan = plan_shards(SHAPES, MIXED, 10_000_000)
    for shard in plan.shards:
        itemsize = np.dtype(shard.dtype).itemsize
        assert all(p.shard_offset * itemsize % 64 == 0 for p in shard.pieces)
    plan = plan_shards(SHAPES, ["float32"] * 4, 128)  # 32 elements a shard, pieces at multiples of 16
    layout = [[(p.var_index, p.shard_offset, p.length) for p in s.pieces] for s in plan.shards]
    assert layout == [[(3, 0, 3)], [(2, 0, 21)], [(1, 0, 7), (0, 16, 16)], [(0, 0, 19)]]
    packed = pack(plan, random_flat(SHAPES, ["float32"] * 4))
    np.testing.assert_array_equal(packed[2][7:16], 0)


def test_a_variable_that_fits_in_a_shard_is_never_split():
    shapes = [(10,), (30,), (5,), (100,)]
    plan = plan_shards(shapes, ["float32"] * 4, 160)  # 40 elements
    for v, shape in enumerate(shapes):
        pieces = plan.pieces_of(v)
        assert len(pieces) == (1 if shape[0] <= 40 else 3), (v, pieces)


def test_dtypes_never_share_a_shard():
    plan = plan_shards(SHAPES, MIXED, 10_000_000)
    assert [s.dtype for s in plan.shards] == ["float32", "float64", "float32"]


def test_shard_smaller_than_element():
    with pytest.raises(ValueError, match="grad_shard_bytes=2 is smaller than one element"):
        plan_shards(SHAPES, ["float32"] * 4, 2)


@pytest.mark.parametrize("bad", [0, -1, 1.5, None])
def test_bad_shard_bytes(bad):
    with pytest.raises(ValueError, match="grad_shard_bytes must be a positive int"):
        plan_shards(SHAPES, ["float32"] * 4, bad)


def test_whole_plan_is_one_unsplit_shard_per_variable():
    plan = whole_plan(SHAPES, ["float32"] * 4)
    assert plan.num_shards == 4
    flat = random_flat(SHAPES, ["float32"] * 4)
    for a, b in zip(pack(plan, flat), flat, strict=True):
        np.testing.assert_array_equal(a, b)


def test_assign_balances_bytes():
    sizes = [40, 40, 40, 40, 8]
    owner = assign_shards(sizes, 2)
    load = [sum(s for s, o in zip(sizes, owner, strict=True) if o == p) for p in range(2)]
    assert sorted(load) == [80, 88]
    assert assign_shards(sizes, 2) == owner  # deterministic
    assert assign_shards(sizes, 1) == [0] * 5  # more shards than PS actors
    assert sorted(set(assign_shards([10, 9, 8], 3))) == [0, 1, 2]
    with pytest.raises(ValueError, match="num_ps must be >= 1"):
        assign_shards(sizes, 0)


def test_groups_are_one_per_ps_in_first_shard_order():
    owner = [1, 0, 1, 0, 1]
    assert group_shards(owner) == ((0, 2, 4), (1, 3))
    assert group_shards([0, 0, 0]) == ((0, 1, 2),)
    assert group_shards([2, 0, 1, 0]) == ((0,), (1, 3), (2,))
    # Every shard appears exactly once and each group has one PS.
    groups = group_shards(owner)
    assert sorted(j for g in groups for j in g) == list(range(5))
    assert all(len({owner[j] for j in g}) == 1 for g in groups)


def test_default_num_ps_is_one_per_worker_node_across_nodes_and_one_per_worker_on_one():
    from dsgd.comm.param_server import default_num_ps, ps_nodes

    one_node, two_nodes = ["a"] * 4, ["a", "a", "b", "b"]
    assert default_num_ps(num_shards=100, num_workers=4, worker_nodes=one_node) == 4
    assert default_num_ps(num_shards=100, num_workers=4, worker_nodes=two_nodes) == 2
    assert default_num_ps(num_shards=3, num_workers=8, worker_nodes=one_node * 2) == 3
    assert default_num_ps(num_shards=1, num_workers=4, worker_nodes=two_nodes) == 1
    # Round-robin over the distinct nodes: no node holds two PS while another holds none.
    assert ps_nodes([0, 1], two_nodes) == ["a", "b"]
    assert ps_nodes([0, 1, 2, 3], two_nodes) == ["a", "b", "a", "b"]
    assert ps_nodes([1], ["b", "a", "b"]) == ["a"]
    assert ps_nodes([0, 1], one_node) == ["a", "a"]


def test_spread_plan_gives_every_ps_an_equal_share_within_the_cap():
    from dsgd.comm.sharding import spread_plan, spread_shard_bytes

    shapes, dtypes = [(10_000_000,)] * 4, ["float32"] * 4  # 160 MB, tensors larger than a shard
    for num_ps, shards_per_ps in ((64, 1), (8, 2), (2, 8)):
        plan = spread_plan(shapes, dtypes, 10_000_000, num_ps)
        layout = exchange_layout(plan, num_ps)
        shares = [sum(plan.shards[j].nbytes for j in g) for g in layout.groups]
        assert len(shares) == num_ps and max(shares) - min(shares) <= max(shares) // 1000, shares
        assert plan.num_shards == num_ps * shards_per_ps
        assert max(s.nbytes for s in plan.shards) <= 10_000_000
    # One PS (one node): the plan as plan_shards makes it, shards at the cap.
    assert spread_plan(shapes, dtypes, 10_000_000, 1) == plan_shards(shapes, dtypes, 10_000_000)
    assert spread_shard_bytes(160_000_000, 10_000_000, 8) == 10_000_000
    assert spread_shard_bytes(160_000_000, 10_000_000, 64) == 2_500_032  # 64-byte aligned
    assert spread_shard_bytes(4, 10_000_000, 2) == 64  # never below one aligned piece
    assert spread_shard_bytes(4, 32, 2) == 32  # nor above the cap
