"""flashqla.varlen: the chunk table the kernels read, against a plain Python walk over the sequences."""

import pytest
import torch

from flashqla.varlen import chunk_table, seq_bounds


def python_table(bounds, chunk_size):
    return [(s, min(s + chunk_size, e)) for b, e in zip(bounds, bounds[1:])
            for s in range(b, e, chunk_size)]


@pytest.mark.parametrize("lengths", [(1, 200, 777, 64, 130), (0, 64, 0, 65), (5,), (128, 128)])
def test_varlen_table(lengths):
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    cu = torch.tensor(bounds, dtype=torch.int64)
    table, first = chunk_table(cu, 1, bounds[-1], 64, torch.device("cpu"))
    want = python_table(bounds, 64)
    assert table.dtype == torch.int32 and table.shape[0] >= len(want)
    assert [tuple(r) for r in table[: len(want)].tolist()] == want
    assert all(s == e == bounds[-1] for s, e in table[len(want):].tolist())  # empty rows
    assert first.tolist() == [sum(-(-n // 64) for n in lengths[:i]) for i in range(len(lengths) + 1)]


def test_batch_table_is_exact():
    table, first = chunk_table(None, 3, 100, 64, torch.device("cpu"))
    assert [tuple(r) for r in table.tolist()] == python_table([0, 100, 200, 300], 64)
    assert first.tolist() == [0, 2, 4, 6]
    assert seq_bounds(None, 3, 100, torch.device("cpu")).tolist() == [0, 100, 200, 300]


def test_a_batch_of_empty_sequences_has_its_bounds():
    # B sequences of T = 0 tokens: B + 1 bounds, all 0 (the kernels' drivers size h0 and ht by them)
    assert seq_bounds(None, 2, 0, torch.device("cpu")).tolist() == [0, 0, 0]
    table, first = chunk_table(None, 2, 0, 64, torch.device("cpu"))
    assert table.shape[0] == 0 and first.tolist() == [0, 0, 0]


def test_cache_follows_the_tensor_and_its_edits():
    cu = torch.tensor([0, 10, 100], dtype=torch.int32)
    first = chunk_table(cu, 1, 100, 64, torch.device("cpu"))
    assert chunk_table(cu, 1, 100, 64, torch.device("cpu")) is first
    cu[1] = 70  # an in-place edit bumps the tensor's version: rebuilt
    assert chunk_table(cu, 1, 100, 64, torch.device("cpu"))[0][:2].tolist() == [[0, 64], [64, 70]]
    other = chunk_table(cu.clone(), 1, 100, 64, torch.device("cpu"))
    assert other is not first
