"""dsgd.Dataset without a cluster: batching, stream positions, argument errors."""

import numpy as np
import pytest

import dsgd
from dsgd.data import batching
from dsgd.data.stream import BlockStream


def test_stack_position_by_position():
    examples = [(np.full((2,), i, np.float32), i) for i in range(3)]
    x, y = batching.stack(examples, lambda i: f"item {i}")
    np.testing.assert_array_equal(x, [[0, 0], [1, 1], [2, 2]])
    np.testing.assert_array_equal(y, [0, 1, 2])
    batch = batching.stack([{"a": 1, "b": (2, 3)}, {"a": 4, "b": (5, 6)}], str)
    np.testing.assert_array_equal(batch["b"][1], [3, 6])
    np.testing.assert_array_equal(batching.stack([0.5, 0.25], str), [0.5, 0.25])


def test_stack_errors_name_the_items():
    with pytest.raises(ValueError, match=r"item 1 has structure .* but item 0 has"):
        batching.stack([(1, 2), 3], lambda i: f"item {i}")
    with pytest.raises(ValueError, match=r"item 0\.\.item 1 cannot be stacked at position \[0\]"):
        batching.stack([(np.zeros(2), 1), (np.zeros(3), 1)], lambda i: f"item {i}")


def test_take_rows_is_a_view_within_one_block_and_concatenates_across():
    a = (np.arange(10), np.arange(10) * 10)
    b = (np.arange(10, 14), np.arange(10, 14) * 10)
    one = batching.take_rows([a], [(2, 5)])
    assert np.shares_memory(one[0], a[0])
    np.testing.assert_array_equal(one[1], [20, 30, 40])
    two = batching.take_rows([a, b], [(8, 10), (0, 2)])
    np.testing.assert_array_equal(two[0], [8, 9, 10, 11])


def test_split_among_replicas():
    parts = batching.split({"x": np.arange(6)}, 3)
    assert [p["x"].tolist() for p in parts] == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="batch of 5 rows does not split evenly among 2 replicas"):
        batching.split(np.arange(5), 2)
    with pytest.raises(ValueError, match=r"different numbers of rows: \[2, 3\]"):
        batching.num_rows((np.zeros(2), np.zeros(3)))


def test_stream_positions_wrap_around_the_data():
    stream = BlockStream(list(range(10)), None, 1, block_rows=4)  # blocks [0-3] [4-7] [8-9]
    assert stream.spans(0, 4) == [(0, 0, 4)]
    assert stream.spans(6, 6) == [(1, 2, 4), (2, 0, 2), (0, 0, 2)]  # rows 6..11 -> items 6..9, 0, 1
    assert stream.spans(23, 2) == [(0, 3, 4), (1, 0, 1)]  # row 23 is item 3


def test_a_generator_is_read_as_far_as_needed_then_repeats():
    pulled = []

    def items():
        for i in range(5):
            pulled.append(i)
            yield i

    stream = BlockStream(items(), None, 1, block_rows=2)
    assert stream.spans(0, 2) == [(0, 0, 2)] and stream.length is None and len(pulled) <= 2
    assert stream.spans(4, 3) == [(2, 0, 1), (0, 0, 2)]  # rows 4, 5, 6 -> items 4, 0, 1
    assert stream.length == 5


@pytest.mark.parametrize("kwargs,error,message", [
    ({"data": 5}, TypeError, "data must be an iterable of items .* got int"),
    ({"data": "abc"}, TypeError, "data must be an iterable"),
    ({"data": {"x": [1]}}, TypeError, r"data is a dict; pass a sequence of examples"),
    ({"data": []}, ValueError, "data is empty: it holds no item"),
    ({"data": (i for i in [])}, ValueError, "data is empty: the iterable yielded no item"),
    ({"data": [1], "batch_size": 0}, ValueError, "batch_size must be a positive int, got 0"),
    ({"data": [1], "batch_size": True}, ValueError, "batch_size must be a positive int"),
    ({"data": [1], "max_concurrency": -1}, ValueError, "max_concurrency must be a positive int"),
    ({"data": [1], "download_func": "f"}, TypeError, "download_func must be callable or None"),
    ({"data": [1], "transform": 3}, TypeError, "transform must be callable or None, got int"),
])
def test_bad_arguments_are_clear_errors(kwargs, error, message):
    data = kwargs.pop("data")
    with pytest.raises(error, match=message):
        dsgd.Dataset(data, **kwargs)


def test_a_generator_is_not_read_beyond_its_first_item_by_the_constructor():
    pulled = []

    def items():
        for i in range(3):
            pulled.append(i)
            yield i

    ds = dsgd.Dataset(items(), batch_size=2)
    assert pulled == [0] and ds.num_items is None
    assert dsgd.Dataset(range(7)).num_items == 7
